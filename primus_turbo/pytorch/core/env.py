"""Every ``PRIMUS_TURBO_*`` environment variable, read in one place.

Values are read when asked for (not cached at import) so tests and users can change them at run
time. docs/env_vars.md lists the same table for users.
"""

from __future__ import annotations

import os

__all__ = ["ENV_VARS", "env_raw", "env_str", "env_flag", "env_auto_flag"]

#: name -> (default, meaning). Kept in sync with docs/env_vars.md (a test checks this).
ENV_VARS: dict[str, tuple[str, str]] = {
    "PRIMUS_TURBO_LOG_LEVEL": ("WARNING", "Logger level: DEBUG, INFO, WARNING, ERROR."),
    "PRIMUS_TURBO_GEMM_BACKEND": (
        "",
        "GEMM backend: TORCH, TRITON, GLUON, autotune, or per precision as FP8:TRITON,BF16:TORCH "
        "(keys BF16/FP16/FP32 = BF16_FP16_FP32, FP8, FP4, other).",
    ),
    "PRIMUS_TURBO_GROUPED_GEMM_BACKEND": ("", "Grouped GEMM backend, same syntax as PRIMUS_TURBO_GEMM_BACKEND."),
    "PRIMUS_TURBO_ATTN_BACKEND": ("", "Attention backend, same syntax as PRIMUS_TURBO_GEMM_BACKEND."),
    "PRIMUS_TURBO_AUTO_TUNE": ("0", "1: time every eligible backend once per shape and cache the fastest."),
    "PRIMUS_TURBO_DIRECT_LAUNCH": (
        "1",
        "0: every Gluon kernel launch goes through Triton's own launch path instead of the cached C entry "
        "(primus_turbo/triton/launch.py; read at import).",
    ),
    "PRIMUS_TURBO_GEMM_TRITON_AUTOTUNE": (
        "1",
        "0: the Triton GEMM kernels (dense and grouped) use their analytic default configs instead of timing "
        "their candidate configs per shape.",
    ),
    "PRIMUS_TURBO_PERMUTE_FUSED_MAP": (
        "auto",
        "moe_permute's row map from three Triton kernels (1) or torch ops (0); auto: kernels on CPU "
        "(interpreter), torch ops on CUDA until the kernels are validated on the GPU.",
    ),
    "PRIMUS_TURBO_ATTN_FP8_BACKWARD": (
        "auto",
        "flash_attn_fp8_func backward: 1 FP8 kernels, 0 bf16 kernels on the dequantized FP8 q/k/v; auto: FP8 on "
        "CPU, bf16 on CUDA until the FP8 backward is validated on the GPU.",
    ),
    "PRIMUS_TURBO_ATTN_BWD_ATOMIC_DQ": (
        "auto",
        "Triton attention backward: 1 one kernel with fp32 atomic dQ accumulation (fp16/bf16), 0 the two-kernel "
        "backward; auto: two-kernel (the one-kernel backward measured 0.30-0.87x of it on the H200). "
        "deterministic=True and fp32 are always two-kernel.",
    ),
    "PRIMUS_TURBO_ATTN_FWD_GLUON": (
        "auto",
        "TRITON attention forward (flash_attn_func, fp16/bf16, head dims 64/128, no left window) on sm_90: 1 the "
        "warp-specialized Gluon kernel where it can run, 0 the Triton kernel; auto: Gluon where it was measured faster "
        "(head dim 128, except causal at <= 2048 queries; head dim 64 from 2048 queries, full and causal), Triton "
        "elsewhere.",
    ),
    "PRIMUS_TURBO_ATTN_VARLEN_GLUON": (
        "auto",
        "TRITON attention forward of flash_attn_varlen_func (packed THD; fp16/bf16, head dims 64/128, no left "
        "window) on sm_90: 1 the warp-specialized Gluon varlen kernel where it can run, 0 the Triton kernel; auto: "
        "Gluon on every pack at head dim 128 and where max_seqlen_q >= 2048 (a host int: no sync) at head dim 64, "
        "full and causal; Triton elsewhere. H200 (session 29, 16384-token packs, device time, Gluon / Triton): "
        "head dim 128 (32/8 heads) 1.11-1.39x on every pack, full and causal; head dim 64 (64/8 heads) 8 x 2048 "
        "1.12x full / 1.10x causal, 2048-64-64-64 1.05x / 0.98x, shorter documents 0.80-0.95x (Triton kept). No k/v "
        "row past a document's end is read (a document's last key block is loaded shifted back), so rows past "
        "cu_seqlens_k[-1] may hold NaN. The backward is the Triton varlen backward either way.",
    ),
    "PRIMUS_TURBO_ATTN_FP8_FWD_GLUON": (
        "auto",
        "flash_attn_fp8_func forward on sm_90 (head dims 64/128, no left window, seq_kv a multiple of 16, scale "
        "blocks of 64-256 tokens): 1 the warp-specialized Gluon FP8 kernel where it can run, 0 the Triton FP8 kernel; "
        "auto = 1 (H200, sessions 7 and 27-30: config n128s4kc2 at head dim 128, n128s4kc2lx3j (three consumer "
        "warpgroups, each stopping at its own rows' last key block, row sums reduced once) at 64, n64s4kc2jy2 (two "
        "CTAs per SM) at 64 causal up to 4096 keys; sessions 29-30, device time: 1.14-1.45x our bf16 Gluon forward "
        "at head dim 128, 1.15-1.34x at 64).",
    ),
    "PRIMUS_TURBO_ATTN_BWD_GLUON": (
        "auto",
        "TRITON attention backward (flash_attn_func, fp16/bf16, head dims 64/128, no left window) on sm_90: 1 the "
        "warp-specialized Gluon dK/dV (+ dQ) kernels where they can run, 0 the Triton kernels; auto: Gluon where "
        "measured faster (GQA; head dim 128 except causal at <= 2048 queries; head dim 64 from 8192 queries). No "
        "atomics: deterministic either way.",
    ),
    "PRIMUS_TURBO_ATTN_BWD_GLUON_DQ": (
        "auto",
        "Inside the Gluon attention backward (PRIMUS_TURBO_ATTN_BWD_GLUON=1): 1 / auto the Gluon dQ kernel, 0 the "
        "Triton dQ kernel next to the Gluon dK/dV kernel.",
    ),
    "PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON": (
        "auto",
        "M-grouped FP8 BLOCKWISE GEMM (grouped_gemm_fp8 forward and E4M3 dgrad) on sm_90: 1 / auto the Gluon "
        "kernel where it can run (H200: 1.34-1.40x BF16 torch._grouped_mm), 0 the Triton kernel.",
    ),
    "PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_SCALED": (
        "auto",
        "M-grouped FP8 TENSORWISE / ROWWISE GEMM (grouped_gemm_fp8 forward and E4M3 dgrad) on sm_90: 1 the Gluon "
        "kernel (the BLOCKWISE kernel with broadcast scales) where it can run, 0 torch._scaled_grouped_mm where it "
        "can run; auto: the Gluon kernel wherever it can run (H200 device time, 2026-12-04: 1.04-3.27x the vendor "
        "op on 36 registry cases, the old 2048 < K < 8192, G >= 4 band included).",
    ),
    "PRIMUS_TURBO_GEMM_FP8_GLUON_WGRAD": (
        "auto",
        "FP8 BLOCKWISE GEMMs with per-row B scales (the FP8 linear's wgrad, 1x128 x 1x128, no accumulation) on "
        "sm_90: 1 / auto the Gluon kernel's B_ROW_SCALES path where it can run them (H200: FP8 linear step "
        "16.24 -> 13.53 ms), 0 the Triton kernel.",
    ),
    "PRIMUS_TURBO_GROUPED_GEMM_FP8_GLUON_WGRAD": (
        "auto",
        "Variable-K grouped FP8 BLOCKWISE GEMM (the grad_weight of grouped_gemm_fp8, fused main_grad accumulation "
        "included) on sm_90: 1 / auto the Gluon kernel where it can run (H200: 1.33x the Triton kernel), 0 the "
        "Triton kernel.",
    ),
    "PRIMUS_TURBO_GROUPED_GEMM_GLUON": (
        "auto",
        "TRITON backend of grouped_gemm (bf16 / fp16: forward, dgrad, wgrad with fp32 main_grad accumulation) on "
        "sm_90: 1 / auto the Gluon kernels where they can run (TMA-aligned rows, K- or N-contiguous weights, P a "
        "multiple of 64 for the wgrad), 0 the Triton kernels.",
    ),
    "PRIMUS_TURBO_FP8_WEIGHT_ONE_READ": (
        "auto",
        "grouped_gemm_fp8 BLOCKWISE expert weights: 1 / auto the forward copy and the transposed grad_input copy "
        "in one launch where the kernel can (128 x 128 blocks, rows per expert % 4 == 0), 0 quantize then "
        "byte-transpose the codes.",
    ),
    "PRIMUS_TURBO_FP8_WEIGHT_GLUON": (
        "auto",
        "The one-launch BLOCKWISE expert-weight copies (PRIMUS_TURBO_FP8_WEIGHT_ONE_READ) on sm_90: 1 / auto the "
        "Gluon kernel (one read of each tile, no shared-memory transpose; the same bytes) where it runs, 0 the "
        "Triton kernel.",
    ),
    "PRIMUS_TURBO_FP4_GLUON": (
        "auto",
        "quantize_fp4_with_trans of bf16 on sm_90: 1 / auto the Gluon kernel (both copies' codes from one "
        "per-thread PTX program; the same bytes) where the shape fits its 64 x 128 tile, 0 the tl pair kernel.",
    ),
    "PRIMUS_TURBO_ROUTER_GEMM_FUSED": (
        "1",
        "router_gating_linear (the fp32 router of MoELayer over bf16 tokens): 1 the fused Triton kernels (bf16 "
        "tensor cores on three-way bf16 splits of the fp32 operands, no fp32 copy of the tokens), 0 the PyTorch "
        "expression (x.float() @ W^T and fp32 backward GEMMs).",
    ),
    "PRIMUS_TURBO_GROUPED_GEMM_GLU_FUSED": (
        "auto",
        "grouped_gemm_glu (GroupedMLP's fc1 + SwiGLU / GeGLU with probs, bf16 / fp16): auto the fused Gluon kernel "
        "(the activation in the GEMM's epilogue) on sm_90 where the 16-bit grouped default runs the GEMM on Gluon "
        "(gluon16_preferred) and the kernel can run it, else grouped_gemm then the activation kernel; 1 the fused "
        "kernel wherever it can run; 0 never.",
    ),
    "PRIMUS_TURBO_GROUPED_GEMM_PACE": (
        "0",
        "Experimental pacing of the 16-bit M-grouped Gluon kernel's persistent programs: 0 off; 1-8 the default "
        "config paces at that distance (a program waits before its j-th tile until all have started their "
        "(j - D)-th; bounded waits). Explicit p<D> configs run whatever it says.",
    ),
    "PRIMUS_TURBO_GATHER_QUANT_GLUON": (
        "auto",
        "grouped_gemm_fp8 BLOCKWISE wgrad token copies (gather + 128 x 1 quantization + transposed store, "
        "gather_quant_cols_t_launch) on sm_90: 1 / auto the Gluon kernel (no cross-warp reduction, no "
        "shared-memory transpose; the same bytes) where it runs, 0 the Triton kernel.",
    ),
    "PRIMUS_TURBO_PRINT_CONFIGS": ("0", "1: log the kernel config chosen for each new shape (INFO level)."),
}


# CPython's environ keeps its values in ``_data`` under encoded keys; ``os.environ.get`` goes through
# Mapping.get, the key's encoding and the value's decoding (~1-3 us a read on the H200 machine's host)
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_ENCODE = getattr(os.environ, "encodekey", None)
_ENV_KEYS: dict = {}


def env_raw(name: str):
    """The current raw value of environment variable ``name`` (None when unset), for cache keys
    that must follow run-time changes (the dispatchers' settings check, which runs on every call):
    the environ mapping's own storage where CPython has one (bytes on POSIX), else
    ``os.environ.get``. Reflects ``os.environ`` assignments and deletions (not bare ``os.putenv``,
    which ``os.environ`` does not see either)."""
    if _ENV_DATA is None or _ENV_ENCODE is None:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = _ENV_ENCODE(name)
    return _ENV_DATA.get(key)


def env_str(name: str) -> str:
    if name not in ENV_VARS:
        raise KeyError(f"unknown primus-turbo environment variable {name!r}")
    return os.environ.get(name, ENV_VARS[name][0]).strip()


def env_flag(name: str) -> bool:
    return env_str(name).lower() in ("1", "true", "yes", "on")


def env_auto_flag(name: str) -> "bool | None":
    """A switch with an ``auto`` default: True / False when set to an on / off value, None for
    ``auto`` (the caller decides). Anything else raises ValueError naming the value."""
    v = env_str(name).lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    if v in ("", "auto"):
        return None
    raise ValueError(f"{name}={v!r}: expected auto, 1/true/yes/on or 0/false/no/off")
