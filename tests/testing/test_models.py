"""Sanity checks of the model shape registry against the published configs."""

from __future__ import annotations

import pytest

from primus_turbo.testing import (
    DENSE_BENCH_MODELS,
    MODELS,
    MOE_BENCH_MODELS,
    ModelConfig,
    dense_gemm_shapes,
    get_model,
    moe_gemm_shapes,
)

EXPECTED = [
    "Llama-3.1-8B",
    "Llama-3.1-70B",
    "Llama-2-70B",
    "Qwen2.5-7B",
    "Qwen2.5-72B",
    "Mistral-7B",
    "Mixtral-8x7B",
    "Mixtral-8x22B",
    "DeepSeek-V3",
    "DeepSeek-V2-Lite",
    "Qwen3-30B-A3B",
    "Qwen3-235B-A22B",
    "GPT-OSS-20B",
]


def test_every_model_present():
    for name in EXPECTED:
        assert name in MODELS, name
        assert MODELS[name].name == name


def test_bench_lists():
    assert set(DENSE_BENCH_MODELS) == {
        "Llama-3.1-8B", "Llama-3.1-70B", "Llama-2-70B", "Qwen2.5-7B", "Qwen2.5-72B", "Mistral-7B"
    }
    for name in DENSE_BENCH_MODELS:
        assert not MODELS[name].is_moe
    assert set(MOE_BENCH_MODELS) == {
        "Mixtral-8x7B", "Mixtral-8x22B", "DeepSeek-V3", "DeepSeek-V2-Lite",
        "Qwen3-30B-A3B", "Qwen3-235B-A22B", "GPT-OSS-20B",
    }


@pytest.mark.parametrize("name", EXPECTED)
def test_config_consistency(name):
    c = MODELS[name]
    assert c.num_heads_q % c.num_heads_kv == 0
    assert c.gqa_group * c.num_heads_kv == c.num_heads_q
    assert c.head_dim_qk % 16 == 0 and c.head_dim_v % 16 == 0
    assert c.hidden % 64 == 0 and c.vocab > 0 and c.num_layers > 0
    assert c.source
    if c.is_moe:
        assert c.moe_intermediate > 0 and 0 < c.topk <= c.num_experts
        if c.n_group:
            assert c.num_experts % c.n_group == 0 and 0 < c.topk_group <= c.n_group
    else:
        assert c.moe_intermediate == c.topk == c.num_shared_experts == 0
    if c.is_mla:
        assert c.qk_rope_head_dim > 0 and c.qk_nope_head_dim > 0
    else:
        assert c.head_dim_qk == c.head_dim_v
        assert c.qk_rope_head_dim == 0
    with pytest.raises(Exception):
        c.hidden = 1  # frozen


@pytest.mark.parametrize(
    "name,values",
    [
        ("Llama-3.1-8B", (4096, 14336, 32, 8, 128, 128256, 32)),
        ("Llama-3.1-70B", (8192, 28672, 64, 8, 128, 128256, 80)),
        ("Llama-2-70B", (8192, 28672, 64, 8, 128, 32000, 80)),
        ("Qwen2.5-7B", (3584, 18944, 28, 4, 128, 152064, 28)),
        ("Qwen2.5-72B", (8192, 29568, 64, 8, 128, 152064, 80)),
        ("Mistral-7B", (4096, 14336, 32, 8, 128, 32000, 32)),
        ("Mixtral-8x7B", (4096, 14336, 32, 8, 128, 32000, 32)),
        ("Mixtral-8x22B", (6144, 16384, 48, 8, 128, 32768, 56)),
        ("Qwen3-30B-A3B", (2048, 6144, 32, 4, 128, 151936, 48)),
        ("Qwen3-235B-A22B", (4096, 12288, 64, 4, 128, 151936, 94)),
        ("GPT-OSS-20B", (2880, 2880, 64, 8, 64, 201088, 24)),
    ],
)
def test_published_values(name, values):
    c = MODELS[name]
    assert (c.hidden, c.intermediate, c.num_heads_q, c.num_heads_kv, c.head_dim_qk, c.vocab, c.num_layers) == values


def test_moe_values():
    got = {n: (MODELS[n].num_experts, MODELS[n].moe_intermediate, MODELS[n].topk, MODELS[n].num_shared_experts)
           for n in MOE_BENCH_MODELS}
    assert got == {
        "Mixtral-8x7B": (8, 14336, 2, 0),
        "Mixtral-8x22B": (8, 16384, 2, 0),
        "DeepSeek-V3": (256, 2048, 8, 1),
        "DeepSeek-V2-Lite": (64, 1408, 6, 2),
        "Qwen3-30B-A3B": (128, 768, 8, 0),
        "Qwen3-235B-A22B": (128, 1536, 8, 0),
        "GPT-OSS-20B": (32, 2880, 4, 0),
    }


def test_deepseek_mla():
    v3 = MODELS["DeepSeek-V3"]
    assert (v3.hidden, v3.intermediate, v3.num_heads_q, v3.vocab, v3.num_layers) == (7168, 18432, 128, 129280, 61)
    assert (v3.head_dim_qk, v3.head_dim_v, v3.qk_nope_head_dim, v3.qk_rope_head_dim) == (192, 128, 128, 64)
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.n_group, v3.topk_group, v3.num_dense_layers) == (1536, 512, 8, 4, 3)
    lite = MODELS["DeepSeek-V2-Lite"]
    assert (lite.hidden, lite.intermediate, lite.num_heads_q, lite.vocab, lite.num_layers) == (2048, 10944, 16, 102400, 27)
    assert (lite.head_dim_qk, lite.head_dim_v, lite.q_lora_rank, lite.kv_lora_rank) == (192, 128, 0, 512)


def test_dense_gemm_shapes_llama_8b():
    shapes = dense_gemm_shapes("Llama-3.1-8B", 4096)
    assert shapes == [
        ("qkv", 4096, 6144, 4096),
        ("attn_out", 4096, 4096, 4096),
        ("gate_up", 4096, 28672, 4096),
        ("down", 4096, 4096, 14336),
        ("lm_head", 4096, 128256, 4096),
    ]


def test_dense_gemm_shapes_qwen_7b():
    d = {case: (n, k) for case, _, n, k in dense_gemm_shapes(MODELS["Qwen2.5-7B"], 1024)}
    assert d == {
        "qkv": ((28 + 8) * 128, 3584),
        "attn_out": (3584, 3584),
        "gate_up": (37888, 3584),
        "down": (3584, 18944),
        "lm_head": (152064, 3584),
    }


def test_dense_gemm_shapes_moe_and_mla():
    d = {case: (n, k) for case, _, n, k in dense_gemm_shapes("DeepSeek-V3", 128)}
    assert d["q_a"] == (1536, 7168)
    assert d["q_b"] == (128 * 192, 1536)
    assert d["kv_a"] == (576, 7168)
    assert d["kv_b"] == (128 * 256, 512)
    assert d["attn_out"] == (7168, 128 * 128)
    assert d["gate_up"] == (36864, 7168)  # the 3 leading dense layers
    assert d["shared_gate_up"] == (4096, 7168)
    assert d["router"] == (256, 7168)
    assert "qkv" not in d
    lite = {case for case, *_ in dense_gemm_shapes("DeepSeek-V2-Lite", 128)}
    assert "q" in lite and "q_a" not in lite
    qwen3 = {case: (n, k) for case, _, n, k in dense_gemm_shapes("Qwen3-30B-A3B", 128)}
    assert "gate_up" not in qwen3  # every Qwen3-MoE layer is MoE
    assert qwen3["qkv"] == ((32 + 8) * 128, 2048)
    assert qwen3["attn_out"] == (2048, 4096)
    oss = {case: (n, k) for case, _, n, k in dense_gemm_shapes("GPT-OSS-20B", 128)}
    assert oss["qkv"] == (5120, 2880) and oss["attn_out"] == (2880, 4096)


@pytest.mark.parametrize("name", EXPECTED)
def test_dense_gemm_shapes_all_models(name):
    shapes = dense_gemm_shapes(name, 512)
    assert shapes[-1] == ("lm_head", 512, MODELS[name].vocab, MODELS[name].hidden)
    for case, m, n, k in shapes:
        assert m == 512 and n > 0 and k > 0, case
    assert len({case for case, *_ in shapes}) == len(shapes)


def test_moe_gemm_shapes():
    assert moe_gemm_shapes("DeepSeek-V3", 8, 512) == [
        ("gate_up", 32, 512, 4096, 7168),
        ("down", 32, 512, 7168, 2048),
    ]
    assert moe_gemm_shapes("Qwen3-30B-A3B", 1, 64)[0] == ("gate_up", 128, 64, 1536, 2048)
    with pytest.raises(ValueError):
        moe_gemm_shapes("Llama-3.1-8B", 1, 64)
    with pytest.raises(ValueError):
        moe_gemm_shapes("Mixtral-8x7B", 3, 64)
    with pytest.raises(ValueError):
        moe_gemm_shapes("Mixtral-8x7B", 8, 0)


def test_get_model():
    c = get_model("Mistral-7B")
    assert isinstance(c, ModelConfig) and get_model(c) is c
    with pytest.raises(KeyError, match="known"):
        get_model("GPT-5")
