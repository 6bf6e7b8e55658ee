"""Shapes of real, published LLMs, for benchmarks and realistic-shape tests.

Values come from each model's ``config.json`` as published on the Hugging Face hub (the repo id
is in ``source``). Fields map to config keys as follows:

- ``hidden``: ``hidden_size``
- ``intermediate``: ``intermediate_size`` (dense MLP; for MoE models the dense-layer size)
- ``num_heads_q`` / ``num_heads_kv``: ``num_attention_heads`` / ``num_key_value_heads``
- ``head_dim_qk`` / ``head_dim_v``: ``head_dim`` (or ``hidden_size / num_attention_heads``);
  for MLA models ``qk_nope_head_dim + qk_rope_head_dim`` / ``v_head_dim``
- ``vocab``: ``vocab_size``; ``num_layers``: ``num_hidden_layers``
- ``num_experts``: ``num_local_experts`` / ``num_experts`` / ``n_routed_experts``
- ``moe_intermediate``: ``moe_intermediate_size`` (Mixtral, GPT-OSS: ``intermediate_size``)
- ``topk``: ``num_experts_per_tok`` / ``experts_per_token``
- ``num_shared_experts``: ``n_shared_experts``
- ``num_dense_layers``: ``first_k_dense_replace`` (leading layers with a dense MLP)

``seqlen`` is not from the config: it is the sequence length benchmarks use for the model.

GEMM shapes are given as ``(case, M, N, K)`` for ``out[M, N] = x[M, K] @ W[N, K].T``, i.e. the
weight stored ``[N, K]`` like an ``nn.Linear`` weight and passed with ``trans_b=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ModelConfig",
    "MODELS",
    "DENSE_BENCH_MODELS",
    "MOE_BENCH_MODELS",
    "get_model",
    "dense_gemm_shapes",
    "moe_gemm_shapes",
]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    intermediate: int
    num_heads_q: int
    num_heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    vocab: int
    num_layers: int
    num_experts: int = 0
    moe_intermediate: int = 0
    topk: int = 0
    num_shared_experts: int = 0
    seqlen: int = 4096
    # DeepSeek group-limited routing (``n_group`` / ``topk_group``); 0 when not used.
    n_group: int = 0
    topk_group: int = 0
    # Multi-head latent attention (DeepSeek); 0 when the model uses plain MHA/GQA.
    q_lora_rank: int = 0  # 0: queries are projected directly (``q_lora_rank: null``)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    num_dense_layers: int = 0
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim_qk - self.qk_rope_head_dim

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads_q // self.num_heads_kv


def _register(*configs: ModelConfig) -> dict[str, ModelConfig]:
    out: dict[str, ModelConfig] = {}
    for c in configs:
        if c.name in out:
            raise ValueError(f"duplicate model {c.name}")
        out[c.name] = c
    return out


MODELS: dict[str, ModelConfig] = _register(
    # ---- dense ------------------------------------------------------------------------------
    ModelConfig(
        "Llama-3.1-8B", hidden=4096, intermediate=14336, num_heads_q=32, num_heads_kv=8,
        head_dim_qk=128, head_dim_v=128, vocab=128256, num_layers=32, seqlen=8192,
        source="meta-llama/Llama-3.1-8B",
    ),
    ModelConfig(
        "Llama-3.1-70B", hidden=8192, intermediate=28672, num_heads_q=64, num_heads_kv=8,
        head_dim_qk=128, head_dim_v=128, vocab=128256, num_layers=80, seqlen=8192,
        source="meta-llama/Llama-3.1-70B",
    ),
    ModelConfig(
        "Llama-2-70B", hidden=8192, intermediate=28672, num_heads_q=64, num_heads_kv=8,
        head_dim_qk=128, head_dim_v=128, vocab=32000, num_layers=80, seqlen=4096,
        source="meta-llama/Llama-2-70b-hf",
    ),
    ModelConfig(
        "Qwen2.5-7B", hidden=3584, intermediate=18944, num_heads_q=28, num_heads_kv=4,
        head_dim_qk=128, head_dim_v=128, vocab=152064, num_layers=28, seqlen=4096,
        source="Qwen/Qwen2.5-7B",
    ),
    ModelConfig(
        "Qwen2.5-72B", hidden=8192, intermediate=29568, num_heads_q=64, num_heads_kv=8,
        head_dim_qk=128, head_dim_v=128, vocab=152064, num_layers=80, seqlen=4096,
        source="Qwen/Qwen2.5-72B",
    ),
    # Mistral-7B-v0.1 (vocab 32000; v0.3 extended the vocabulary to 32768).
    ModelConfig(
        "Mistral-7B", hidden=4096, intermediate=14336, num_heads_q=32, num_heads_kv=8,
        head_dim_qk=128, head_dim_v=128, vocab=32000, num_layers=32, seqlen=4096,
        source="mistralai/Mistral-7B-v0.1",
    ),
    # ---- MoE --------------------------------------------------------------------------------
    # Mixtral experts are full-size SwiGLU MLPs: moe_intermediate == intermediate_size.
    ModelConfig(
        "Mixtral-8x7B", hidden=4096, intermediate=14336, num_heads_q=32, num_heads_kv=8,
        head_dim_qk=128, head_dim_v=128, vocab=32000, num_layers=32,
        num_experts=8, moe_intermediate=14336, topk=2, seqlen=4096,
        source="mistralai/Mixtral-8x7B-v0.1",
    ),
    # vocab: mistralai/Mixtral-8x22B-v0.1 and -Instruct-v0.1 use the v3 tokenizer (32768); the
    # earlier community conversion (mistral-community/Mixtral-8x22B-v0.1) has 32000.
    ModelConfig(
        "Mixtral-8x22B", hidden=6144, intermediate=16384, num_heads_q=48, num_heads_kv=8,
        head_dim_qk=128, head_dim_v=128, vocab=32768, num_layers=56,
        num_experts=8, moe_intermediate=16384, topk=2, seqlen=4096,
        source="mistralai/Mixtral-8x22B-v0.1",
    ),
    # MLA: q/k head dim 192 = 128 (nope) + 64 (rope), v head dim 128; 3 leading dense layers
    # (intermediate 18432), the other 58 are MoE (256 routed + 1 shared expert, top-8 routed
    # within the top-4 of 8 expert groups).
    ModelConfig(
        "DeepSeek-V3", hidden=7168, intermediate=18432, num_heads_q=128, num_heads_kv=128,
        head_dim_qk=192, head_dim_v=128, vocab=129280, num_layers=61,
        num_experts=256, moe_intermediate=2048, topk=8, num_shared_experts=1, seqlen=4096,
        n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        num_dense_layers=3, source="deepseek-ai/DeepSeek-V3",
    ),
    # No query compression (q_lora_rank: null), no group-limited routing; 1 leading dense layer.
    ModelConfig(
        "DeepSeek-V2-Lite", hidden=2048, intermediate=10944, num_heads_q=16, num_heads_kv=16,
        head_dim_qk=192, head_dim_v=128, vocab=102400, num_layers=27,
        num_experts=64, moe_intermediate=1408, topk=6, num_shared_experts=2, seqlen=4096,
        q_lora_rank=0, kv_lora_rank=512, qk_rope_head_dim=64,
        num_dense_layers=1, source="deepseek-ai/DeepSeek-V2-Lite",
    ),
    # moe_intermediate 768 is the published config.json value (Primus-Turbo's own benchmark
    # list uses 2048). intermediate_size 6144 is in the config but every layer is MoE
    # (mlp_only_layers is empty), so no dense MLP GEMM is generated for it.
    ModelConfig(
        "Qwen3-30B-A3B", hidden=2048, intermediate=6144, num_heads_q=32, num_heads_kv=4,
        head_dim_qk=128, head_dim_v=128, vocab=151936, num_layers=48,
        num_experts=128, moe_intermediate=768, topk=8, seqlen=4096,
        source="Qwen/Qwen3-30B-A3B",
    ),
    # moe_intermediate 1536 is the published config.json value (Primus-Turbo's own benchmark
    # list uses 4096). intermediate_size 12288 is unused, as for Qwen3-30B-A3B.
    ModelConfig(
        "Qwen3-235B-A22B", hidden=4096, intermediate=12288, num_heads_q=64, num_heads_kv=4,
        head_dim_qk=128, head_dim_v=128, vocab=151936, num_layers=94,
        num_experts=128, moe_intermediate=1536, topk=8, seqlen=4096,
        source="Qwen/Qwen3-235B-A22B",
    ),
    # Experts use intermediate_size 2880; attention is 64 x 64 = 4096 wide (> hidden 2880).
    ModelConfig(
        "GPT-OSS-20B", hidden=2880, intermediate=2880, num_heads_q=64, num_heads_kv=8,
        head_dim_qk=64, head_dim_v=64, vocab=201088, num_layers=24,
        num_experts=32, moe_intermediate=2880, topk=4, seqlen=4096,
        source="openai/gpt-oss-20b",
    ),
)

#: Dense models the GEMM benchmark covers.
DENSE_BENCH_MODELS: tuple[str, ...] = (
    "Llama-3.1-8B",
    "Llama-3.1-70B",
    "Llama-2-70B",
    "Qwen2.5-7B",
    "Qwen2.5-72B",
    "Mistral-7B",
)

#: MoE models for grouped-GEMM benchmarks.
MOE_BENCH_MODELS: tuple[str, ...] = tuple(name for name, c in MODELS.items() if c.is_moe)


def get_model(model: "str | ModelConfig") -> ModelConfig:
    """Look a model up by name (a :class:`ModelConfig` is returned unchanged)."""
    if isinstance(model, ModelConfig):
        return model
    try:
        return MODELS[model]
    except KeyError:
        raise KeyError(f"unknown model {model!r}; known: {', '.join(MODELS)}") from None


def dense_gemm_shapes(model: "str | ModelConfig", m: int) -> list[tuple[str, int, int, int]]:
    """The non-expert GEMMs of one layer (plus the LM head) as ``(case, M, N, K)``.

    ``M`` is the number of tokens (``m``); the weight is ``[N, K]`` (``trans_b=True``).

    Plain MHA/GQA models: ``qkv`` (fused Q, K, V projection), ``attn_out``.
    MLA models: ``q`` (or ``q_a`` + ``q_b`` with query compression), ``kv_a`` (latent + shared
    rope key), ``kv_b`` (latent to per-head K-nope and V), ``attn_out``.
    Then ``gate_up`` (fused SwiGLU gate and up) and ``down`` for models with dense MLP layers,
    ``router``, ``shared_gate_up`` and ``shared_down`` for MoE models, and ``lm_head``.
    """
    c = get_model(model)
    hq, hkv = c.num_heads_q, c.num_heads_kv
    shapes: list[tuple[str, int, int, int]] = []
    if c.is_mla:
        if c.q_lora_rank:
            shapes.append(("q_a", m, c.q_lora_rank, c.hidden))
            shapes.append(("q_b", m, hq * c.head_dim_qk, c.q_lora_rank))
        else:
            shapes.append(("q", m, hq * c.head_dim_qk, c.hidden))
        shapes.append(("kv_a", m, c.kv_lora_rank + c.qk_rope_head_dim, c.hidden))
        shapes.append(("kv_b", m, hq * (c.qk_nope_head_dim + c.head_dim_v), c.kv_lora_rank))
    else:
        shapes.append(("qkv", m, hq * c.head_dim_qk + hkv * (c.head_dim_qk + c.head_dim_v), c.hidden))
    shapes.append(("attn_out", m, c.hidden, hq * c.head_dim_v))
    if not c.is_moe or c.num_dense_layers > 0:
        shapes.append(("gate_up", m, 2 * c.intermediate, c.hidden))
        shapes.append(("down", m, c.hidden, c.intermediate))
    if c.is_moe:
        shapes.append(("router", m, c.num_experts, c.hidden))
        if c.num_shared_experts:
            shared = c.num_shared_experts * c.moe_intermediate
            shapes.append(("shared_gate_up", m, 2 * shared, c.hidden))
            shapes.append(("shared_down", m, c.hidden, shared))
    shapes.append(("lm_head", m, c.vocab, c.hidden))
    return shapes


def moe_gemm_shapes(
    model: "str | ModelConfig", ep: int, tokens_per_expert: int
) -> list[tuple[str, int, int, int, int]]:
    """Routed-expert grouped GEMMs on one expert-parallel rank as ``(case, G, M, N, K)``.

    ``G = num_experts / ep`` local experts, each receiving ``M = tokens_per_expert`` tokens;
    expert weights are ``[G, N, K]``: ``gate_up`` N = 2 * moe_intermediate, K = hidden;
    ``down`` N = hidden, K = moe_intermediate.
    """
    c = get_model(model)
    if not c.is_moe:
        raise ValueError(f"{c.name} is not a mixture-of-experts model")
    if ep <= 0 or c.num_experts % ep:
        raise ValueError(f"{c.name}: {c.num_experts} experts cannot be split over ep={ep}")
    if tokens_per_expert <= 0:
        raise ValueError(f"tokens_per_expert must be positive, got {tokens_per_expert}")
    g = c.num_experts // ep
    return [
        ("gate_up", g, tokens_per_expert, 2 * c.moe_intermediate, c.hidden),
        ("down", g, tokens_per_expert, c.hidden, c.moe_intermediate),
    ]
