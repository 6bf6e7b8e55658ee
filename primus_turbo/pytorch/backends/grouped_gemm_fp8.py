"""FP8 grouped GEMM backends (MoE experts): TRITON (every granularity) and TORCH (``torch._scaled_grouped_mm``).

Two problems, each with a dispatcher in the ``grouped_gemm`` family at precision FP8 (so
``GlobalBackendManager.set_grouped_gemm_backend(..., precision="FP8")`` /
``PRIMUS_TURBO_GROUPED_GEMM_BACKEND=FP8:TRITON`` pin them):

* M-grouped (forward, dgrad): ``out[rows of g] = (a_q * a_scale)[rows of g] @ (b_q[g] * b_scale[g]).T``
  with K-major ``a_q [M_total, K]``, ``b_q [G, N, K]`` and the rows past ``offs[G]`` zeroed.
  Keyword arguments: ``a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype,
  block_size=128, num_cu=None``. Modes TENSORWISE, ROWWISE, BLOCKWISE, MX_BLOCKWISE (E8M0 scales
  ``[M_total, K/32]`` / ``[G, N, K/32]``, emulated exactly on bf16 tensor cores).
* variable-K (wgrad): ``out[g] (+)= (x_t * x_scale)[:, rows of g] @ ((y_t * y_scale)[:, rows of g]).T``
  (TENSORWISE / ROWWISE / BLOCKWISE / MX_BLOCKWISE; BLOCKWISE (fp32 scales ``[P, M_total/bs]``,
  1 x ``block_size`` token blocks) and MX (32-token blocks) need every group offset to be a
  multiple of the token block: the op feeds the layout of :func:`padded_group_layout`). Keyword
  arguments: ``x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None,
  accumulate=False, out_dtype, num_cu=None, block_size=128``.

TORCH (``torch._scaled_grouped_mm``, CUTLASS, sm_90+): TENSORWISE / ROWWISE with E4M3 operands on
both sides (not E5M2, so not HYBRID's backward), bf16 output, K and N multiples of 16, no
``num_cu``. The M-grouped problem is its 2d-3d form (row scales ``[M_total]``, per-(expert, row)
weight scales ``[G, N]``; the rows past ``offs[G]``, which it leaves uninitialised, are zeroed
after). The variable-K problem is its 2d-2d form, whose per-group K slices must start 16-byte
aligned: the FP8 operands are first gathered into a token layout whose group segments are padded
with zero columns to multiples of 16 (:func:`padded_group_layout`, on the device); a bf16 result is
added into (or converted to) ``out`` afterwards, so a fused fp32 ``main_grad`` accumulation adds a
bf16-rounded wgrad (TRITON sums in fp32). It is the M-grouped default where the Gluon kernel
cannot run and it can (TRITON elsewhere); the variable-K problem defaults to TRITON (no padding
copies). Pin it (``GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH,
precision="FP8")``, ``PRIMUS_TURBO_GROUPED_GEMM_BACKEND=FP8:TORCH``) or let autotune pick it. A pin
on inputs it cannot run (BLOCKWISE, MX, E5M2, CPU, ...) raises ``ValueError`` naming the reason.

GLUON (triton/grouped_gemm/grouped_gemm_fp8_gluon.py, sm_90): the M-grouped BLOCKWISE problem with
E4M3 operands (forward, E4M3 dgrad), a warp-specialized TMA / wgmma kernel, the default on sm_90
(``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON=0`` turns it off); see :class:`GroupedGemmFP8GluonBackend`.
The same kernel runs TENSORWISE / ROWWISE E4M3 with broadcast scales, the default for every shape
it can run (:func:`gluon_scaled_preferred`, measured; ``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED``
0 forces the vendor op).
The variable-K BLOCKWISE problem (the wgrad, E4M3 or E5M2 operands, accumulation into fp32) has
its own Gluon kernel (triton/grouped_gemm/grouped_gemm_fp8_variable_k_gluon.py), the variable-K
default on sm_90 where it can run (``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_WGRAD=0`` turns it off);
see :class:`GroupedGemmFP8VariableKGluonBackend`.

Keys read shapes, dtypes and devices only: never a device value (no host sync).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..core.backend import (
    AutoKernelDispatcher, BackendType, KernelBackend, cuda_capability, scratch_out_tune_kwargs,
)
from ..core.env import env_auto_flag
from .grouped_gemm import _vendor_offs, zero_tail_rows

__all__ = [
    "GroupedGemmFP8GluonBackend",
    "GroupedGemmFP8TorchBackend",
    "GroupedGemmFP8TritonBackend",
    "GroupedGemmFP8VariableKGluonBackend",
    "GroupedGemmFP8VariableKTorchBackend",
    "GroupedGemmFP8VariableKTritonBackend",
    "grouped_gemm_fp8_dispatcher",
    "grouped_gemm_fp8_variable_k_dispatcher",
    "padded_group_layout",
    "gather_rows",
    "gluon_grouped_enabled",
    "gluon_grouped_scaled_enabled",
    "gluon_scaled_preferred",
    "gluon_grouped_wgrad_enabled",
]


def _mode_name(mode) -> str:
    return str(getattr(mode, "name", mode)).upper()


# ----------------------------------------------------------------------------------------------
# Group-aligned token layout (device-side, no host sync)
# ----------------------------------------------------------------------------------------------
def padded_group_layout(group_offs: torch.Tensor, m_total: int, align: int,
                        nonempty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A token layout whose group segments start at multiples of ``align``.

    Returns ``(src, padded_offs)``: ``src [M_pad]`` int64, the source row of each padded row, or -1
    for a padding row (the zero rows that round each group up to a multiple of ``align``, and
    everything past the last group: the rows past ``offs[G]`` are dropped); ``padded_offs [G+1]``
    the group offsets in the padded layout (multiples of ``align``). ``M_pad`` is the static bound
    ``round_up(m_total + align * G, align)``, so shapes never depend on device values.
    ``nonempty=True`` gives every group, empty ones too, at least ``align`` (zero) rows. Offsets are
    clamped to ``[0, m_total]`` exactly as the kernels clamp them.

    On CUDA (and on CPU under ``TRITON_INTERPRET=1``) one Triton launch computes both
    (``primus_turbo/triton/grouped_gemm/padded_layout.py``; the torch version below is about fifteen
    small ops, ~0.5 ms of host time per call); :func:`_padded_group_layout_torch` elsewhere (no
    Triton, plain CPU, other offset dtypes, under ``torch.compile``, sizes past 2**31 rows).
    """
    if torch.compiler.is_compiling():
        # opaque to the compiler: inductor (torch 2.11, CUDA) generated wrong code for the torch
        # version's ops (the FP8 / FP4 grouped wgrad read 2-8 dB against eager, session 47)
        return torch.ops.primus_turbo.padded_group_layout(group_offs, m_total, align, nonempty)
    return _padded_group_layout_eager(group_offs, m_total, align, nonempty)


def _padded_group_layout_eager(group_offs: torch.Tensor, m_total: int, align: int,
                               nonempty: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if _padded_layout_backend(group_offs, m_total, align) == "triton":
        from primus_turbo.triton.grouped_gemm.padded_layout import padded_group_layout_triton

        return padded_group_layout_triton(group_offs, m_total, align, nonempty)
    return _padded_group_layout_torch(group_offs, m_total, align, nonempty)


padded_group_layout_impl = torch.library.custom_op("primus_turbo::padded_group_layout", _padded_group_layout_eager,
                                                   mutates_args=())


@padded_group_layout_impl.register_fake
def _padded_group_layout_fake(group_offs, m_total, align, nonempty):
    G = group_offs.numel() - 1
    m_pad = -(-(m_total + align * G) // align) * align
    return (group_offs.new_empty((m_pad,), dtype=torch.int64), group_offs.new_empty((G + 1,), dtype=torch.int64))


def _padded_layout_backend(group_offs: torch.Tensor, m_total: int, align: int) -> str:
    """``"triton"`` where the one-launch kernel computes :func:`padded_group_layout`, else ``"torch"``."""
    if torch.compiler.is_compiling():  # traced: the torch version (the launch reads data pointers)
        return "torch"
    from primus_turbo.triton import is_interpreter, triton_available

    if not (group_offs.is_cuda or (group_offs.device.type == "cpu" and is_interpreter())):
        return "torch"
    if group_offs.dtype not in (torch.int32, torch.int64) or group_offs.dim() != 1 \
            or not group_offs.is_contiguous() or group_offs.numel() == 0:
        return "torch"
    if not triton_available():
        return "torch"
    if not (isinstance(m_total, int) and isinstance(align, int)) or m_total < 0 or align < 1:
        return "torch"
    from primus_turbo.triton.grouped_gemm.padded_layout import MAX_ROWS

    m_pad = -(-(m_total + align * (group_offs.numel() - 1)) // align) * align
    return "triton" if m_pad < MAX_ROWS else "torch"


def _padded_group_layout_torch(group_offs: torch.Tensor, m_total: int, align: int,
                               nonempty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`padded_group_layout` in torch ops (the fallback, and the reference of the tests)."""
    G = group_offs.numel() - 1
    dev = group_offs.device
    offs = group_offs.clamp(0, m_total)
    lens = (offs[1:] - offs[:-1]).clamp(min=0)
    plens = (lens + (align - 1)) // align * align
    if nonempty:
        plens = plens.clamp(min=align)
    poffs = torch.zeros(G + 1, dtype=torch.int64, device=dev)
    poffs[1:] = plens.cumsum(0)
    m_pad = -(-(m_total + align * G) // align) * align
    p = torch.arange(m_pad, dtype=torch.int64, device=dev)
    if G == 0:
        return torch.full_like(p, -1), poffs
    g = torch.searchsorted(poffs[1:].contiguous(), p, right=True)  # G: past the last group
    gc = g.clamp(max=G - 1)
    j = p - poffs[gc]
    valid = (g < G) & (j < lens[gc])
    return torch.where(valid, offs[gc] + j, torch.full_like(p, -1)), poffs


def gather_rows(x: torch.Tensor, src: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``x`` re-laid along ``dim`` by ``src`` (from :func:`padded_group_layout`); -1 rows are zero.
    1-byte dtypes (FP8, packed FP4, E8M0) are gathered through their uint8 view (zero bytes are +0)."""
    if dim == 0 and x.dim() == 2 and torch.compiler.is_compiling():
        return torch.ops.primus_turbo.gather_rows(x, src)  # opaque to the compiler, as padded_group_layout
    return _gather_rows_eager(x, src, dim)


def _gather_rows_eager(x: torch.Tensor, src: torch.Tensor, dim: int = 0) -> torch.Tensor:
    if dim == 0 and x.dim() == 2 and x.size(0) > 0:
        from primus_turbo.pytorch.ops.moe_permute import _gather_rows, permute_backend

        if permute_backend(x) == "triton":  # one pass at copy speed (index_select + masked_fill is three)
            return _gather_rows(x, src)
    one_byte = x.element_size() == 1 and x.dtype != torch.uint8
    xv = x.view(torch.uint8) if one_byte else x
    if x.size(dim) == 0:
        shape = list(x.shape)
        shape[dim] = src.numel()
        out = xv.new_zeros(shape)
    else:
        out = xv.index_select(dim, src.clamp(min=0))
        keep = (src >= 0).view([-1 if d == dim else 1 for d in range(x.dim())])
        out = out.masked_fill_(~keep, 0)
    return out.view(x.dtype) if one_byte else out


def _gather_rows_op(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return _gather_rows_eager(x, src, 0)


gather_rows_impl = torch.library.custom_op("primus_turbo::gather_rows", _gather_rows_op, mutates_args=())


@gather_rows_impl.register_fake
def _gather_rows_fake(x, src):
    return x.new_empty((src.numel(), x.size(1)))


# ----------------------------------------------------------------------------------------------
# TORCH: torch._scaled_grouped_mm (sm_90 CUTLASS), TENSORWISE / ROWWISE E4M3 only
# ----------------------------------------------------------------------------------------------
_SG_ALIGN = 16  # bytes: FP8 strides / group starts the CUTLASS (TMA) kernel needs


def _scaled_grouped_mm_reason(t: torch.Tensor, mode: str, *dtypes) -> Optional[str]:
    if not hasattr(torch, "_scaled_grouped_mm"):
        return "this torch has no torch._scaled_grouped_mm"
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        return "torch._scaled_grouped_mm needs CUDA tensors"
    if torch.version.hip:
        return "the TORCH FP8 grouped backend is wired for CUDA (sm_90) only"
    if cuda_capability(t.device) < (9, 0):
        return "torch._scaled_grouped_mm needs sm_90 or newer"
    if mode not in ("TENSORWISE", "ROWWISE"):
        return f"torch._scaled_grouped_mm serves TENSORWISE / ROWWISE here, not {mode}"
    if any(d != torch.float8_e4m3fn for d in dtypes):
        return f"torch._scaled_grouped_mm takes float8_e4m3fn operands only, got {', '.join(map(str, dtypes))}"
    return None


def _expand_scale(s: torch.Tensor, shape: tuple) -> torch.Tensor:
    """An fp32 scale broadcast to ``shape`` as a contiguous tensor (one scale per row / column)."""
    s = s.float()
    if s.numel() == 1:
        return s.reshape(()).expand(shape).contiguous()
    return s.reshape(shape).contiguous() if s.numel() == math.prod(shape) else s.expand(shape).contiguous()


class GroupedGemmFP8TorchBackend(KernelBackend):
    """``torch._scaled_grouped_mm`` 2d-3d (CUTLASS, sm_90): TENSORWISE / ROWWISE, E4M3, bf16 out."""

    backend_type = BackendType.TORCH

    @classmethod
    def check(cls, a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype, block_size=128,
              num_cu=None, **_) -> Optional[str]:
        mode = _mode_name(mode)
        reason = _scaled_grouped_mm_reason(a_q, mode, a_q.dtype, b_q.dtype)
        if reason is not None:
            return reason
        if num_cu is not None:
            return "num_cu (SM cap) is not supported by torch._scaled_grouped_mm"
        if out_dtype != torch.bfloat16:
            return f"torch._scaled_grouped_mm writes bfloat16 only, got out_dtype={out_dtype}"
        if a_q.dim() != 2 or b_q.dim() != 3 or a_q.size(1) != b_q.size(2) or b_q.device != a_q.device:
            return "a_q [M_total, K] and b_q [G, N, K] on one device are needed"
        M, K = a_q.shape
        G, N, _ = b_q.shape
        if K % _SG_ALIGN or N % _SG_ALIGN:
            return f"torch._scaled_grouped_mm needs K and N to be multiples of 16, got K={K}, N={N}"
        if a_q.stride(1) != 1 or a_q.stride(0) != K or b_q.stride(2) != 1 or b_q.stride(1) != K:
            return "a_q and b_q must be K-contiguous (row-major [M, K] and [G, N, K])"
        if a_q.data_ptr() % 16 or b_q.data_ptr() % 16:
            return "a_q and b_q must be 16-byte aligned"
        if group_offs is None or group_offs.device != a_q.device:
            return "group_offs on the operands' device is needed"
        if M == 0 or G == 0:
            return "empty problem (the TRITON backend handles it)"
        return None

    @classmethod
    def execute(cls, a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype, block_size=128,
                num_cu=None, **_) -> torch.Tensor:
        M = a_q.size(0)
        G, N, _ = b_q.shape
        sa = _expand_scale(a_scale, (M,))
        sb = _expand_scale(b_scale.reshape(G, -1) if b_scale.numel() != 1 else b_scale, (G, N))
        # offsets clamped to a's rows: an unchecked group_lens summing past them would send the vendor
        # kernel out of bounds (as in the 16-bit TORCH route, _vendor_offs)
        out = torch._scaled_grouped_mm(a_q, b_q.transpose(-2, -1), sa, sb, offs=_vendor_offs(group_offs, None, M),
                                       out_dtype=torch.bfloat16)
        if not out.is_contiguous():
            out = out.contiguous()
        return zero_tail_rows(out, group_offs)  # rows past offs[G] are left uninitialised


class GroupedGemmFP8TritonBackend(KernelBackend):
    """Persistent Triton kernel with a device-side tile schedule (grouped_gemm_fp8_kernel.py)."""

    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype, block_size=128,
              num_cu=None, **_) -> Optional[str]:
        try:
            from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import check_grouped_gemm_fp8_triton
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_grouped_gemm_fp8_triton(a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs,
                                             out_dtype=out_dtype, block_size=block_size)

    @classmethod
    def execute(cls, a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype, block_size=128,
                num_cu=None, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import grouped_gemm_fp8_triton

        return grouped_gemm_fp8_triton(a_q, a_scale, b_q, b_scale, _mode_name(mode), group_lens, group_offs,
                                       out_dtype=out_dtype, block_size=block_size, num_cu=num_cu, checked=True)


class GroupedGemmFP8GluonBackend(KernelBackend):
    """Warp-specialized Gluon kernel for Hopper (triton/grouped_gemm/grouped_gemm_fp8_gluon.py):
    M-grouped BLOCKWISE E4M3 x E4M3 (1x128 activation groups x 128x128 expert-weight blocks),
    the forward and the E4M3 dgrad; TENSORWISE / ROWWISE E4M3 on the same kernel with broadcast
    scales (``grouped_gemm_fp8_scaled_gluon``). The BLOCKWISE M-grouped default on sm_90 where it
    can run (``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON=0`` turns it off); the TENSORWISE / ROWWISE
    default wherever it can run (:func:`gluon_scaled_preferred`; ``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED``
    overrides it). A GLUON pin reaches it as
    well; the variable-K dispatcher's GLUON backend (the BLOCKWISE wgrad) raises on the rest. Not
    autotuned."""

    backend_type = BackendType.GLUON
    autotune = False

    @classmethod
    def check(cls, a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype, block_size=128,
              num_cu=None, **_) -> Optional[str]:
        mode = _mode_name(mode)
        if mode not in ("BLOCKWISE", "TENSORWISE", "ROWWISE"):
            return f"the Gluon grouped FP8 kernel serves BLOCKWISE, TENSORWISE and ROWWISE, not {mode}"
        for name, t in (("a_q", a_q), ("b_q", b_q)):
            if isinstance(t, torch.Tensor) and t.dtype != torch.float8_e4m3fn:
                return f"{name}.dtype={t.dtype}; the Gluon grouped FP8 kernel takes float8_e4m3fn only"
        if num_cu is not None and (not isinstance(num_cu, int) or num_cu < 1):
            return f"num_cu must be a positive int, got {num_cu!r}"
        if group_offs is None:
            G = b_q.size(0) if isinstance(b_q, torch.Tensor) and b_q.dim() == 3 else -1
            if not (isinstance(group_lens, torch.Tensor) and group_lens.dtype == torch.int64
                    and group_lens.dim() == 1 and group_lens.numel() == G and group_lens.device == a_q.device):
                return "group_offs, or group_lens int64 [G] on the operands' device, is needed"
        gluon = _gluon_grouped_module()
        if gluon is None:
            return "the Gluon grouped FP8 kernel is not importable"
        if mode != "BLOCKWISE":
            return gluon.gluon_grouped_scaled_reason(a_q, a_scale, b_q, b_scale, group_offs, mode, out_dtype)
        return gluon.gluon_grouped_blockwise_reason(a_q, a_scale, b_q, b_scale, group_offs, out_dtype, block_size)

    @classmethod
    def execute(cls, a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype, block_size=128,
                num_cu=None, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_gluon as gluon

        if group_offs is None:
            from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import group_offsets

            group_offs = group_offsets(group_lens)
        mode = _mode_name(mode)
        if mode != "BLOCKWISE":
            return gluon.grouped_gemm_fp8_scaled_gluon(a_q, a_scale, b_q, b_scale, group_offs, mode,
                                                       out_dtype=out_dtype, num_programs=num_cu, checked=True)
        return gluon.grouped_gemm_fp8_blockwise_gluon(a_q, a_scale, b_q, b_scale, group_offs, out_dtype=out_dtype,
                                                      num_programs=num_cu, checked=True)


_GLUON_GROUPED: list = []


def _gluon_grouped_module():
    """primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_gluon, or None where it cannot be imported."""
    if not _GLUON_GROUPED:
        try:
            from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_gluon as mod
        except ImportError:
            mod = None
        _GLUON_GROUPED.append(mod)
    return _GLUON_GROUPED[0]


def gluon_grouped_enabled() -> bool:
    """``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON``: False for 0, True for 1 and auto (auto: on, since the
    H200 run of 2026-11-30 measured it correct and 1.34-1.40x BF16 ``torch._grouped_mm``; the
    backend's own check still keeps it to sm_90 and the operands it accepts). Read per call."""
    flag = env_auto_flag("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON")
    return True if flag is None else flag


def gluon_grouped_scaled_enabled() -> Optional[bool]:
    """``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED``: whether the M-grouped TENSORWISE / ROWWISE
    default takes the Gluon kernel (the BLOCKWISE kernel with broadcast scales) where it can run,
    before ``torch._scaled_grouped_mm``: True for 1, False for 0, None for auto (the shape rule
    :func:`gluon_scaled_preferred` decides). Read per call."""
    return env_auto_flag("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED")


def gluon_scaled_preferred(G: int, K: int) -> bool:
    """The TENSORWISE / ROWWISE default's shape rule: the Gluon kernel for every shape (where its
    check passes; ``torch._scaled_grouped_mm`` is the fallback, and
    ``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED=0`` forces it).

    H200, 2026-12-04 (``benchmarks/bench_grouped_gemm.py --timing graph --fp8 TENSORWISE ROWWISE``,
    5 interleaved rounds, 36 balanced registry cases of DeepSeek-V3, Qwen3-235B-A22B and
    GPT-OSS-20B at 1024 / 4096 rows per expert): the Gluon kernel 1.04-3.27x the vendor op on every
    case, 1.04-1.36x the old default in the band it used to leave to the vendor op
    (``2048 < K < 8192`` with four experts or more: K 2880 / 4096 / 7168), where the vendor op also
    pays two to four small launches (int32 offsets, expanded scales, the zero tail). The band
    came from session 11's measurement (2026-12-01: 0.88-1.09x there), taken before session 20
    fixed the grouped kernels' tile deal (docs/design.md, "The tile deal": every group's tiles
    were dealt from program 0). ``G`` and ``K`` stay in the signature for callers that ask per
    shape."""
    del G, K
    return True


def _make_key(a_q, a_scale, b_q, b_scale, mode, group_lens, group_offs, out_dtype, block_size=128, num_cu=None,
              **_):
    return (a_q.size(0), b_q.size(1), a_q.size(1), b_q.size(0), a_q.dtype, b_q.dtype, out_dtype, _mode_name(mode),
            block_size, num_cu, a_q.device.type)


def _default_mgrouped(**kwargs) -> BackendType:
    """The M-grouped FP8 default, in one place. TENSORWISE / ROWWISE: the Gluon kernel where
    :func:`gluon_scaled_preferred` (or ``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED=1``) picks it and
    it can run (sm_90, E4M3; every shape since 2026-12-04), else the vendor kernel where it runs
    (E4M3, bf16 out, aligned: our Triton kernel reaches 0.73-1.00x of it on the H200 forward). BLOCKWISE: unless
    ``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON=0``, the Gluon kernel where its check passes (sm_90,
    E4M3, aligned rows). TRITON everywhere else. TORCH and GLUON are returned only after their own
    check said yes (``default_checked``)."""
    if _mode_name(kwargs.get("mode")) == "BLOCKWISE":
        if gluon_grouped_enabled() and GroupedGemmFP8GluonBackend.can_handle(**kwargs):
            return BackendType.GLUON
        return BackendType.TRITON
    flag = gluon_grouped_scaled_enabled()
    if flag is None:
        b_q = kwargs.get("b_q")
        flag = isinstance(b_q, torch.Tensor) and b_q.dim() == 3 and gluon_scaled_preferred(b_q.size(0), b_q.size(2))
    if flag and GroupedGemmFP8GluonBackend.can_handle(**kwargs):
        return BackendType.GLUON
    return BackendType.TORCH if GroupedGemmFP8TorchBackend.can_handle(**kwargs) else BackendType.TRITON


grouped_gemm_fp8_dispatcher = AutoKernelDispatcher(
    op_name="grouped_gemm_fp8",
    family="grouped_gemm",
    backends=[GroupedGemmFP8TritonBackend, GroupedGemmFP8TorchBackend, GroupedGemmFP8GluonBackend],
    make_key=_make_key,
    default=_default_mgrouped,
    default_checked=(BackendType.TORCH, BackendType.GLUON),
)


class GroupedGemmFP8VariableKTritonBackend(KernelBackend):
    backend_type = BackendType.TRITON

    @classmethod
    def check(cls, x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None, accumulate=False,
              out_dtype=torch.bfloat16, num_cu=None, block_size=128, **_) -> Optional[str]:
        try:
            from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import (
                check_grouped_gemm_fp8_variable_k_triton,
            )
        except ImportError as exc:
            return f"triton is not available ({exc})"
        return check_grouped_gemm_fp8_variable_k_triton(x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs,
                                                        out=out, accumulate=accumulate, out_dtype=out_dtype,
                                                        block_size=block_size)

    @classmethod
    def execute(cls, x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None, accumulate=False,
                out_dtype=torch.bfloat16, num_cu=None, block_size=128, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_kernel import grouped_gemm_fp8_variable_k_triton

        return grouped_gemm_fp8_variable_k_triton(
            x_t, x_scale, y_t, y_scale, _mode_name(mode), group_lens, group_offs, out=out, accumulate=accumulate,
            out_dtype=out_dtype, num_cu=num_cu, block_size=block_size, checked=True)


class GroupedGemmFP8VariableKTorchBackend(KernelBackend):
    """``torch._scaled_grouped_mm`` 2d-2d on a 16-aligned padded token layout (see the module docstring)."""

    backend_type = BackendType.TORCH

    @classmethod
    def check(cls, x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None, accumulate=False,
              out_dtype=torch.bfloat16, num_cu=None, **_) -> Optional[str]:
        mode = _mode_name(mode)
        reason = _scaled_grouped_mm_reason(x_t, mode, x_t.dtype, y_t.dtype)
        if reason is not None:
            return reason
        if num_cu is not None:
            return "num_cu (SM cap) is not supported by torch._scaled_grouped_mm"
        if x_t.dim() != 2 or y_t.dim() != 2 or x_t.size(1) != y_t.size(1) or y_t.device != x_t.device:
            return "x_t [P, M_total] and y_t [Q, M_total] on one device are needed"
        P, M = x_t.shape
        Q = y_t.size(0)
        if P % _SG_ALIGN or Q % _SG_ALIGN:
            return f"torch._scaled_grouped_mm needs P and Q to be multiples of 16, got P={P}, Q={Q}"
        if group_offs is None or group_offs.device != x_t.device:
            return "group_offs on the operands' device is needed"
        G = group_offs.numel() - 1
        if M == 0 or G == 0:
            return "empty problem (the TRITON backend handles it)"
        if accumulate and out is None:
            return "accumulate=True needs out"
        if out is None and out_dtype not in (torch.bfloat16, torch.float32):
            return f"out_dtype must be bfloat16 or float32 (from a bf16 result), got {out_dtype}"
        if out is not None and (out.dtype not in (torch.bfloat16, torch.float32) or tuple(out.shape) != (G, P, Q)
                                or out.device != x_t.device):
            return f"out must be a bfloat16 / float32 tensor of shape {(G, P, Q)} on {x_t.device}"
        return None

    @classmethod
    def execute(cls, x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None, accumulate=False,
                out_dtype=torch.bfloat16, num_cu=None, **_) -> torch.Tensor:
        P, M = x_t.shape
        Q = y_t.size(0)
        G = group_offs.numel() - 1
        # every group gets >= 16 (zero) columns: no empty contraction reaches the vendor kernel
        src, poffs = padded_group_layout(group_offs, M, _SG_ALIGN, nonempty=True)
        xp = gather_rows(x_t, src, dim=1).contiguous()  # [P, M_pad], row-major
        yp = gather_rows(y_t, src, dim=1).contiguous()  # [Q, M_pad]; its .t() is column-major
        # one scale per row of x_t / y_t for every group ([G * P] / [G * Q], group-major)
        sx = _expand_scale(x_scale, (P,)).repeat(G)
        sy = _expand_scale(y_scale, (Q,)).repeat(G)
        res = torch._scaled_grouped_mm(xp, yp.t(), sx, sy, offs=poffs[1:].to(torch.int32),
                                       out_dtype=torch.bfloat16)
        if out is None:
            return res if out_dtype == torch.bfloat16 else res.to(out_dtype)
        return out.add_(res) if accumulate else out.copy_(res)


class GroupedGemmFP8VariableKGluonBackend(KernelBackend):
    """Warp-specialized Gluon kernel for Hopper (triton/grouped_gemm/grouped_gemm_fp8_variable_k_gluon.py):
    the variable-K BLOCKWISE problem (1 x 128 token blocks, every group offset a multiple of 128,
    which the op's padded token layout guarantees), E4M3 or E5M2 operands (HYBRID's gradient
    included), bf16 / fp16 / fp32 output, accumulation into fp32 ``out`` (``main_grad``). The
    variable-K default on sm_90 unless ``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_WGRAD=0`` (H200,
    2026-11-30, ``scripts/check_gluon_fp8.py --grouped-wgrad``: 1.33x the TRITON kernel, 1.35x BF16
    ``torch._grouped_mm`` geomean over DeepSeek-V3 EP8 gate_up/down, balanced and unbalanced, bf16
    out and fp32 accumulation); TRITON wherever its check says no. Not autotuned."""

    backend_type = BackendType.GLUON
    autotune = False

    @classmethod
    def check(cls, x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None, accumulate=False,
              out_dtype=torch.bfloat16, num_cu=None, block_size=128, **_) -> Optional[str]:
        mode = _mode_name(mode)
        if mode != "BLOCKWISE":
            return f"the Gluon variable-K FP8 kernel is BLOCKWISE only, got {mode}"
        if num_cu is not None and (not isinstance(num_cu, int) or num_cu < 1):
            return f"num_cu must be a positive int, got {num_cu!r}"
        if group_offs is None:
            return "group_offs on the operands' device is needed (the op passes its padded layout's offsets)"
        try:
            from primus_turbo.triton.grouped_gemm import grouped_gemm_fp8_variable_k_gluon as vk
        except ImportError as exc:
            return f"the Gluon variable-K FP8 kernel is not importable ({exc})"
        return vk.gluon_variable_k_blockwise_reason(x_t, x_scale, y_t, y_scale, group_offs, out=out,
                                                    accumulate=accumulate, out_dtype=out_dtype,
                                                    block_size=block_size)

    @classmethod
    def execute(cls, x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None, accumulate=False,
                out_dtype=torch.bfloat16, num_cu=None, block_size=128, **_) -> torch.Tensor:
        from primus_turbo.triton.grouped_gemm.grouped_gemm_fp8_variable_k_gluon import (
            grouped_gemm_fp8_variable_k_blockwise_gluon,
        )

        return grouped_gemm_fp8_variable_k_blockwise_gluon(x_t, x_scale, y_t, y_scale, group_offs, out=out,
                                                           accumulate=accumulate, out_dtype=out_dtype,
                                                           num_programs=num_cu)


def gluon_grouped_wgrad_enabled() -> bool:
    """``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_WGRAD``: True for 1 and auto (on since the H200
    measurement), False for 0; the backend's own check still keeps it to sm_90 and the operands it
    accepts. Read per call."""
    return env_auto_flag("PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_WGRAD") is not False


def _default_vk(**kwargs) -> BackendType:
    """The variable-K FP8 default, in one place: unless ``PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_WGRAD=0``
    the Gluon kernel for BLOCKWISE where its check passes (sm_90, 128-token blocks, aligned rows,
    fp32 when accumulating); TRITON everywhere else (no padding copies, unlike TORCH). GLUON is
    returned only after its own check said yes (``default_checked``)."""
    if (_mode_name(kwargs.get("mode")) == "BLOCKWISE" and gluon_grouped_wgrad_enabled()
            and GroupedGemmFP8VariableKGluonBackend.can_handle(**kwargs)):
        return BackendType.GLUON
    return BackendType.TRITON


def _make_key_vk(x_t, x_scale, y_t, y_scale, mode, group_lens, group_offs, out=None, accumulate=False,
                 out_dtype=torch.bfloat16, num_cu=None, block_size=128, **_):
    return (x_t.size(1), x_t.size(0), y_t.size(0), group_offs.numel() - 1, x_t.dtype, y_t.dtype,
            None if out is None else out.dtype, out_dtype, _mode_name(mode), bool(accumulate), num_cu,
            block_size, x_t.device.type)


grouped_gemm_fp8_variable_k_dispatcher = AutoKernelDispatcher(
    op_name="grouped_gemm_fp8_variable_k",
    family="grouped_gemm",
    backends=[GroupedGemmFP8VariableKTritonBackend, GroupedGemmFP8VariableKTorchBackend,
              GroupedGemmFP8VariableKGluonBackend],
    make_key=_make_key_vk,
    default=_default_vk,
    default_checked=(BackendType.GLUON,),
    make_tune_kwargs=scratch_out_tune_kwargs,
)
