"""FSDP2 (``torch.distributed.fsdp.fully_shard``, TorchTitan's data parallelism) over our layers.

Two ranks, each with its own half of the batch, train a small transformer built from turbo layers
(RMSNorm, Linear, TurboAttention, MoELayer with FP8 or bf16 experts, Float8Linear head) under
``fully_shard``. Each rank also runs an unsharded twin of the model on both halves and averages
the two gradients by hand, which is what FSDP's reduce-scatter computes. With two ranks the
average (a sum of two, halved) is exact in any order, so the sharded model's gradients, and its
parameters after AdamW steps, must equal the twin's bit for bit: a sharded parameter that missed
its gradient, a layer that read a sharded (DTensor) weight, or an op that broke FSDP's
unshard / reshard hooks would show. The mixed-precision case (bf16 compute, fp32 reduce and
master weights: TorchTitan's default policy) gives the twin bf16 copies of the fp32 weights.

CPU: gloo, the Triton kernels through the interpreter. A machine with two GPUs runs it on NCCL; one
GPU cannot host two NCCL ranks, so it skips there.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from primus_turbo.testing.dist import run_ranks

H, FF, E, TOPK, HEADS, SEQ, BATCH, STEPS = 32, 32, 4, 2, 2, 8, 4, 2

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - torch without FSDP2
    fully_shard = None

_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.skipif(fully_shard is None, reason="this torch has no FSDP2 (fully_shard)"),
    pytest.mark.skipif(_CUDA and torch.cuda.device_count() < 2, reason="two NCCL ranks need two GPUs"),
]


class _Block(torch.nn.Module):
    def __init__(self, config, dtype, expert_bias=False):
        super().__init__()
        import primus_turbo.pytorch as turbo

        M = turbo.modules
        self.norm1 = M.RMSNorm(H, dtype=dtype)
        self.qkv = M.Linear(H, 3 * H, bias=False, dtype=dtype)
        self.attn = M.TurboAttention(causal=True)
        self.proj = M.Linear(H, H, bias=False, dtype=dtype)
        self.norm2 = M.RMSNorm(H, dtype=dtype)
        self.moe = M.MoELayer(H, FF, E, TOPK, config=config, dtype=dtype, expert_bias=expert_bias)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, H // HEADS).unbind(2)
        x = x + self.proj(self.attn(q, k, v).reshape(b, s, H))
        return x + self.moe(self.norm2(x))


class _Model(torch.nn.Module):
    def __init__(self, config, dtype, expert_bias=False):
        super().__init__()
        import primus_turbo.pytorch as turbo
        from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity

        self.blocks = torch.nn.ModuleList([_Block(config, dtype, expert_bias), _Block(config, dtype, expert_bias)])
        self.head = turbo.modules.Float8Linear(
            H, H, config=Float8QuantConfig(granularity=ScalingGranularity.TENSORWISE), dtype=dtype)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _loss(model, x, y):
    return F.mse_loss(model(x).float(), y)


def _case(case):
    """``"hp-fp32"`` -> (expert quant config, compute dtype): bf16 or FP8 BLOCKWISE experts, fp32 or
    TorchTitan's bf16 / fp32-reduce mixed precision."""
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity

    experts, mixed = case.split("-")
    config = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE) if experts == "fp8" else None
    return config, (torch.bfloat16 if mixed == "mp" else torch.float32)


def _average_body(rank, world, dev, work_dir, case):
    from torch.distributed.device_mesh import init_device_mesh

    config, compute = _case(case)
    with torch.device(dev):
        torch.manual_seed(0)
        master = _Model(config, torch.float32)   # the twin's fp32 weights (same seed on both ranks)
        sharded = copy.deepcopy(master)
        x = torch.randn(BATCH, SEQ, H)
        y = torch.randn(BATCH, SEQ, H)
    halves = list(zip(x.chunk(world), y.chunk(world)))

    mesh = init_device_mesh(dev.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for blk in sharded.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=policy)
    fully_shard(sharded, mesh=mesh, mp_policy=policy)
    for n, p in sharded.named_parameters():
        assert type(p).__name__ == "DTensor", f"{n} is not sharded"

    opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    opt_m = torch.optim.AdamW(master.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt_s.zero_grad(set_to_none=True)
        xs, ys = halves[rank]
        _loss(sharded, xs.to(compute), ys).backward()

        # the twin: the same compute-dtype model on each half, gradients averaged in fp32
        opt_m.zero_grad(set_to_none=True)
        grads = []
        for xh, yh in halves:
            work = copy.deepcopy(master).to(compute)
            _loss(work, xh.to(compute), yh).backward()
            grads.append([p.grad.float() for p in work.parameters()])
        for p, *gs in zip(master.parameters(), *grads):
            p.grad = sum(gs) / world

        names = [n for n, _ in master.named_parameters()]
        for n, ps, pm in zip(names, sharded.parameters(), master.parameters()):
            assert ps.grad is not None, f"step {step}: {n} got no gradient under FSDP"
            g = ps.grad.full_tensor()
            assert g.dtype == torch.float32, f"{n}: gradient {g.dtype}, expected the fp32 reduce dtype"
            assert torch.equal(g, pm.grad), (
                f"{case} step {step}: {n} gradient differs from the unsharded average "
                f"(max |diff| {float((g - pm.grad).abs().max()):.3e})")
        opt_s.step()
        opt_m.step()
        for n, ps, pm in zip(names, sharded.parameters(), master.parameters()):
            assert torch.equal(ps.detach().full_tensor(), pm.detach()), f"{case} step {step}: {n} after AdamW"


@pytest.mark.parametrize("case", ["hp-fp32", "fp8-fp32", "hp-mp", "fp8-mp"])
def test_fully_shard_two_ranks_equals_unsharded_average(case):
    run_ranks(_average_body, case, device_type="cuda" if _CUDA else "cpu", label=case)


def _dcp_body(rank, world, dev, work_dir, case):
    """Train one step, save a distributed checkpoint (torch.distributed.checkpoint, the sharded
    model and optimizer states), train a second step; then build a fresh, differently initialised
    model, load the checkpoint and train the same second step: loss, parameters, optimizer moments
    and the MoE layers' expert biases must equal the uninterrupted run's bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import primus_turbo.pytorch as turbo

    config, compute = _case(case)
    mesh = init_device_mesh(dev.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)

    def build(seed):
        with torch.device(dev):
            torch.manual_seed(seed)
            model = _Model(config, torch.float32, expert_bias=True)
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    batches = [(torch.randn(BATCH // world, SEQ, H, generator=g).to(dev, compute),
                torch.randn(BATCH // world, SEQ, H, generator=g).to(dev)) for _ in range(2)]

    def step(model, opt, batch):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, *batch)
        loss.backward()
        opt.step()
        turbo.modules.update_expert_biases(model)
        return loss.detach()

    def snapshot(model, opt):
        params = [p.detach().full_tensor().clone() for p in model.parameters()]
        moments = [st["exp_avg_sq"].full_tensor().clone() for st in opt.state.values()]
        biases = [b.moe.expert_bias.clone() for b in model.blocks]
        return params, moments, biases

    model, opt = build(0)
    step(model, opt, batches[0])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(work_dir, "ckpt"))
    loss_a = step(model, opt, batches[1])
    ref = snapshot(model, opt)
    assert any(b.abs().sum() > 0 for b in ref[2]), "the expert biases never moved"

    fresh, opt2 = build(1)  # other initial weights: everything must come from the checkpoint
    msd, osd = get_state_dict(fresh, opt2)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(work_dir, "ckpt"))
    set_state_dict(fresh, opt2, model_state_dict=msd, optim_state_dict=osd)
    loss_b = step(fresh, opt2, batches[1])
    got = snapshot(fresh, opt2)
    assert torch.equal(loss_a, loss_b), f"{case}: resumed loss {float(loss_b)} != {float(loss_a)}"
    for what, xs, ys in zip(("parameter", "AdamW moment", "expert bias"), ref, got):
        assert len(xs) == len(ys)
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert torch.equal(x, y), f"{case}: {what} {i} differs after resuming from the checkpoint"


@pytest.mark.parametrize("case", ["hp-fp32", "fp8-mp"])
def test_distributed_checkpoint_resume_is_exact(case):
    """TorchTitan's checkpointing (torch.distributed.checkpoint over FSDP2) of a model of our layers:
    resuming reproduces the uninterrupted run bit for bit."""
    run_ranks(_dcp_body, case, device_type="cuda" if _CUDA else "cpu", label=case)
