"""Grouped GEMM backends (MoE experts): TORCH (``torch._grouped_mm``, CUDA sm_90+ bf16), TRITON and,
for the M-grouped problem, GLUON (the warp-specialized 16-bit kernel on sm_90).

Two problems, each with its own dispatcher in the ``grouped_gemm`` family (so one pin,
``GlobalBackendManager.set_grouped_gemm_backend`` / ``PRIMUS_TURBO_GROUPED_GEMM_BACKEND``, covers
both):

* M-grouped (forward, dgrad): ``out[offs[g]:offs[g+1]] = a[offs[g]:offs[g+1]] @ b[g]`` with ``a``
  ``[M_total, K]``, ``b`` the *logical* ``[G, K, N]`` (any strides: the op layer passes transposed
  views) and the rows past ``offs[G]`` zeroed.
* variable-K (wgrad): ``out[g] (+)= x[rows of g].T @ y[rows of g]``, ``[G, P, Q]``.

Keys and checks read shapes, dtypes, strides and devices only: never a device value (no host sync).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..core.backend import (
    AutoKernelDispatcher, BackendType, KernelBackend, cuda_capability, scratch_out_tune_kwargs,
)

__all__ = [
    "GROUPED_GEMM_DTYPES",
    "GroupedGemmGluonBackend",
    "GroupedGemmTorchBackend",
    "GroupedGemmTritonBackend",
    "GLUON16_LARGE_MIN_MNK",
    "GLUON16_LARGE_MIN_ROWS",
    "GLUON16_SHORT_K",
    "GLUON16_SMALL_MAX_MNK",
    "GLUON16_SMALL_MAX_MNK_SHORT_K",
    "gluon16_large_preferred",
    "gluon16_mid_preferred",
    "gluon16_preferred",
    "gluon16_small_preferred",
    "GroupedGemmVariableKGluonBackend",
    "GroupedGemmVariableKTorchBackend",
    "GroupedGemmVariableKTritonBackend",
    "GLUON_WGRAD_MIN_FLOPS",
    "gluon_wgrad",
    "grouped_gemm_dispatcher",
    "grouped_gemm_variable_k_dispatcher",
]

GROUPED_GEMM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _b_layout(b: torch.Tensor) -> str:
    """'R': the logical [K, N] matrices row-major, 'C': column-major (a [G, N, K] weight), 'S' other."""
    if b.stride(2) == 1 or b.size(2) <= 1:
        return "R"
    if b.stride(1) == 1 or b.size(1) <= 1:
        return "C"
    return "S"


def _sm90_bf16(t: torch.Tensor) -> Optional[str]:
    if not t.is_cuda:
        return f"torch._grouped_mm needs CUDA; tensors are on {t.device} (no host-sync-free CPU path)"
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    if t.dtype != torch.bfloat16:
        return f"torch._grouped_mm supports bfloat16 only, got {t.dtype}"
    if cuda_capability(t.device) < (9, 0):
        return "torch._grouped_mm needs sm_90 or newer here"
    return None


def zero_tail_rows(out: torch.Tensor, group_offs: torch.Tensor) -> torch.Tensor:
    """In place, on the device: ``out[group_offs[-1]:] = 0``, the rows a vendor grouped GEMM leaves
    unwritten. Touches only those rows (a Triton kernel): a masked fill of the whole output would
    add a full memory pass per GEMM. The masked fill remains where Triton is absent."""
    return _zero_tail_fn()(out, group_offs)


@functools.lru_cache(maxsize=None)
def _zero_tail_fn():
    """The tail kernel's launcher, imported once (this runs twice per small vendor GEMM's step)."""
    try:
        from primus_turbo.triton.grouped_gemm.zero_tail import zero_tail_rows_
    except ImportError:
        return _masked_zero_tail
    return zero_tail_rows_


def _masked_zero_tail(out: torch.Tensor, group_offs: torch.Tensor) -> torch.Tensor:
    tail = torch.arange(out.size(0), device=out.device) >= group_offs[-1]
    return out.masked_fill_(tail[:, None], 0)


def _vendor_offs(group_offs: torch.Tensor, offs32: Optional[torch.Tensor], rows: int) -> torch.Tensor:
    """``torch._grouped_mm``'s ``offs`` (the int32 group ends ``group_offs[1:]``, or ``offs32`` when the
    caller made them already) clamped to ``[0, rows]`` on the device, no host sync.

    Why: on CUDA a ``group_lens`` summing past the operands' ``rows`` is not checked (that needs a
    host sync), and ``torch._grouped_mm`` follows the offsets it is given, reading (and, for the
    M-grouped GEMM, writing) past the tensors' ends. Clamped, it does what the Triton and Gluon
    kernels do with such offsets (they clamp every group to ``[0, M_total]``): rows past ``a``'s end
    contribute nothing, the groups that reach past it are cut at the last row. One more launch
    per vendor GEMM (the clamp), a few microseconds."""
    ends = group_offs[1:].to(torch.int32) if offs32 is None else offs32
    return ends.clamp(0, rows)


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned base and non-unit strides (what the CUTLASS grouped kernel requires)."""
    nbytes = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * nbytes) % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1)


# ---------------------------------------------------------------------------------------------
# M-grouped
# ---------------------------------------------------------------------------------------------
class GroupedGemmTorchBackend(KernelBackend):
    """``torch._grouped_mm`` (CUTLASS) on sm_90 bf16; the offsets clamped to ``a``'s rows (as the
    Triton and Gluon kernels clamp them), the tail rows past ``offs[G]`` zeroed."""

    backend_type = BackendType.TORCH

    @classmethod
    def check(cls, a, b, group_lens, group_offs, num_cu=None, **_) -> Optional[str]:
        reason = _sm90_bf16(a)
        if reason is not None:
            return reason
        if num_cu is not None:
            return "num_cu (SM cap) is not supported by torch._grouped_mm"
        if a.stride(1) != 1 or not _aligned(a):
            return "a must be row-major with 16-byte aligned rows"
        if _b_layout(b) == "S" or not _aligned(b):
            return "b's matrices must be row- or column-major with 16-byte aligned strides"
        return None

    @classmethod
    def execute(cls, a, b, group_lens, group_offs, num_cu=None, offs32=None, **_) -> torch.Tensor:
        if a.size(0) == 0 or b.size(2) == 0:
            return torch.empty((a.size(0), b.size(2)), dtype=a.dtype, device=a.device)
        if b.size(0) == 0 or a.size(1) == 0:
            return torch.zeros((a.size(0), b.size(2)), dtype=a.dtype, device=a.device)
        # offs32: group_offs[1:] as int32 when the caller already has it (the op's forward makes it
        # once); clamped to a's rows either way (an overrunning group_lens would take the vendor
        # kernel out of bounds: see _vendor_offs)
        out = torch._grouped_mm(a, b, offs=_vendor_offs(group_offs, offs32, a.size(0)))
        return zero_tail_rows(out, group_offs)  # torch._grouped_mm leaves them uninitialised


class GroupedGemmTritonBackend(KernelBackend):
    """Persistent Triton kernel with a device-side tile schedule (primus_turbo/triton/grouped_gemm).

    On sm_90 with bf16 / fp16 operands it runs the warp-specialized Gluon kernel
    (triton/grouped_gemm/grouped_gemm_gluon.py) wherever ``gluon_grouped_reason`` accepts the
    inputs (TMA-aligned rows, K- or N-contiguous weights), unless
    ``PRIMUS_TURBO_GROUPED_GEMM_GLUON=0``; the ``triton.language`` kernel everywhere else."""

    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, a, b, group_lens, group_offs, num_cu=None, **_) -> Optional[str]:
        try:
            from primus_turbo.triton.grouped_gemm import check_grouped_gemm_triton
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_grouped_gemm_triton(a, b, group_lens, group_offs)

    @classmethod
    def execute(cls, a, b, group_lens, group_offs, num_cu=None, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import group_offsets, grouped_gemm_triton

        gluon = _gluon16("grouped_gemm_gluon", a)
        if gluon is not None:
            offs = group_offs if group_offs is not None else group_offsets(group_lens)
            if gluon.gluon_grouped_reason(a, b, offs) is None:
                return gluon.grouped_gemm_gluon(a, b, offs, num_programs=num_cu, checked=True)
        return grouped_gemm_triton(a, b, group_lens, group_offs, num_cu=num_cu, checked=True)


def _gluon16(name: str, t: torch.Tensor):
    """The 16-bit Gluon grouped kernel module ``primus_turbo.triton.grouped_gemm.<name>`` when it
    may run ``t``'s problem (CUDA bf16 / fp16, ``PRIMUS_TURBO_GROUPED_GEMM_GLUON`` not 0, module
    importable), else None; the module's own ``*_reason`` check decides the rest (sm_90, strides)."""
    if not t.is_cuda or t.dtype not in (torch.bfloat16, torch.float16):
        return None
    mod = _GLUON16_MODULES.get(name, _UNSET)
    if mod is _UNSET:
        try:
            import importlib

            mod = importlib.import_module(f"primus_turbo.triton.grouped_gemm.{name}")
        except ImportError:
            mod = None
        _GLUON16_MODULES[name] = mod
    if mod is None:
        return None
    from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import gluon_grouped_enabled

    return mod if gluon_grouped_enabled() else None


_UNSET = object()
_GLUON16_MODULES: dict = {}  # module name -> module, or None where it does not import


class GroupedGemmGluonBackend(KernelBackend):
    """The warp-specialized 16-bit Gluon kernel alone (triton/grouped_gemm/grouped_gemm_gluon.py):
    sm_90, bf16 / fp16, TMA-aligned rows, K- or N-contiguous weights. The M-grouped default for
    small problems (:func:`gluon16_small_preferred`); a GLUON pin reaches it everywhere it can run.
    One launch: it reads the int64 offsets and zeroes the tail rows itself. Not autotuned (the
    TRITON backend already runs this kernel where it can)."""

    backend_type = BackendType.GLUON
    autotune = False

    @classmethod
    def check(cls, a, b, group_lens, group_offs, num_cu=None, **_) -> Optional[str]:
        gluon, reason = _gluon16_backend_module("grouped_gemm_gluon", a, group_offs, num_cu)
        return reason if gluon is None else gluon.gluon_grouped_reason(a, b, group_offs)

    @classmethod
    def execute(cls, a, b, group_lens, group_offs, num_cu=None, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_gluon import grouped_gemm_gluon

        return grouped_gemm_gluon(a, b, group_offs, num_programs=num_cu, checked=True)


#: The M-grouped 16-bit default takes the Gluon kernel (not ``torch._grouped_mm``) up to
#: GLUON16_SMALL_MAX_MNK multiply-adds (M_total * N * K), and up to GLUON16_SMALL_MAX_MNK_SHORT_K when
#: K <= GLUON16_SHORT_K. H200, 2026-12-01, device time under CUDA-graph replay (``--timing graph``
#: of ``benchmarks/bench_grouped_gemm.py``, ``scripts/diag_grouped_launch.py``,
#: ``scripts/diag_grouped16_configs.py``): the vendor kernel is inefficient on small problems
#: (~500 TFLOP/s at 1.3e10) and its op adds two launches (int32 offsets, zero tail, ~3 us), so Gluon
#: takes 0.81-0.90x its time from 6.4e9 to 1.7e10 (Qwen3-30B-A3B, GPT-OSS-20B at EP 16 / 32) and at
#: 2.6e10 with K 768 / 1536 (Qwen3-30B-A3B down at EP 8, Qwen3-235B-A22B down at EP 32); at 2.6e10
#: with K 2048 (Qwen3-30B-A3B gate_up at EP 16: 8 x 1024 rows, N 1536) the vendor kernel reaches ~670
#: TFLOP/s and Gluon takes 1.14-1.21x its time whatever the tile config, and from 3.4e10 up Gluon is
#: 0.93-1.12x. Under autograd the op keeps its vendor route (one decision for all three GEMMs: less
#: host time).
GLUON16_SMALL_MAX_MNK = 2.0e10
GLUON16_SMALL_MAX_MNK_SHORT_K = 3.0e10
GLUON16_SHORT_K = 1536


def gluon16_small_preferred(M: int, N: int, K: int) -> bool:
    """Whether the M-grouped 16-bit default prefers the Gluon kernel for an ``[M, K] x [K, N]``
    problem (shapes only; the rule and its measurements above)."""
    mnk = M * N * K
    return mnk <= GLUON16_SMALL_MAX_MNK or (K <= GLUON16_SHORT_K and mnk <= GLUON16_SMALL_MAX_MNK_SHORT_K)


#: ... and large problems: at least GLUON16_LARGE_MIN_ROWS rows per group (the mean, M_total / G) and
#: GLUON16_LARGE_MIN_MNK multiply-adds, N and K multiples of 256 (whole tiles in both the forward and
#: the grad_input GEMM, which swaps them), the smaller at least 1536 and the larger at least 4096.
#: H200, 2026-12-02, after the Gluon kernels' round-robin tile deal was fixed
#: (``benchmarks/bench_grouped_gemm.py``, Gluon (``turbo-triton``) / ``torch._grouped_mm``, balanced and
#: Primus' unbalanced routing): DeepSeek-V3 EP8 / EP32 at 2048 tokens per expert forward 1.01-1.12,
#: forward+backward 1.03-1.10; Qwen3-235B-A22B EP8 at 2048 gate_up 1.05-1.09, down 1.08-1.17;
#: Mixtral-8x7B gate_up at 2048 1.02 / 1.07; 4096 tokens (DeepSeek-V3, Mixtral, Qwen3-235B, EP8) the
#: default with this rule 1.01-1.08, geomean 1.037 forward / 1.042 forward+backward. Left to the
#: vendor kernel: problems under ~2e11 (Mixtral down at 2048 tokens, 1.2e11: 0.996 / 0.878; Qwen3-235B
#: at EP32, ~1e11: forward+backward 0.77-0.88, where the op's host time shows).
GLUON16_LARGE_MIN_ROWS = 2048
GLUON16_LARGE_MIN_MNK = 2.0e11


def gluon16_large_preferred(M: int, N: int, K: int, G: int) -> bool:
    """Whether the M-grouped 16-bit default prefers the Gluon kernel for a large problem (shapes
    only; symmetric in N and K, so it answers for the grad_input GEMM too; the rule and its
    measurements above)."""
    return (G > 0 and M >= GLUON16_LARGE_MIN_ROWS * G and M * N * K >= GLUON16_LARGE_MIN_MNK
            and N % 256 == 0 and K % 256 == 0 and min(N, K) >= 1536 and max(N, K) >= 4096)


#: ... and, for the dispatcher's own M-grouped default (the no-grad forward; under autograd the op
#: keeps its vendor route for these), mid-size problems between the two rules: at least two experts,
#: N >= GLUON16_MID_MIN_N, K >= 1536 and GLUON16_MID_MIN_MNK multiply-adds. H200 2026-12-02,
#: ``bench_grouped_gemm.py --modes fwd --ep 8 16 32 --tokens 512 2048`` (session 21, call 5; Gluon =
#: ``turbo-triton`` / ``torch._grouped_mm``, the old default in brackets): DeepSeek-V3 at 512 tokens
#: 0.995-1.157 (0.982-1.044), Qwen3-235B-A22B at 2048 tokens 1.041-1.221 (0.988-1.148) and gate_up
#: at 512 1.037-1.159, GPT-OSS-20B at 2048 tokens 1.038-1.325 (0.966-1.025). Left out: Qwen3-30B-A3B
#: (N 1536 / 2048: Gluon 0.77-0.83 at 16 experts x 1024-2048 rows, where the vendor kernel reaches
#: ~670 TFLOP/s), one expert (Mixtral-8x7B down at 512 rows: a 64-tile grid, 0.913), and below 5e10
#: (GPT-OSS-20B gate_up at EP8 512 tokens, 3.4e10: 0.65-0.86, host-bound). One balanced row inside
#: the rule trailed: Qwen3-235B-A22B down EP8 512 tokens, 0.883 (unbalanced 1.131).
GLUON16_MID_MIN_N = 2880
GLUON16_MID_MIN_MNK = 5.0e10


def gluon16_mid_preferred(M: int, N: int, K: int, G: int) -> bool:
    """Whether the dispatcher's M-grouped 16-bit default prefers the Gluon kernel for a mid-size
    problem (shapes only; the rule and its measurements above)."""
    return G >= 2 and N >= GLUON16_MID_MIN_N and K >= 1536 and M * N * K >= GLUON16_MID_MIN_MNK


def gluon16_preferred(M: int, N: int, K: int, G: int) -> bool:
    """:func:`gluon16_small_preferred` or :func:`gluon16_large_preferred`."""
    return gluon16_small_preferred(M, N, K) or gluon16_large_preferred(M, N, K, G)


def _gluon16_backend_module(name: str, t: torch.Tensor, group_offs, num_cu):
    """(the Gluon module, None) when a GLUON backend may run ``t``'s problem, else (None, why not):
    the offsets given, a valid ``num_cu``, what :func:`_gluon16` asks."""
    if group_offs is None:
        return None, "group_offs [G+1] on the device is needed (the op computes it)"
    if num_cu is not None and (not isinstance(num_cu, int) or isinstance(num_cu, bool) or num_cu < 1):
        return None, f"num_cu must be None or a positive int, got {num_cu!r}"
    gluon = _gluon16(name, t)
    if gluon is None:
        return None, (f"the 16-bit Gluon kernel ({name}) needs CUDA bf16 / fp16 operands, the module and "
                      "PRIMUS_TURBO_GROUPED_GEMM_GLUON not 0")
    return gluon, None


def _make_key(a, b, group_lens, group_offs, num_cu=None, **_):
    return (a.size(0), b.size(2), a.size(1), b.size(0), a.dtype, _b_layout(b), num_cu, a.device.type)


def _default(**kwargs) -> BackendType:
    """On sm_90 the Gluon kernel wherever it runs (bf16 / fp16, TMA-aligned strides, the switch not
    0); else the vendor kernel where it can run, our TRITON backend everywhere else (CPU, fp32,
    num_cu, ...). GLUON and TORCH are returned only after their own check said yes
    (``default_checked``). H200, 2026-12-02, device time (``benchmarks/bench_grouped_gemm.py
    --timing graph``, the 96 registry rows: five models, EP 8 / 16 / 32, 1024 / 4096 tokens per
    expert, balanced and unbalanced): the Gluon kernel 1.016-1.313x ``torch._grouped_mm`` forward
    (geomean 1.072), where the earlier size rules (:func:`gluon16_preferred`,
    :func:`gluon16_mid_preferred`; the vendor kernel between them, plus its int32 offsets and
    tail-zeroing launches) measured 0.963-1.205. The size rules date from before the Gluon kernels'
    tile deal was fixed and their launch path was planned per signature."""
    a = kwargs.get("a")
    if a is not None and a.is_cuda and GroupedGemmGluonBackend.can_handle(**kwargs):
        return BackendType.GLUON
    return BackendType.TORCH if GroupedGemmTorchBackend.can_handle(**kwargs) else BackendType.TRITON


grouped_gemm_dispatcher = AutoKernelDispatcher(
    op_name="grouped_gemm",
    family="grouped_gemm",
    backends=[GroupedGemmTorchBackend, GroupedGemmTritonBackend, GroupedGemmGluonBackend],
    make_key=_make_key,
    default=_default,
    default_checked=(BackendType.TORCH, BackendType.GLUON),
)


# ---------------------------------------------------------------------------------------------
# Variable K (wgrad)
# ---------------------------------------------------------------------------------------------
class GroupedGemmVariableKTorchBackend(KernelBackend):
    """``torch._grouped_mm(x.T, y, offs)`` (2-D x 2-D: one [P, Q] product per group of rows)."""

    backend_type = BackendType.TORCH

    @classmethod
    def check(cls, x, y, group_lens, group_offs, out=None, accumulate=False, num_cu=None, **_) -> Optional[str]:
        reason = _sm90_bf16(x)
        if reason is not None:
            return reason
        if num_cu is not None:
            return "num_cu (SM cap) is not supported by torch._grouped_mm"
        if x.stride(1) != 1 or y.stride(1) != 1 or not _aligned(x) or not _aligned(y):
            return "x and y must be row-major with 16-byte aligned rows"
        if accumulate and out is None:
            return "accumulate=True needs out"
        if out is not None and out.dtype not in (torch.float32, x.dtype):
            return f"out must be float32 or {x.dtype}, got {out.dtype}"
        return None

    @classmethod
    def execute(cls, x, y, group_lens, group_offs, out=None, accumulate=False, num_cu=None, offs32=None,
                **_) -> torch.Tensor:
        G = group_offs.numel() - 1
        if x.size(0) == 0 or G == 0 or x.size(1) == 0 or y.size(1) == 0:
            # empty contraction everywhere: torch._grouped_mm rejects it (pytorch#192497)
            res = torch.zeros((G, x.size(1), y.size(1)), dtype=x.dtype, device=x.device)
        else:
            # the groups run along x's and y's rows: clamped to them (see _vendor_offs)
            res = torch._grouped_mm(x.t(), y, offs=_vendor_offs(group_offs, offs32, x.size(0)))
        if out is None:
            return res
        if accumulate:
            return out.add_(res)
        return out.copy_(res)


class GroupedGemmVariableKTritonBackend(KernelBackend):
    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, x, y, group_lens, group_offs, out=None, accumulate=False, num_cu=None, **_) -> Optional[str]:
        try:
            from primus_turbo.triton.grouped_gemm import check_grouped_gemm_variable_k_triton
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_grouped_gemm_variable_k_triton(x, y, group_lens, group_offs, out=out, accumulate=accumulate)

    @classmethod
    def execute(cls, x, y, group_lens, group_offs, out=None, accumulate=False, num_cu=None, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import group_offsets, grouped_gemm_variable_k_triton

        gluon = _gluon16("grouped_gemm_variable_k_gluon", x)  # the same rule as the M-grouped GEMM's
        if gluon is not None:
            offs = group_offs if group_offs is not None else group_offsets(group_lens)
            if gluon.gluon_variable_k_reason(x, y, offs, out=out, accumulate=accumulate) is None:
                return gluon.grouped_gemm_variable_k_gluon(x, y, offs, out=out, accumulate=accumulate,
                                                           num_programs=num_cu)
        return grouped_gemm_variable_k_triton(
            x, y, group_lens, group_offs, out=out, accumulate=accumulate, num_cu=num_cu, checked=True)


#: The plain (non-accumulating) 16-bit wgrad runs the Gluon variable-K kernel from this many FLOPs
#: (2 * M * P * Q) up. H200 (session 6, scripts/check_gluon_grouped.py, DeepSeek-V3 / Qwen3-30B-A3B
#: EP8, balanced and unbalanced, 1e11-4e12 FLOPs): 0.987-1.34x ``torch._grouped_mm``, 1.096x geomean.
#: Below the bound the GEMM takes well under 0.2 ms and the Python launch would cost what the
#: kernel gains. Raised from 1e11 in session 21 (``scripts/diag_grouped_wgrad_route.py``, forward +
#: backward of the op against ``torch._grouped_mm``, one to eight experts, 1.0e11-1.4e11 FLOPs per
#: GEMM: GPT-OSS-20B, Mixtral-8x7B, Qwen3-235B-A22B, Qwen3-30B-A3B rows of the registry): with the
#: Gluon wgrad 0.47-0.86x, with the vendor wgrad (the op's torch-native form) 0.57-0.99x, the
#: device time equal (these steps are host-bound); at 4.8e11 and 3.9e12 the Gluon wgrad led
#: (1.080 / 1.037 against 1.058 / 1.006).
GLUON_WGRAD_MIN_FLOPS = 3e11


def gluon_wgrad(x, y, group_offs, out=None, accumulate=False):
    """The 16-bit Gluon variable-K module when the default dispatch gives it this wgrad, else None:
    the fused accumulation into an fp32 ``main_grad`` (it adds in its epilogue with a TMA
    reduce-add what the vendor path writes out and adds in a second pass: 1.23-1.55x
    ``torch._grouped_mm`` + ``add_`` on all 8 cases of session 6) and the plain wgrad of at least
    :data:`GLUON_WGRAD_MIN_FLOPS`. Shapes, dtypes and strides only: no host sync."""
    if group_offs is None:
        return None
    if accumulate:
        if out is None or out.dtype != torch.float32:
            return None  # a bf16 main_grad: the vendor GEMM + add_
    elif 2.0 * x.size(0) * x.size(1) * y.size(1) < GLUON_WGRAD_MIN_FLOPS:
        return None
    gluon = _gluon16("grouped_gemm_variable_k_gluon", x)
    if gluon is None or gluon.gluon_variable_k_reason(x, y, group_offs, out=out, accumulate=accumulate) is not None:
        return None
    return gluon


def _default_vk(x, y, group_lens, group_offs, out=None, accumulate=False, num_cu=None, **kw) -> BackendType:
    """The vendor kernel where it can run, except where :func:`gluon_wgrad` takes the problem
    (the TRITON backend runs the Gluon kernel)."""
    args = dict(x=x, y=y, group_lens=group_lens, group_offs=group_offs, out=out, accumulate=accumulate,
                num_cu=num_cu, **kw)
    if num_cu is None and gluon_wgrad(x, y, group_offs, out=out, accumulate=accumulate) is not None:
        return BackendType.TRITON
    return BackendType.TORCH if GroupedGemmVariableKTorchBackend.can_handle(**args) else BackendType.TRITON


def _make_key_vk(x, y, group_lens, group_offs, out=None, accumulate=False, num_cu=None, **_):
    return (x.size(0), x.size(1), y.size(1), group_offs.numel() - 1, x.dtype,
            None if out is None else out.dtype, bool(accumulate), num_cu, x.device.type)


class GroupedGemmVariableKGluonBackend(KernelBackend):
    """The 16-bit Gluon variable-K kernel alone (triton/grouped_gemm/grouped_gemm_variable_k_gluon.py):
    reached by a GLUON pin (so that one family pin serves the forward, dgrad and wgrad); the
    default reaches the kernel through :func:`gluon_wgrad` and the TRITON backend. Not autotuned."""

    backend_type = BackendType.GLUON
    autotune = False

    @classmethod
    def check(cls, x, y, group_lens, group_offs, out=None, accumulate=False, num_cu=None, **_) -> Optional[str]:
        gluon, reason = _gluon16_backend_module("grouped_gemm_variable_k_gluon", x, group_offs, num_cu)
        return reason if gluon is None else gluon.gluon_variable_k_reason(x, y, group_offs, out=out,
                                                                           accumulate=accumulate)

    @classmethod
    def execute(cls, x, y, group_lens, group_offs, out=None, accumulate=False, num_cu=None, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_variable_k_gluon import grouped_gemm_variable_k_gluon

        return grouped_gemm_variable_k_gluon(x, y, group_offs, out=out, accumulate=accumulate, num_programs=num_cu)


grouped_gemm_variable_k_dispatcher = AutoKernelDispatcher(
    op_name="grouped_gemm_variable_k",
    family="grouped_gemm",
    backends=[GroupedGemmVariableKTorchBackend, GroupedGemmVariableKTritonBackend, GroupedGemmVariableKGluonBackend],
    make_key=_make_key_vk,
    default=lambda **kw: _default_vk(**kw),
    default_checked=BackendType.TORCH,
    make_tune_kwargs=scratch_out_tune_kwargs,
)
