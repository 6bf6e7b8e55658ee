"""A TorchTitan-style training loop over primus-turbo layers: model built on the meta device,
``to_empty`` + ``reset_parameters``, dense ``nn.Linear`` layers converted to FP8
(``turbo.modules.convert_to_float8``), FSDP2 ``fully_shard`` per block with bf16 compute and fp32
gradient reduction, ``torch.compile``, AdamW, and the MoE layers' auxiliary-loss-free expert bias
updated after each step (``turbo.modules.update_expert_biases``).

    python examples/torchtitan_style.py                     # one process
    torchrun --nproc-per-node 2 examples/torchtitan_style.py --fp8 blockwise

Each rank trains on its own batch of a synthetic next-token task and rank 0 prints the loss. On a
CUDA machine every rank takes one GPU (NCCL); without one it runs on the CPU (gloo), with the
Triton kernels going through the Triton interpreter (slow: keep the sizes small there).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
# multi-GPU hosts: no NVLink multicast anywhere in the process
for _k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_k, "0" if _k == "NCCL_NVLS_ENABLE" else "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import primus_turbo.pytorch as turbo  # noqa: E402
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    # the interpreter's bf16 tl.dot multiplies raw bit patterns (triton issue #11584): the opt-in shim
    from primus_turbo.triton.interpreter import fix_bf16_dot

    fix_bf16_dot()


class Block(torch.nn.Module):
    """Pre-norm attention (GQA) + MoE feed-forward, all from turbo layers but the plain projections."""

    def __init__(self, dim: int, heads: int, kv_heads: int, experts: int, topk: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm = turbo.modules.RMSNorm(dim)
        self.wqkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.attn = turbo.modules.TurboAttention(causal=True)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.ffn_norm = turbo.modules.RMSNorm(dim)
        # both balancing aids of DeepSeek-V3: a small aux loss and the aux-loss-free expert bias
        self.moe = turbo.modules.MoELayer(dim, ffn, experts, topk, aux_loss_coeff=1e-2, expert_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.wqkv(self.attn_norm(x))
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        o = self.attn(q.view(b, s, self.heads, -1), k.view(b, s, self.kv_heads, -1), v.view(b, s, self.kv_heads, -1))
        x = x + self.wo(o.reshape(b, s, -1))
        return x + self.moe(self.ffn_norm(x))


class Model(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, **block):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList([Block(dim, **block) for _ in range(layers)])
        self.norm = turbo.modules.RMSNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = self.tok(tokens), 0.0
        for layer in self.layers:
            x = layer(x)
            aux = aux + layer.moe.aux_loss
        return self.output(self.norm(x)), aux


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--fp8", choices=["none", "tensorwise", "blockwise"], default="tensorwise")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--dim", type=int, default=None, help="model width (default: 1024 on a GPU, 64 on CPU)")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        dim = args.dim or (1024 if cuda else 64)
        seq, batch, vocab = (2048, 4, 32000) if cuda else (32, 2, 64)
        cfg = dict(vocab=vocab, dim=dim, layers=2, heads=8, kv_heads=2, experts=8, topk=2, ffn=2 * dim)

        # 1. built without memory, then materialised and initialised where it will run
        with torch.device("meta"):
            model = Model(**cfg)
        # 2. FP8 for the dense projections; the output head stays in 16 bits, as TorchTitan keeps it
        if args.fp8 != "none":
            fp8 = Float8QuantConfig(granularity=args.fp8.upper(), block_size=128 if args.fp8 == "blockwise" else None)
            turbo.modules.convert_to_float8(model, fp8, module_filter_fn=lambda mod, fqn: fqn != "output")
        model.to_empty(device=device)
        torch.manual_seed(0)  # the same initial weights on every rank
        for m in model.modules():
            if m is not model and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        # 3. FSDP2: one unit per block, bf16 compute, fp32 gradient reduction and master weights
        mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        # 4. compile (inductor on the GPU; aot_eager on the CPU, where inductor's C++ build is optional)
        run = model if args.no_compile else torch.compile(model, backend="inductor" if cuda else "aot_eager")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)

        # a synthetic task each rank samples on its own: token t+1 = (5 t + 3) mod vocab
        gen = torch.Generator().manual_seed(1234 + rank)
        losses = []
        for step in range(args.steps):
            seqs = torch.empty(batch, seq + 1, dtype=torch.int64)
            seqs[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
            for t in range(seq):
                seqs[:, t + 1] = (5 * seqs[:, t] + 3) % vocab
            seqs = seqs.to(device)
            tokens, targets = seqs[:, :-1], seqs[:, 1:]
            opt.zero_grad(set_to_none=True)
            logits, aux = run(tokens)
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
            (loss + aux).backward()
            opt.step()
            turbo.modules.update_expert_biases(model)  # one all-reduce of the routed counts, on the device
            mean = loss.detach().clone()
            if world > 1:
                dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            losses.append(float(mean))  # the log line: one host sync a step, by choice
            if rank == 0:
                print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
        return losses
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    print("done", flush=True)
