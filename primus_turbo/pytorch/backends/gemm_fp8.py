"""FP8 GEMM backends: TORCH (``torch._scaled_mm``: cuBLASLt / CUTLASS, or CPU), TRITON and GLUON.

Every backend computes the canonical problem of docs/low_precision.md on pre-quantized K-major
operands: ``C[M, N] = (a_q[M, K] * a_scale) @ (b_q[N, K] * b_scale)^T``, or ``out += C`` when
accumulating, with the scale shapes of ``mode`` (a ``ScalingGranularity``). Keyword arguments of
``check``/``execute``: ``a_q, a_scale, b_q, b_scale, mode, out=None, out_dtype=None,
accumulate=False, block_size=128``.
"""

from __future__ import annotations

from typing import Optional

import torch

from primus_turbo.triton import is_interpreter, triton_available

from ..core.backend import (
    AutoKernelDispatcher, BackendType, KernelBackend, cuda_capability, scratch_out_tune_kwargs,
)
from ..core.low_precision import ScalingGranularity

__all__ = ["GemmFP8TorchBackend", "GemmFP8TritonBackend", "GemmFP8GluonBackend", "gemm_fp8_dispatcher",
           "FP8_GEMM_DTYPES"]

FP8_GEMM_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_G = ScalingGranularity


def _granularity(mode) -> ScalingGranularity:
    if isinstance(mode, ScalingGranularity):
        return mode
    return ScalingGranularity[str(getattr(mode, "name", mode)).upper()]


def _common_check(a_q, a_scale, b_q, b_scale, mode, out, out_dtype, accumulate) -> Optional[str]:
    for name, t in (("a_q", a_q), ("b_q", b_q)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor, got {type(t).__name__}"
        if t.dim() != 2:
            return f"{name} must be 2-D, got {t.dim()}-D"
        if t.dtype not in FP8_GEMM_DTYPES:
            return f"{name}.dtype must be float8_e4m3fn or float8_e5m2, got {t.dtype}"
    if a_q.size(1) != b_q.size(1):
        return f"K mismatch: a_q is {tuple(a_q.shape)}, b_q is {tuple(b_q.shape)} (both [rows, K])"
    if a_q.device != b_q.device:
        return f"operands on different devices: a_q on {a_q.device}, b_q on {b_q.device}"
    try:
        _granularity(mode)
    except KeyError:
        return f"unknown scaling mode {mode!r}"
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        return f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}"
    if accumulate:
        if out is None:
            return "accumulate=True needs out"
        if out.dtype not in _OUT_DTYPES:
            return f"accumulation buffer must be fp32, bf16 or fp16, got {out.dtype}"
    return None


def _row_major_16(t: torch.Tensor) -> bool:
    """cuBLASLt FP8 operands: unit inner stride, 16-byte aligned base and leading dimension."""
    return t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


# ----------------------------------------------------------------------------------------------
# What torch._scaled_mm runs, found by running it once
# ----------------------------------------------------------------------------------------------
# Its coverage depends on the torch build as well as the device: CPU support for row-wise scales
# and for E5M2 came in later torch releases than tensor-wise E4M3, and on sm_90 row-wise scaling
# writes fp32 (and fp16) only where torch routes it to cuBLASLt >= 12.9; older builds run a
# CUTLASS kernel that writes bf16 only. The tests run one torch here and another on the GPU
# machine, so the backend asks torch itself: one tiny _scaled_mm per combination, cached.
_UNPROBED = object()
_PROBES: dict = {}


def _probe_operands(rowwise: bool, m: int, n: int, k: int, device: torch.device):
    """fp32 (a [m, k], b [n, k], scale_a, scale_b, a @ b.T dequantized) on ``device``: small
    integers (exact in both FP8 formats) and power-of-two scales, so every product, sum and
    scaling is exact in bf16, fp16 and fp32 and a result can be compared bit for bit. Built on
    the device (no host-to-device copy, which would synchronize on a first call under
    ``torch.cuda.set_sync_debug_mode``)."""
    a = (torch.arange(m * k, device=device) % 5 - 2).float().reshape(m, k)
    b = (torch.arange(n * k, device=device) * 3 % 7 - 3).float().reshape(n, k)
    if not rowwise:
        sa, sb = torch.full((), 2.0, device=device), torch.full((), 0.25, device=device)
        return a, b, sa, sb, (a @ b.t()) * 0.5
    # a different scale per row of A and of B: one applied along the wrong dim shows in the values
    sa = torch.exp2(torch.arange(m, device=device) % 3 - 1.0).reshape(m, 1)
    sb = torch.exp2(1.0 - torch.arange(n, device=device) % 4).reshape(1, n)
    return a, b, sa, sb, (a * sa) @ (b * sb.reshape(n, 1)).t()


def _probe(device: torch.device, rowwise: bool, a_dtype, b_dtype, out_dtype) -> Optional[str]:
    what = (f"{'row-wise' if rowwise else 'tensor-wise'} scaling, {str(a_dtype)[6:]} x {str(b_dtype)[6:]} -> "
            f"{str(out_dtype)[6:]}")
    # CPU: odd sizes, so that a size rule would show; CUDA: the sizes cuBLASLt takes (check() has them)
    m, n, k = (3, 5, 7) if device.type == "cpu" else (16, 16, 32)
    try:
        a, b, sa, sb, ref = _probe_operands(rowwise, m, n, k, device)
        res = torch._scaled_mm(a.to(a_dtype), b.to(b_dtype).t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot", with torch's reason
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"torch._scaled_mm on {device.type} cannot run {what} in torch {torch.__version__} ({msg})"
    if device.type != "cpu":
        return None  # comparing values would sync the device; the GPU tests compare them
    if res.dtype != out_dtype or tuple(res.shape) != (m, n) or not torch.equal(res, ref.to(out_dtype)):
        return f"torch._scaled_mm on cpu gives wrong values for {what} in torch {torch.__version__}"
    return None


def _scaled_mm_reason(device: torch.device, g, a_dtype, b_dtype, out_dtype) -> Optional[str]:
    """None if ``torch._scaled_mm`` runs ``g`` (TENSORWISE / ROWWISE) with these dtypes on
    ``device`` (probed once, cached), else why not. On CUDA only what varies with the build is
    probed (row-wise scaling writing fp32 / fp16); the rest is check()'s fixed rules."""
    rowwise = g is _G.ROWWISE
    key = (device.type, device.index, rowwise, a_dtype, b_dtype, out_dtype)
    reason = _PROBES.get(key, _UNPROBED)
    if reason is _UNPROBED:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a probe would be recorded into the graph: answer "no" for now, without caching it
            return "torch._scaled_mm is not probed during CUDA graph capture (run the op once before capturing)"
        reason = _PROBES[key] = _probe(device, rowwise, a_dtype, b_dtype, out_dtype)
    return reason


def _result_dtype(g, device: torch.device, a_dtype, b_dtype, want, accumulate) -> torch.dtype:
    """The dtype ``torch._scaled_mm`` writes. Accumulation (``out += C``): fp32, so that ``C`` is
    rounded only once, by the add into ``out``; bf16 where _scaled_mm cannot write fp32 (row-wise
    scaling through CUTLASS), so each addend is then rounded to bf16 before the add."""
    if not accumulate:
        return want
    if g is _G.TENSORWISE and device.type == "cuda":
        return torch.float32  # cuBLASLt's tensor-wise FP8 GEMM writes fp32 in every build
    if _scaled_mm_reason(device, g, a_dtype, b_dtype, torch.float32) is None:
        return torch.float32
    return torch.bfloat16


class GemmFP8TorchBackend(KernelBackend):
    """``torch._scaled_mm``: TENSORWISE and ROWWISE, on CUDA sm_89+ (cuBLASLt; row-wise on sm_90
    through cuBLASLt or CUTLASS, as torch chooses) and on CPU where this torch's ``_scaled_mm``
    runs the combination (probed once, see ``_scaled_mm_reason``).

    Accumulation (``out += C``, Megatron's fused wgrad): ``_scaled_mm`` cannot add into ``out``,
    so it writes ``C`` in fp32 and one ``out.add_`` follows (one rounding, into ``out``'s dtype);
    where row-wise scaling cannot write fp32 (CUTLASS: bf16 only), ``C`` is bf16 before the add."""

    backend_type = BackendType.TORCH

    @classmethod
    def check(cls, a_q=None, a_scale=None, b_q=None, b_scale=None, mode=None, out=None, out_dtype=None,
              accumulate=False, block_size=128, **_) -> Optional[str]:
        reason = _common_check(a_q, a_scale, b_q, b_scale, mode, out, out_dtype, accumulate)
        if reason is not None:
            return reason
        g = _granularity(mode)
        if g not in (_G.TENSORWISE, _G.ROWWISE):
            return f"torch._scaled_mm has no {g.name} scaling here (TENSORWISE and ROWWISE only)"
        if not hasattr(torch, "_scaled_mm"):
            return "this torch has no torch._scaled_mm"
        dev = a_q.device
        if dev.type not in ("cuda", "cpu"):
            return f"torch._scaled_mm runs CUDA and CPU tensors, got {dev}"
        M, K = a_q.shape
        N = b_q.shape[0]
        if g == _G.TENSORWISE:
            if a_scale.numel() != 1 or b_scale.numel() != 1 or a_scale.dtype != torch.float32 \
                    or b_scale.dtype != torch.float32:
                return "TENSORWISE scales must be one fp32 value each"
        elif a_scale.numel() != M or b_scale.numel() != N or a_scale.dtype != torch.float32 \
                or b_scale.dtype != torch.float32:
            return f"ROWWISE scales must be fp32 [M, 1] and [N, 1], got {tuple(a_scale.shape)}, {tuple(b_scale.shape)}"
        want = out.dtype if out is not None else (out_dtype or torch.bfloat16)
        if dev.type == "cpu":
            # accumulation needs the fp32 result or, failing that, the bf16 one (_result_dtype)
            res = _result_dtype(g, dev, a_q.dtype, b_q.dtype, want, accumulate)
            return _scaled_mm_reason(dev, g, a_q.dtype, b_q.dtype, res)
        cap = cuda_capability(dev)
        if cap < (8, 9):
            return f"sm_{cap[0]}{cap[1]} has no FP8 tensor cores"
        if K % 16 or N % 16:
            return f"torch._scaled_mm needs K and N to be multiples of 16 on CUDA, got K={K}, N={N}"
        if not (_row_major_16(a_q) and _row_major_16(b_q)):
            return "torch._scaled_mm needs K-contiguous, 16-byte aligned operands on CUDA"
        if a_q.dtype == torch.float8_e5m2 and b_q.dtype == torch.float8_e5m2:
            return "cuBLASLt has no E5M2 x E5M2 FP8 GEMM"
        if g == _G.TENSORWISE:
            return None
        if cap < (9, 0):
            return f"torch._scaled_mm row-wise scaling needs sm_90, got sm_{cap[0]}{cap[1]}"
        if a_q.dtype != torch.float8_e4m3fn or b_q.dtype != torch.float8_e4m3fn:
            return "torch._scaled_mm row-wise scaling takes E4M3 x E4M3 only"
        if not accumulate and want != torch.bfloat16:
            reason = _scaled_mm_reason(dev, g, a_q.dtype, b_q.dtype, want)
            if reason is not None:
                return f"row-wise scaling writes bf16 only in this build: {reason}"
        return None

    @classmethod
    def execute(cls, a_q=None, a_scale=None, b_q=None, b_scale=None, mode=None, out=None, out_dtype=None,
                accumulate=False, block_size=128, **_) -> torch.Tensor:
        g = _granularity(mode)
        want = out.dtype if out is not None else (out_dtype or torch.bfloat16)
        res_dtype = _result_dtype(g, a_q.device, a_q.dtype, b_q.dtype, want, accumulate)
        if g == _G.TENSORWISE:
            # the quantizers' scales are 0-dim already: no reshape op per call then
            sa = a_scale if a_scale.dim() == 0 else a_scale.reshape(())
            sb = b_scale if b_scale.dim() == 0 else b_scale.reshape(())
        else:
            sa = a_scale.reshape(-1, 1).contiguous()
            sb = b_scale.reshape(1, -1).contiguous()
        res = torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb, out_dtype=res_dtype)
        if accumulate:
            # _scaled_mm's epilogue cannot add into out: a separate add, in out's dtype
            out.add_(res)
            return out
        if res.dtype != want:
            res = res.to(want)
        if out is not None:
            out.copy_(res)
            return out
        return res


class GemmFP8TritonBackend(KernelBackend):
    """Our persistent Triton FP8 kernel: every mode (MX emulated exactly), fused accumulation."""

    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, a_q=None, a_scale=None, b_q=None, b_scale=None, mode=None, out=None, out_dtype=None,
              accumulate=False, block_size=128, **_) -> Optional[str]:
        reason = _common_check(a_q, a_scale, b_q, b_scale, mode, out, out_dtype, accumulate)
        if reason is not None:
            return reason
        try:
            from primus_turbo.triton.gemm.gemm_fp8_kernel import check_gemm_fp8_triton
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_gemm_fp8_triton(a_q, a_scale, b_q, b_scale, mode, out=out, out_dtype=None if out is not None
                                     else out_dtype, accumulate=accumulate, block_size=block_size)

    @classmethod
    def execute(cls, a_q=None, a_scale=None, b_q=None, b_scale=None, mode=None, out=None, out_dtype=None,
                accumulate=False, block_size=128, **_) -> torch.Tensor:
        from primus_turbo.triton.gemm.gemm_fp8_kernel import gemm_fp8_triton_prechecked

        return gemm_fp8_triton_prechecked(a_q, a_scale, b_q, b_scale, mode, out=out,
                                          out_dtype=out_dtype or torch.bfloat16, accumulate=accumulate,
                                          block_size=block_size)


class GemmFP8GluonBackend(KernelBackend):
    """Warp-specialized Gluon kernel for Hopper (triton/gemm/gemm_fp8_gluon.py): BLOCKWISE E4M3
    only (1x128 activation groups x 128x128 weight blocks), no accumulation: the forward GEMM and
    the E4M3 dgrad (``dY`` 1x128 x the weight's transposed copy, 128x128). The default for those
    on sm_90 (see ``_default``); E5M2 gradients (HYBRID), accumulation, unaligned rows and every
    other platform go to TRITON. The 1x128 x 1x128 wgrad runs the kernel's per-row B scale path
    (``PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD=0`` sends it to TRITON). A pin (``PRIMUS_TURBO_GEMM_BACKEND=
    FP8:GLUON``) covers every FP8 GEMM, and those it cannot run raise a ValueError saying why."""

    backend_type = BackendType.GLUON

    @classmethod
    def check(cls, a_q=None, a_scale=None, b_q=None, b_scale=None, mode=None, out=None, out_dtype=None,
              accumulate=False, block_size=128, **_) -> Optional[str]:
        # cheapest refusals first: this check runs on every BLOCKWISE call (the default rule)
        try:
            g = _granularity(mode)
        except KeyError:
            return f"unknown scaling mode {mode!r}"
        if g != _G.BLOCKWISE:
            return f"the Gluon FP8 kernel is BLOCKWISE only, got {g.name}"
        if accumulate:
            return "the Gluon FP8 kernel does not accumulate into out"
        if block_size != 128:
            return f"the Gluon FP8 kernel takes 128-wide scale blocks, got block_size={block_size}"
        for name, t in (("a_q", a_q), ("b_q", b_q)):
            if isinstance(t, torch.Tensor) and t.dtype != torch.float8_e4m3fn:
                return f"{name}.dtype={t.dtype}; the Gluon FP8 kernel takes float8_e4m3fn only"
        reason = _common_check(a_q, a_scale, b_q, b_scale, mode, out, out_dtype, accumulate)
        if reason is not None:
            return reason
        gluon = _gluon_module()
        if gluon is None:
            return "the Gluon FP8 kernel is not importable"
        return gluon.gluon_blockwise_reason(a_q, a_scale, b_q, b_scale, out=out,
                                            out_dtype=None if out is not None else (out_dtype or torch.bfloat16))

    @classmethod
    def execute(cls, a_q=None, a_scale=None, b_q=None, b_scale=None, mode=None, out=None, out_dtype=None,
                accumulate=False, block_size=128, **_) -> torch.Tensor:
        # the dispatcher calls execute only after this backend's check accepted these arguments
        # (default rule or pin), so the kernel's own copy of that check is skipped
        return _gluon_module().gemm_fp8_blockwise_gluon_prechecked(a_q, a_scale, b_q, b_scale, out=out,
                                                                   out_dtype=out_dtype or torch.bfloat16)


_GLUON_MODULE: list = []


def _gluon_module():
    """primus_turbo.triton.gemm.gemm_fp8_gluon, or None where it cannot be imported (imported once)."""
    if not _GLUON_MODULE:
        try:
            from primus_turbo.triton.gemm import gemm_fp8_gluon as mod
        except ImportError:
            mod = None
        _GLUON_MODULE.append(mod)
    return _GLUON_MODULE[0]


def _make_key(a_q=None, a_scale=None, b_q=None, b_scale=None, mode=None, out=None, out_dtype=None,
              accumulate=False, block_size=128, **_):
    return (
        a_q.size(0), b_q.size(0), a_q.size(1), a_q.dtype, b_q.dtype,
        out_dtype if out is None else out.dtype, str(getattr(mode, "name", mode)),
        None if a_scale is None else tuple(a_scale.shape[:1]), None if b_scale is None else tuple(b_scale.shape[:1]),
        block_size, bool(accumulate), a_q.device.type,
    )


def _default(**kwargs) -> BackendType:
    """The FP8 GEMM default, in one place:

    * TENSORWISE / ROWWISE: TORCH (cuBLASLt / CUTLASS) where ``_scaled_mm`` can run the inputs;
      on CPU only without the Triton interpreter (``TRITON_INTERPRET=1`` asks for the Triton kernels
      on CPU, and the test suite runs them so);
    * BLOCKWISE: GLUON where its check passes (sm_90, E4M3 x E4M3, 1x128 x 128x128 scales, no
      accumulation, TMA-aligned rows: the forward GEMM, the E4M3 dgrad and, unless
      ``PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD=0``, the 1x128 x 1x128 wgrad without accumulation);
    * TRITON for the rest (MX, CPU under the interpreter, E5M2, accumulation,
      unaligned operands, ...), without the dispatcher's fallback warning.

    Both TORCH and GLUON are returned only after their own check said yes (``default_checked``).
    The checks read dtypes, shapes, strides, a cached device capability and cached ``_scaled_mm``
    probes (each run once, on tiny tensors): no host sync per call."""
    mode = kwargs.get("mode")
    try:
        g = _granularity(mode)
    except KeyError:
        return BackendType.TRITON
    if g in (_G.TENSORWISE, _G.ROWWISE):
        a_q = kwargs.get("a_q")
        on_cpu = isinstance(a_q, torch.Tensor) and a_q.device.type == "cpu"
        if not (on_cpu and triton_available() and is_interpreter()) and GemmFP8TorchBackend.can_handle(**kwargs):
            return BackendType.TORCH
    elif g == _G.BLOCKWISE and GemmFP8GluonBackend.can_handle(**kwargs):
        return BackendType.GLUON
    return BackendType.TRITON


gemm_fp8_dispatcher = AutoKernelDispatcher(
    op_name="gemm_fp8",
    family="gemm",
    backends=[GemmFP8TorchBackend, GemmFP8TritonBackend, GemmFP8GluonBackend],
    make_key=_make_key,
    default=_default,
    default_checked=(BackendType.TORCH, BackendType.GLUON),
    make_tune_kwargs=scratch_out_tune_kwargs,
)
