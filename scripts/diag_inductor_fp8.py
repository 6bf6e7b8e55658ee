"""Where a compiled FP8 MoE layer departs from eager on the GPU (session 47: inductor, fc1's weight
gradient at 1.9 dB). Prints the SNR of every output and gradient of (1) the MoELayer of
tests/pytorch/modules/test_moe.py::test_moe_layer_inductor_fullgraph_gpu and (2) a bare
grouped_gemm_fp8 at its fc1 / fc2 shapes, compiled with aot_eager and with inductor, against eager.
    PYTHONPATH=. python scripts/diag_inductor_fp8.py [bf16|fp8]"""
import copy
import sys

import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
from primus_turbo.testing import snr_db


def layer_case(backend, fp8, inputs_hook=None):
    torch.manual_seed(53)
    H, FF, E, k, T = 256, 512, 8, 2, 512
    cfg = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE) if fp8 else None
    layer = turbo.modules.MoELayer(H, FF, E, k, dtype=torch.bfloat16, device="cuda", config=cfg, aux_loss_coeff=0.01)
    twin = copy.deepcopy(layer)
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend=backend)
    x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
    runs = []
    for mod, inp in ((layer, x), (twin, x2)):
        out = (mod if mod is layer else compiled)(inp, num_out_tokens=T * k)
        ((out.float() * dy.float()).sum() + mod.aux_loss).backward()
        runs.append([out.detach(), mod.aux_loss.detach(), inp.grad] + [p.grad for p in mod.parameters()])
    names = ["out", "aux", "dx"] + [n for n, _ in layer.named_parameters()]
    return {n: float(snr_db(a.double(), b)) for n, a, b in zip(names, *runs)}


def op_case(backend, n, k, fuse):
    torch.manual_seed(7)
    G, M = 8, 1024
    cfg = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE)
    lens = torch.tensor([200, 0, 97, 128, 300, 50, 149, 100], device="cuda")
    a0 = torch.randn(M + 8, k, dtype=torch.bfloat16, device="cuda")
    b0 = torch.randn(G, n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
    dy = torch.randn(M + 8, n, dtype=torch.bfloat16, device="cuda")

    def call(a, b):
        return turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=True, config=cfg,
                                          fuse_bgrad_accum_pattern="megatron" if fuse else None)

    def run(fn):
        a, b = a0.clone().requires_grad_(), torch.nn.Parameter(b0.clone())
        if fuse:
            b.main_grad = torch.zeros(b.shape, dtype=torch.float32, device="cuda")
        out = fn(a, b)
        out.backward(dy)
        return out.detach(), a.grad, (b.main_grad if fuse else b.grad)

    eager = run(call)
    torch._dynamo.reset()
    comp = run(torch.compile(call, fullgraph=True, backend=backend))
    return {nm: float(snr_db(x.double(), y)) for nm, x, y in zip(("out", "da", "db"), eager, comp)}


def glue_case():
    """The padded token layout and the row gather in torch ops, inductor against eager."""
    from primus_turbo.pytorch.backends import grouped_gemm_fp8 as be

    lens = torch.tensor([200, 0, 97, 128, 300, 50, 149, 100], device="cuda")
    offs = torch.zeros(9, dtype=torch.int64, device="cuda")
    offs[1:] = lens.cumsum(0)
    x = torch.randn(1032, 256, dtype=torch.bfloat16, device="cuda")
    for align in (32, 128):
        ref = be._padded_group_layout_torch(offs, 1032, align)
        torch._dynamo.reset()
        got = torch.compile(be._padded_group_layout_torch, fullgraph=True)(offs, 1032, align)
        same = [torch.equal(a, b) for a, b in zip(ref, got)]
        torch._dynamo.reset()
        def gather(t, s):  # gather_rows' torch version
            return t.index_select(0, s.clamp(min=0)).masked_fill_(~(s >= 0).view(-1, 1), 0)

        g_ref = gather(x, ref[0])
        g_got = torch.compile(gather, fullgraph=True)(x, ref[0])
        print(f"glue align={align} layout src/poffs equal={same} gather equal={torch.equal(g_ref, g_got)}")


if __name__ == "__main__":
    if sys.argv[1:] == ["glue"]:
        glue_case()
        sys.exit()
    fp8 = (sys.argv[1] if len(sys.argv) > 1 else "fp8") == "fp8"
    for backend in ("aot_eager", "inductor"):
        try:
            r = layer_case(backend, fp8)
            print(f"layer {'fp8' if fp8 else 'bf16'} {backend:9s} " + " ".join(f"{k}={v:.1f}" for k, v in r.items()))
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            print(f"layer {backend} ERROR {type(e).__name__}: {str(e)[:300]}")
        if fp8:
            for n, k in ((1024, 256), (256, 512)):
                for fuse in (False, True):
                    try:
                        r = op_case(backend, n, k, fuse)
                        print(f"op n={n} k={k} fuse={fuse} {backend:9s} " + " ".join(f"{a}={b:.1f}" for a, b in r.items()))
                    except Exception as e:  # noqa: BLE001
                        print(f"op n={n} k={k} {backend} ERROR {type(e).__name__}: {str(e)[:300]}")
