"""Sweep launch configurations of the memory-bound kernels of one FP8 BLOCKWISE MoE step at GPT-OSS-20B
shapes, against a device copy of the same bytes measured in the same run, with every candidate's
outputs checked bit for bit against the default launch's.

    PYTHONPATH=. python scripts/tune_gptoss_memory.py --out /tmp/gptoss_mem      # H200: ~1-2 min
    PYTHONPATH=. python scripts/tune_gptoss_memory.py --out /tmp/smoke --cpu-smoke   # interpreter, tiny

Shapes (GPT-OSS-20B MoE layer, one step of T = 16384 tokens): H = 2880, F = 2880 (fc1 out 2F = 5760),
E = 32 experts, top-4, so M = 65536 permuted rows, routed uniformly at random (the row map is built by
the library's own permute-map kernels, so row order is the MoE's: expert-major, tokens ascending).
Per kernel, the calls of the step it stands for:

- ``merge_rows``  [T, H] from [M, H] bf16, K = 4, no weights (moe_unpermute forward and the
  moe_permute backward). Default: 8 warps x 2048 columns (H = 2880 as 2048 + 832: 70% of the lanes;
  ``4w-1024``, three steps at 94%, measured the same on the H200).
- ``gather_rows`` [M, H] from [T, H] (moe_permute forward, int16 bits, probs copied): BLOCK_R of the
  row-major gather (the "default" row: the launch these cases compare against), and ``scatter-*``
  (``scatter_rows_launch``: token-major, each token row read once; what the ops run now, at
  ``scatter-bt4-8w-1024``, its default launch).
- ``unpermute_bwd`` [M, H] grad rows (moe_unpermute backward, no probs): the row-major gather
  (``unpermute_bwd_launch``), ``scatter`` (top-k map) and ``scatter-map`` (the [T, E] map form,
  packed per token first); ``unpermute_bwd_probs`` with probs (weighted rows + the dots).
  GB/s of these three count each token row read once (the compulsory traffic).
- ``quant_1x128`` BLOCKWISE 1 x 128 along the columns of [M, 2880] (fc1 input, fc2 input, fc2 grad)
  and [M, 5760] (fc1 grad): ``fp8_quant_launch`` with ``tile=(TR, TC, num_warps)``.
- ``quant_128x128`` the fc1 weight ``[E * 2F, H]`` in 128 x 128 blocks.
- ``gather_quant_cols_t`` the wgrad token copies (128 x 1 blocks in the padded token layout, stored
  transposed) of [M, 2880] and [M, 5760]: ``tc`` x ``num_warps``.
- ``transpose_bytes`` the fc1 weight's dgrad copy [E * 2F, H] FP8: ``(T, num_warps)`` square tiles.
- ``glu_fwd`` / ``glu_bwd`` SwiGLU with probs and row mask on [M, 5760]: ``(BLOCK_R, BLOCK_F,
  num_warps)``. The backward's dprobs is compared as the op forms it (partials summed over dim 0):
  a config with other column tiles (or another reduction layout) may round it differently, and is
  then marked ``bit_exact: false`` (not usable as a default).

Every row: ms (median of ``triton.testing.do_bench``), GB/s of the kernel's compulsory traffic, the
ratio to a torch copy of a bf16 tensor with the same read + write bytes, and ``bit_exact`` (all
outputs byte-equal to the default config's). Writes ``tune_gptoss_memory.json`` under ``--out``
and prints one line per (kernel, shape) last: default vs best bit-exact config. A time budget
(``--budget-s``, 160 s from the first kernel) skips the remaining candidates (recorded as skipped)
rather than run over.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402


def _tune_memory_bound():
    """scripts/tune_memory_bound.py as a module (scripts/ is no package): its bench and GB/s helpers."""
    spec = importlib.util.spec_from_file_location("tune_memory_bound", Path(__file__).with_name("tune_memory_bound.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# GPT-OSS-20B: tokens per step, hidden, expert intermediate, experts, top-k
GPTOSS = dict(t=16384, h=2880, f=2880, e=32, k=4)
# interpreter smoke: widths that are not multiples of 128 either (160 = 128 + 32, 2F = 192 = 128 + 64), as
# 2880 = 22 x 128 + 64
SMOKE = dict(t=16, h=160, f=96, e=3, k=2)
BLOCK = 128  # BLOCKWISE block_size of the MoE step

#: candidates per kernel (the default is always timed first, as "default")
MERGE_CANDIDATES = {  # label: (block_t, num_warps, block_c)
    "4w-1024": (1, 4, 1024), "8w-1024": (1, 8, 1024), "8w-4096": (1, 8, 4096),
    "16w-4096": (1, 16, 4096), "4w-4096": (1, 4, 4096), "2w-512": (1, 2, 512), "bt2-4w-1024": (2, 4, 1024),
    "bt2-8w-1024": (2, 8, 1024), "bt4-4w-1024": (4, 4, 1024),
}
GATHER_ROWS_BLOCK_R = (1, 2, 8)
#: token-major scatter launches (block_t, num_warps, block_c): one token row per step keeps one load in
#: flight per program, so wider rows per step / more tokens per program / more programs per SM are swept
SCATTER_CONFIGS = ((1, 8, 2048), (1, 8, 4096), (1, 16, 4096), (1, 4, 4096), (2, 8, 4096), (2, 16, 4096),
                   (4, 16, 4096), (2, 4, 1024), (4, 8, 1024), (1, 4, 1024), (1, 2, 1024), (8, 8, 1024),
                   (4, 4, 1024), (4, 8, 512), (8, 8, 512), (4, 16, 2048), (8, 16, 1024))
SCATTER_MAP_CONFIGS = ((4, 8, 1024), (8, 8, 1024), (2, 4, 1024))
QUANT_1X128_TILES = ((8, 1024, 4), (16, 1024, 16), (4, 1024, 4), (16, 512, 8), (32, 256, 8), (64, 128, 8),
                     (32, 128, 4))
QUANT_128X128_TILES = ((128, 128, 8), (128, 128, 16), (128, 256, 16), (256, 128, 16))
TRANSPOSE_TILES = ((64, 2), (64, 8), (128, 4), (128, 8), (32, 1), (32, 2))  # (T, num_warps)
#: (tc, num_warps). Also tried on the H200 in session 9 and removed again (bit-identical, no gain):
#: a prefetching loop over several column tiles per program (0.98-1.01x the default), the codes
#: transposed as int32 (1.00x) or as 32-bit words of 4 tokens (0.87x, 0.07x at 256 columns), the
#: grid in bands of token blocks so the transposed rows are written contiguously (1.01-1.04x)
GATHER_QUANT = ((64, 8), (64, 2), (32, 4), (32, 2), (128, 4), (128, 8))
GLU_CONFIGS = ((1, 4096, 8), (1, 4096, 16), (1, 4096, 4), (2, 4096, 16), (1, 1024, 4), (4, 1024, 8), (2, 1024, 4),
               (1, 2048, 8))


class Sweep:
    """Times candidates, checks them against the default, keeps the rows."""

    def __init__(self, dev, cpu: bool, budget_s: float):
        self.dev, self.cpu, self.budget_s = dev, cpu, budget_s
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self._copy: dict[int, tuple] = {}
        self._tmb = None if cpu else _tune_memory_bound()

    def bench(self, fn) -> float:
        if self.cpu:  # the interpreter: one timed call (only the plumbing is tested; case() ran it once)
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return self._tmb._bench(fn)

    def copy_ms(self, nbytes: int) -> tuple:
        """(ms, GB/s) of a torch copy of a bf16 tensor moving ``nbytes`` (read + write)."""
        if nbytes not in self._copy:
            x = torch.randn(max(1, nbytes // 4), device=self.dev, dtype=torch.bfloat16)
            y = torch.empty_like(x)
            ms = self.bench(lambda: y.copy_(x))
            self._copy[nbytes] = (ms, nbytes / ms / 1e6)
            self.rows.append({"kernel": "device-copy", "shape": [x.numel()], "config": "bf16 copy", "nbytes": nbytes,
                              "ms": ms, "gbps": nbytes / ms / 1e6})
        return self._copy[nbytes]

    def case(self, kernel: str, shape, nbytes: int, default, candidates: dict, run) -> None:
        """``run(cfg)`` launches with config ``cfg`` (``default``'s value for the default launch)
        and returns the outputs to compare (tensors)."""
        copy_ms, copy_gbps = self.copy_ms(nbytes)
        ref = None
        for label, cfg in [("default", default)] + list(candidates.items()):
            row = {"kernel": kernel, "shape": list(shape), "label": label, "config": cfg, "nbytes": nbytes,
                   "copy_ms": copy_ms}
            if time.perf_counter() - self.t0 > self.budget_s:
                row["error"] = f"skipped: past the {self.budget_s:.0f} s budget"
                self.rows.append(row)
                continue
            try:
                outs = [o.clone() for o in run(cfg)]
                if ref is None:
                    ref = outs
                row["bit_exact"] = all(_same(a, b) for a, b in zip(outs, ref))
                ms = self.bench(lambda: run(cfg))
                row.update(ms=ms, gbps=nbytes / ms / 1e6, vs_copy=copy_ms / ms, error=None)
            except Exception as exc:  # a config the compiler rejects: recorded, the sweep goes on
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            self.rows.append(row)
            print(json.dumps(row), flush=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (FP8, NaN and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _routing(t: int, e: int, k: int, dev):
    """(row_id_map [T, K], src_idx [M], group_offs [E+1]) of uniform random top-k routing, from the
    library's own permute-map launches (so the row order is moe_permute's)."""
    from primus_turbo.triton.moe.permute_kernel import build_permute_map_launch

    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices.to(torch.int32).to(dev)
    row_id_map, tpe, src_idx, n_out = build_permute_map_launch(idx, e, None, t * k)
    offs = torch.zeros(e + 1, dtype=torch.int64, device=dev)
    offs[1:] = torch.cumsum(tpe, 0)
    return row_id_map, src_idx, offs


def run_sweep(sw: Sweep, s: dict, only) -> None:
    from primus_turbo.pytorch.backends.grouped_gemm_fp8 import padded_group_layout
    from primus_turbo.triton.activation.swiglu_kernel import ACT_SILU, glu_bwd_launch, glu_fwd_launch
    from primus_turbo.triton.moe.permute_kernel import (gather_rows_launch, merge_rows_launch,
                                                        scatter_rows_launch, unpermute_bwd_launch)
    from primus_turbo.triton.quantization.gather_quant_kernel import gather_quant_cols_t_launch
    from primus_turbo.triton.quantization.quant_fp8_kernel import (QuantGrouping, fp8_quant_launch,
                                                                   transpose_bytes)

    dev = sw.dev
    t, h, f, e, k = s["t"], s["h"], s["f"], s["e"], s["k"]
    m = t * k
    e4m3 = torch.float8_e4m3fn
    bf16 = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(1)
    gd = torch.Generator(device=dev).manual_seed(2)  # the big tensors: generated on the device (~2.7 G elements)

    def randn(*shape):
        return torch.randn(*shape, generator=gd, device=dev, dtype=torch.float32).to(bf16)

    def want(name):
        return only is None or name in only

    row_id_map, src_idx, offs = _routing(t, e, k, dev)

    if want("merge_rows"):
        src, out = randn(m, h), torch.empty(t, h, device=dev, dtype=bf16)

        def merge(cfg):
            bt, nw, bc = cfg if cfg is not None else (None, None, None)
            return (merge_rows_launch(src, out, row_id_map, None, block_t=bt, num_warps=nw, block_c=bc),)
        sw.case("merge_rows", (t, h, k), (m * h + t * h) * 2 + t * k * 4, None, MERGE_CANDIDATES, merge)
        src = out = None  # noqa: F841

    # the [T, E] map form MoELayer hands the permutation (one column per expert, k of E routed)
    rows = row_id_map.long()
    map_e = torch.full((t, e), -1, dtype=torch.int32, device=dev)
    map_e.scatter_(1, torch.searchsorted(offs[1:], rows, right=True), row_id_map)

    if want("gather_rows"):
        tok = randn(t, h).view(torch.int16)
        out = torch.empty(m, h, device=dev, dtype=torch.int16)
        probs = torch.rand(t, k, generator=g).to(dev)
        pout = torch.empty(m, device=dev)

        def gather(cfg):
            if isinstance(cfg, tuple):  # token-major scatter: each token row read once
                bt, nw, bc = cfg
                return scatter_rows_launch(tok, row_id_map, src_idx, out=out, weights=probs, probs_out=pout,
                                           num_warps=nw, block_t=bt, block_c=bc)[:2]
            return gather_rows_launch(tok, out, src_idx, None, cfg, row_div=k, probs=probs, probs_out=pout), pout
        # compulsory traffic: each token row read once, M rows written
        sw.case("gather_rows", (m, h), (t * h + m * h) * 2 + m * 8, None,
                dict({f"block_r={b}": b for b in GATHER_ROWS_BLOCK_R},
                     **{f"scatter-bt{c[0]}-{c[1]}w-{c[2]}": c for c in SCATTER_CONFIGS}), gather)
        tok = out = None  # noqa: F841

    if want("unpermute_bwd"):
        gout, perm = randn(t, h), randn(m, h)
        gp = torch.empty(m, h, device=dev, dtype=bf16)

        def unperm(cfg):
            if cfg is not None:  # ("map" | "topk", (block_t, num_warps, block_c))
                form, (bt, nw, bc) = cfg
                scatter_rows_launch(gout.view(torch.int16), map_e if form == "map" else row_id_map, src_idx,
                                    out=gp.view(torch.int16), num_warps=nw, block_t=bt, block_c=bc)
                return (gp,)
            return (unpermute_bwd_launch(gout, perm, src_idx, k, None, True, False)[0],)
        cands = {f"scatter-bt{c[0]}-{c[1]}w-{c[2]}": ("topk", c) for c in SCATTER_CONFIGS}
        # the [T, E] map form (packed per token first, chunks looped to each block's largest count)
        for c in SCATTER_MAP_CONFIGS:
            cands[f"scatter-map-bt{c[0]}-{c[1]}w-{c[2]}"] = ("map", c)
        sw.case("unpermute_bwd", (m, h), (t * h + m * h) * 2 + m * 8, None, cands, unperm)
        probs = torch.rand(t, k, generator=g).to(dev)
        dots = torch.empty(m, device=dev)

        def unperm_probs(cfg):
            if cfg is not None:
                bt, nw, bc = cfg
                scatter_rows_launch(gout, row_id_map, src_idx, out=gp, weights=probs, scale_by_weights=True,
                                    permuted=perm, dot=dots, num_warps=nw, block_t=bt, block_c=bc)
                return gp, dots
            return unpermute_bwd_launch(gout, perm, src_idx, k, probs, True, True)
        # the scatter's dots sum in another order: not bit-exact by construction (compare the times)
        sw.case("unpermute_bwd_probs", (m, h), (t * h + 2 * m * h) * 2 + m * 12, None,
                {f"scatter-bt{c[0]}-{c[1]}w-{c[2]}": c for c in SCATTER_MAP_CONFIGS}, unperm_probs)
        gout = perm = gp = None  # noqa: F841

    if want("quant_1x128"):
        grp = QuantGrouping(0, 1, BLOCK)
        for c in (h, 2 * f):
            x = randn(m, c)
            n_sc = -(-c // BLOCK)
            sw.case("quant_1x128", (m, c), m * c * 3 + m * n_sc * 4, None,
                    {f"{tr}x{tc}x{nw}": (tr, tc, nw) for tr, tc, nw in QUANT_1X128_TILES},
                    lambda cfg, x=x: fp8_quant_launch(x, e4m3, grp, tile=cfg))
            x = None  # noqa: F841

    if want("quant_128x128"):
        grp = QuantGrouping(0, BLOCK, BLOCK)
        w = randn(e * 2 * f, h)
        nb = -(-w.shape[0] // BLOCK) * -(-h // BLOCK)
        sw.case("quant_128x128", tuple(w.shape), w.numel() * 3 + nb * 4, None,
                {f"{tr}x{tc}x{nw}": (tr, tc, nw) for tr, tc, nw in QUANT_128X128_TILES},
                lambda cfg: fp8_quant_launch(w, e4m3, grp, tile=cfg))
        if want("transpose_bytes"):
            q = fp8_quant_launch(w, e4m3, grp)[0]
            qt = torch.empty(q.shape[::-1], dtype=q.dtype, device=dev)
            sw.case("transpose_bytes", tuple(q.shape), 2 * q.numel(), None,
                    {f"{t}x{t}x{nw}": (t, nw) for t, nw in TRANSPOSE_TILES},
                    lambda cfg: (transpose_bytes(q, qt, cfg),))
            q = qt = None  # noqa: F841
        w = None  # noqa: F841

    if want("gather_quant_cols_t"):
        psrc, _ = padded_group_layout(offs, m, BLOCK)
        m_pad = psrc.numel()
        for c in (h, 2 * f):
            x = randn(m, c)
            sw.case("gather_quant_cols_t", (m, c), m * c * 2 + m_pad * c + (m_pad // BLOCK) * c * 4, None,
                    {f"tc={tc},{nw}w": (tc, nw) for tc, nw in GATHER_QUANT},
                    lambda cfg, x=x: gather_quant_cols_t_launch(
                        x, psrc, e4m3, BLOCK, **({} if cfg is None else {"tc": cfg[0], "num_warps": cfg[1]})))
            x = None  # noqa: F841

    if want("glu_fwd") or want("glu_bwd"):
        x = randn(m, 2 * f)
        p = torch.rand(m, generator=g).to(dev)
        mask = torch.ones(m, dtype=torch.uint8, device=dev)
        mask[m - max(1, m // 64):] = 0  # a capacity tail, as the row mask of a padded buffer
        cands = {f"{br}x{bf}x{nw}": (br, bf, nw) for br, bf, nw in GLU_CONFIGS}
        if want("glu_fwd"):
            sw.case("glu_fwd", (m, 2 * f), m * 3 * f * 2 + m * 5, None, cands,
                    lambda cfg: (glu_fwd_launch(x, ACT_SILU, p, mask, config=cfg),))
        if want("glu_bwd"):
            dout = randn(m, f)

            def bwd(cfg):
                dx, part = glu_bwd_launch(dout, x, ACT_SILU, p, mask, config=cfg)
                return dx, part.sum(0)  # dprobs as the op forms it
            sw.case("glu_bwd", (m, 2 * f), m * 5 * f * 2 + m * 9, None, cands, bwd)


def summary(rows: list[dict]) -> list[str]:
    lines = ["| kernel | shape | default ms | default vs copy | best bit-exact | ms | vs copy | speedup | "
             "not bit-exact |", "|---|---|---:|---:|---|---:|---:|---:|---|"]
    keys = []
    for r in rows:
        key = (r["kernel"], tuple(r["shape"]))
        if r["kernel"] != "device-copy" and key not in keys:
            keys.append(key)
    for kernel, shape in keys:
        rs = [r for r in rows if (r["kernel"], tuple(r["shape"])) == (kernel, shape) and r.get("error") is None]
        d = next((r for r in rs if r["label"] == "default"), None)
        shp = "x".join(map(str, shape))
        if d is None:
            lines.append(f"| {kernel} | {shp} | (default failed) | | | | | | |")
            continue
        ok = [r for r in rs if r["bit_exact"]]
        best = min(ok, key=lambda r: r["ms"])
        bad = ",".join(r["label"] for r in rs if not r["bit_exact"]) or "-"
        cfg = best["label"] if best["label"] == "default" else f"{best['label']} {best['config']}"
        lines.append(f"| {kernel} | {shp} | {d['ms']:.4f} | {d['vs_copy']:.2f} | {cfg} | {best['ms']:.4f} | "
                     f"{best['vs_copy']:.2f} | {d['ms'] / best['ms']:.2f} | {bad} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for tune_gptoss_memory.json")
    p.add_argument("--only", nargs="+", default=None, help="kernels to sweep (names as in the table)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes through the Triton interpreter")
    p.add_argument("--budget-s", type=float, default=160.0, help="skip the remaining candidates past this")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (when it was not yet)
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit(f"--cpu-smoke needs TRITON_INTERPRET=1, got TRITON_INTERPRET="
                             f"{os.environ.get('TRITON_INTERPRET')!r}")
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu-smoke for the interpreter smoke test")
        dev = torch.device("cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = SMOKE if args.cpu_smoke else GPTOSS
    sw = Sweep(dev, args.cpu_smoke, args.budget_s)
    run_sweep(sw, shapes, args.only)
    info = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (TRITON_INTERPRET=1)",
            "torch": torch.__version__, "shapes": shapes, "wall_s": time.perf_counter() - sw.t0}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        pass
    (out_dir / "tune_gptoss_memory.json").write_text(json.dumps({"info": info, "rows": sw.rows}, indent=1))
    print(f"\n{info['device']}, {info['wall_s']:.0f} s, shapes {shapes}; vs copy = copy ms / kernel ms "
          f"(same bytes); speedup = default ms / best ms")
    print("\n".join(summary(sw.rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
