"""Hopper (sm_90) Gluon FP8 (E4M3) attention forward, warp-specialized.

Same contract as ``flash_attn_fp8.py``'s :func:`flash_attn_fp8_fwd_triton` for the cases it takes:
it reads :func:`quantize_tokens_fp8`'s outputs (``q8 [B, Hq, Sq, D]``, ``k8 [B, Hk, Sk, D]``,
``v8t [B, Hk, D, Sk]`` E4M3, one fp32 power-of-two multiplier per ``(batch, head, BLK tokens)``)
and returns ``O [B, Sq, Hq, D]`` in bf16/fp16 and ``LSE [B, Hq, Sq]`` fp32 (natural log, ``+inf``
for a row that sees no key and has no sink), so the FP8 (or bf16) backward runs on the tensors
the op saves, unchanged. The numerics are the tl kernel's:

* ``S = Q8 K8^T`` is an FP8 wgmma (fp32 accumulation); the row maximum is taken on the raw
  scores and ``rs = q_scale_row * k_scale_block * softmax_scale * log2(e)`` is applied in the
  exponent's FMA (``exp2(s * rs - m)``), as the tl kernel does;
* ``P = exp2(...)`` in ``[0, 1]`` is quantized to E4M3 at the static scale 256 (``FP8_ATTN_P_SCALE``,
  folded into the exponent: ``exp2(s * rs - (m - 8))``), round to nearest even; the row sum
  ``l`` uses the fp32 P (kept in units of 256, an exact power of two);
* ``O += P8 V8`` is an FP8 wgmma with P from registers (the A operand) and ``V^T`` (keys
  contiguous: the op already keeps V transposed for the tl kernel, so both FP8 operands are
  K-major as Hopper's FP8 wgmma requires) from shared memory. V's scale is one power of two per
  key block, and wgmma accumulates into O in place, so O is kept in units of the current block's V
  scale: before block j's PV, O is multiplied by ``alpha_j * vs_{j-1} / vs_j`` (the ratio is an
  exact power of two, fused into the softmax rescale, no extra pass); the epilogue multiplies by
  the last block's scale. This equals the tl kernel's ``acc * alpha + (P8 V8) * vs`` up to the
  MMA's own rounding; it could only overflow if one head's V block scales spanned more than about
  2**90.

Schedule: the bf16 Gluon forward's (``flash_attn_fwd_gluon.py``, whose producer, tile and
softmax helpers this file reuses): one TMA producer warp fills Q once and a STAGES-deep K / V ring
(4-D descriptors: Q / K over ``[B, S, H, D]`` views of the bhsd copies, V^T over a
``[B, D, H, S]`` view, keys as the box's inner dimension), two (or, config ``x3``, three)
consumer warpgroups of 64 query rows each issue ``S_j`` and ``P_{j-1} V_{j-1}`` back to back and
run the softmax of ``S_j`` while the PV MMA is in flight; causal tiles skip the blocks past the
diagonal and only the diagonal blocks run the mask. FP8 Q is half the size of the O tile, so O is
staged in its own shared buffer for the TMA store (the bf16 kernel reuses Q's).

:func:`gluon_attn_fp8_fwd_reason` refuses what the kernel does not take (head dims other than
64 / 128 or unequal, left windows, negative scales, scale blocks of 32 tokens, ``seq_kv`` not a
multiple of 16: the rows of ``v8t`` must be 16-byte aligned for TMA) and the op runs the tl kernel
instead. ``PRIMUS_TURBO_ATTN_FP8_FWD_GLUON`` switches it (auto: on, since the H200 measurements).
The default config depends on the head dim, causality and key count (:func:`default_attn_fp8_config`):
three consumer warpgroups at head dim 64 (two CTAs of two warpgroups per SM for causal with at most
4096 keys, config ``y2``), two at 128, there with persistent CTAs (config ``t``, :func:`_ptile`,
:func:`_snake_tile`) on full rows and causal ones up to 8192 keys, with two Q buffers (``q``) on full
rows and causal ones up to 4096 keys.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Optional

import torch

from primus_turbo.triton.launch import launch

from .flash_attn_fwd_gluon import (
    GLUON_AVAILABLE,
    HALF_M,
    HEAD_DIMS,
    LOG2E,
    SMEM_LIMIT,
    GluonAttnConfig,
    _device_reason,
    _outputs,
    _tma_strides,
)

__all__ = [
    "GLUON_ATTN_FP8_ENV",
    "SMEM_LIMIT",
    "GluonAttnFp8Config",
    "default_attn_fp8_config",
    "flash_attn_fp8_fwd_gluon",
    "gluon_attn_fp8_fwd_reason",
    "gluon_attn_fp8_operand_reason",
    "use_gluon_attn_fp8_fwd",
]

GLUON_ATTN_FP8_ENV = "PRIMUS_TURBO_ATTN_FP8_FWD_GLUON"
#: = flash_attn_fp8.FP8_ATTN_P_SCALE (not imported: that module imports triton.language kernels)
P_SCALE = 256.0
_OUT_DTYPES = (torch.bfloat16, torch.float16)
#: GluonAttnFp8Config.parse's grammar; ``{u}``: where the removed flag ``u`` stood ("" to parse,
#: "u" to recognize an old config string and name the flag in the error)
#: shared memory of one sm_90 SM (228 KB); each resident CTA also takes 1 KB of it for the system
SM_SMEM_BYTES = 233472

_CONFIG_RE = r"n(\d+)s(\d+)(p)?(o)?(k)?(?:c(\d+))?(l)?(g)?{u}(t)?(q)?(?:x(\d+))?(j)?(?:y(\d+))?(?:e(\d+)(?:d(\d+))?)?(?:r(\d+))?(?:w(\d+))?"

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .flash_attn_fwd_gluon import (_exp2_mixed, _own_blocks, _pass_turn, _producer, _release_blocks, _rescale,
                                       _take_turn, _tile)


@dataclasses.dataclass(frozen=True)
class GluonAttnFp8Config(GluonAttnConfig):
    """The bf16 forward's config (``n128s4``, ``p`` for ping-pong, ``r``/``w`` registers); the
    shared-memory budget differs: 1-byte Q / K / V tiles plus a separate 16-bit O staging tile.
    ``o`` (the bf16 kernel's opt-in overlap) is refused: this kernel always has that wait.

    Opt-in FP8-only flags (suffixes after ``p``, before ``r``/``w``; off = the shipped kernel):

    * ``k`` (``kperm``): K tiles are loaded through a 5-D TMA descriptor that permutes the keys
      inside each 32-key group so that the S accumulator fragment *is*, register for register, the
      A-operand fragment of the P V wgmma (see :func:`_kperm_keys`): P goes fp32 -> E4M3 pairs and
      into the MMA without the cross-lane shuffles and byte permutes of the layout conversion.
      Needs a contiguous ``k8`` (the op's quantizer writes one);
    * ``e<N>`` (``emu``, N in 2, 4, 8): 1/N of the exponentials of the full (unmasked) key blocks
      run on the FMA pipe (Cody-Waite range reduction + a polynomial, :func:`_exp2_fma`) instead of
      MUFU.EX2; ``d<deg>`` (``emu_deg``, 2..5, default 3) is the polynomial degree (max relative
      error 1.7e-3 / 7.5e-5 / 2.7e-6 / 2e-7 for 2 / 3 / 4 / 5; P is rounded to E4M3, 2**-4
      relative, right after). Masked (diagonal / tail) blocks always use MUFU.EX2;
    * ``c<T>`` (``lazy``, T in 1..4): conditional rescaling of O. A row's reference maximum moves
      only when the row maximum exceeds it by more than T (log2 units), and a warp skips the O
      rescale (one FMUL per accumulator element) when none of its rows moved and V's block scale
      did not change. P is kept in units of ``2**(8 - T)`` instead of 256 so that P <= 256 still
      holds against a stale reference (E4M3 max 448); O / l and LSE are invariant to the reference
      (exact), only P's rounding points move (E4M3's relative step is the same);
    * ``l`` (``lsum``): the row sum ``l`` stays a per-thread partial (one per lane of the quad that
      shares a row) through the key loop and is reduced across the quad once, in the epilogue:
      no shuffles and no cross-lane adds per key block (the reduction order changes, nothing
      else);
    * ``g`` (``heads_first``, with ``k``): grid ``(B * H, query tiles)`` instead of ``(query tiles,
      B * H)``: the CTAs in flight are one query tile of many heads, and causal runs the longest
      tiles of every head first (the shortest ones fill the last wave) instead of per head;
    * ``t`` (``persistent``, with ``k``; not with ``p`` or ``g``): one CTA per SM, each looping over
      one tile per round of ``num_programs`` tiles, in program order in even rounds and reversed
      in odd ones (:func:`_snake_tile`; query tiles fastest, causal heads longest first, so the
      reversal balances the CTAs' causal key blocks) with the K / V ring running on across them.
      A tile's Q is reloaded once every consumer warpgroup has retired the previous tile's last S
      MMA, so the next tile's Q and first K / V blocks load under the previous tile's last PV MMA
      and epilogue: the per-tile start-up that a short sequence pays once per 32 key blocks is
      hidden;
    * ``q`` (``q_double``, after ``t``): two Q buffers (and barrier pairs) for the persistent CTAs, so
      the producer loads tile n + 1's Q, and then its first K / V blocks, while tile n runs, instead of
      waiting for every warpgroup to retire tile n's last S MMA; one more Q tile of shared memory
      (a default where :func:`default_attn_fp8_config` makes the CTAs persistent, causal rows past
      :data:`Q2_D128_CAUSAL_MAX_SEQ_K` keys excepted);
    * ``x<W>`` (``consumers``): 2 (default) or 3 consumer warpgroups (192-row tiles);
    * ``y2`` (``ctas_per_sm``, after ``j``): the launch caps registers so that two CTAs share each SM
      (``maxnreg`` = 65536 / (2 x the CTA's threads), rounded down to 8; the consumers' default
      budget is what is left of the CTA's half after the producer's): one CTA's start-up (Q and first
      K / V loads, the unoverlapped first softmax) and epilogue run under the other's key loop. Two
      consumer warpgroups at head dim 64 with 64-key tiles fit (104 registers, 57 KB);
    * ``j`` (``skip``, after ``x``): each warpgroup computes only the key blocks its own rows see and
      releases the rest of the tile's ring slots unread (the bf16 forward's ``j``: a causal 192-row
      tile's lower warpgroups, and a warpgroup whose rows all lie past seq_q).

    The former flag ``u`` (row sums by a wgmma of P8 against a shared tile of E4M3 ones) is gone:
    its output was wrong on the H200 (session 7: -0.08 dB full, 0.4 dB causal against fp32);
    :meth:`parse` refuses it by name."""

    kperm: bool = False
    emu: int = 0
    emu_deg: int = 3
    lazy: int = 0
    lsum: bool = False
    heads_first: bool = False
    persistent: bool = False
    ctas_per_sm: int = 1
    q_double: bool = False

    def p_log2(self) -> float:
        """log2 of the static P scale (8, i.e. 256, less the ``c<T>`` threshold)."""
        return float(math.log2(P_SCALE)) - self.lazy

    def smem_bytes(self, head_dim: int, elem_bytes: int = 1) -> int:
        q = (2 if self.q_double else 1) * self.BLOCK_M * head_dim * elem_bytes
        kv = 2 * self.stages * self.block_n * head_dim * elem_bytes
        o = self.BLOCK_M * head_dim * 2
        barriers = 8 * (2 * 2 * self.stages + 3 + (2 if self.q_double else 0))
        return q + kv + o + barriers + 1024  # + the swizzle alignment

    def short(self) -> str:
        flags = ("p" if self.pingpong else "") + ("o" if self.overlap else "") + ("k" if self.kperm else "")
        flags += (f"c{self.lazy}" if self.lazy else "") + ("l" if self.lsum else "") + ("g" if self.heads_first else "")
        flags += ("t" if self.persistent else "") + ("q" if self.q_double else "")
        flags += f"x{self.consumers}" if self.consumers != 2 else ""
        flags += "j" if self.skip else ""
        flags += f"y{self.ctas_per_sm}" if self.ctas_per_sm != 1 else ""
        if self.emu:
            flags += f"e{self.emu}" + (f"d{self.emu_deg}" if self.emu_deg != 3 else "")
        return f"n{self.block_n}s{self.stages}{flags}r{self.consumer_regs}w{self.producer_regs}"

    @classmethod
    def parse(cls, text: str) -> "GluonAttnFp8Config":
        """``"n128s4"``, ``"n128s4p"``, ``"n128s4k"``, ``"n128s4ke2"``, ``"n128s4kc2"``, ``"n128s4pke4d2"``,
        ``"n128s4kc2x3"``, ``"n64s6r232w40"`` -> config (n: block_n, s: stages, p: ping-pong, k: key-permuted
        K load, c<T>: conditional O rescale with threshold T, l: row sums reduced once, g: heads-fastest
        grid, t: persistent CTAs, x<W>: consumer warpgroups (2, the default, or 3: 192-row tiles,
        consumer registers then 160 by default), j: per-warpgroup key extent, y2: two CTAs per SM,
        e<N>: 1/N of the exponentials on the FMA pipe, d<deg>: its polynomial degree, r / w: consumer /
        producer registers per thread). The removed flag ``u`` is refused by name."""
        m = re.fullmatch(_CONFIG_RE.format(u=""), text.strip())
        if not m:
            if re.fullmatch(_CONFIG_RE.format(u="u"), text.strip()):
                raise ValueError(f"Gluon FP8 attention config {text!r}: flag u (row sums by the MMA) was removed "
                                 f"(its output was wrong on the H200); drop the u")
            raise ValueError(f"bad Gluon FP8 attention config {text!r}; expected e.g. n128s4, n128s3p, n128s4k, "
                             f"n128s4ke2, n128s4kc2, n128s4pke4d2, n64s6r232w40")
        bn, st, pp, ov, kp, lz, ls, hf, pt, q2, x, sk, y, emu, deg, r, w = m.groups()
        wgs, ctas, prod = int(x or 2), int(y or 1), int(w or 24)
        if r:
            regs = int(r)
        elif ctas > 1:  # what the CTA's share of the register file leaves the consumers
            regs = (cls.register_pool(wgs, ctas) - 128 * prod) // (wgs * 128) // 8 * 8
        else:
            regs = 240 if wgs == 2 else 160
        return cls(int(bn), int(st), regs, prod, bool(pp), bool(ov),
                   consumers=wgs, kperm=bool(kp), emu=int(emu or 0), emu_deg=int(deg or 3), lazy=int(lz or 0),
                   lsum=bool(ls), heads_first=bool(hf), persistent=bool(pt), skip=bool(sk), ctas_per_sm=ctas,
                   q_double=bool(q2))

    @staticmethod
    def launch_maxnreg(consumers: int, ctas_per_sm: int) -> int:
        """Registers per thread at launch for ``ctas_per_sm`` CTAs of ``consumers`` warpgroups plus the
        producer's warpgroup on one SM (multiples of 8; the warp-specialized partitions then share
        that pool through setmaxnreg)."""
        return 65536 // (ctas_per_sm * (consumers + 1) * 128) // 8 * 8

    def launch_options(self) -> dict:
        """Compile options the launch adds for this config: y2's register cap (:meth:`launch_maxnreg`),
        nothing otherwise."""
        return {"maxnreg": self.launch_maxnreg(self.consumers, self.ctas_per_sm)} if self.ctas_per_sm > 1 else {}

    @classmethod
    def register_pool(cls, consumers: int, ctas_per_sm: int) -> int:
        """Registers of one CTA at :meth:`launch_maxnreg` (what setmaxnreg redistributes)."""
        return cls.launch_maxnreg(consumers, ctas_per_sm) * (consumers + 1) * 128

    def check(self, head_dim: int) -> Optional[str]:
        if self.overlap:
            return "config suffix o: the FP8 forward always keeps the softmax under the PV MMA (no option)"
        if self.heads_first and not self.kperm:
            return "g (heads-fastest grid) needs k (the key-permuted producer reads the swapped grid)"
        if self.persistent and (not self.kperm or self.pingpong or self.heads_first):
            return "t (persistent CTAs) needs k and takes neither p (ping-pong) nor g (its own tile order)"
        if self.q_double and not self.persistent:
            return "q (two Q buffers) needs t (persistent CTAs: the next tile's Q loads under the current one)"
        if not 0 <= self.lazy <= 4:
            return f"c{self.lazy}: the conditional-rescale threshold is 1 to 4 (log2 units)"
        if self.emu not in (0, 2, 4, 8):
            return f"e{self.emu}: the emulated fraction of the exponentials is 1/2, 1/4 or 1/8 (e2, e4, e8)"
        if not 2 <= self.emu_deg <= 5:
            return f"d{self.emu_deg}: the exp2 polynomial degree is 2 to 5"
        if self.emu and self.block_n < 4 * self.emu:
            return f"e{self.emu} needs block_n >= {4 * self.emu}"
        if self.ctas_per_sm not in (1, 2):
            return f"y{self.ctas_per_sm}: CTAs per SM is 1 or 2"
        if self.ctas_per_sm > 1:
            pool = self.register_pool(self.consumers, self.ctas_per_sm)
            need = self.consumers * 128 * self.consumer_regs + 128 * self.producer_regs
            if need > pool:
                return (f"y{self.ctas_per_sm}: registers {self.consumers} x 128 x {self.consumer_regs} + 128 x "
                        f"{self.producer_regs} > the CTA's {pool}")
            if self.persistent:
                return "y2 (two CTAs per SM) does not take t (one persistent CTA per SM)"
            # the 128-key S fragment alone is 64 of the ~104 registers a consumer has there
            if self.block_n != 64 or self.consumers != 2:
                return "y2 (two CTAs per SM) takes two consumer warpgroups and the 64-key tile (n64) only"
            if self.ctas_per_sm * (self.smem_bytes(head_dim) + 1024) > SM_SMEM_BYTES:
                return (f"y{self.ctas_per_sm}: {self.ctas_per_sm} x {self.smem_bytes(head_dim)} bytes of shared "
                        f"memory do not fit one SM at D={head_dim}")
        return super().check(head_dim)


#: per (head dim, causal). H200, scripts/check_gluon_attn_fp8.py --compare (32 heads, 16k tokens;
#: TFLOP/s, ratio to our bf16 Gluon forward in the same run). Session 7, n128s4k vs n128s4kc2
#: (conditional O rescale, threshold 2):
#:   D=128 full   S=4096 : bf16 578, k 728 (1.26x), kc2 736 (1.27x)
#:   D=128 full   S=16384: bf16 614, k 774 (1.26x), kc2 823 (1.34x)
#:   D=128 causal S=4096 : bf16 526, k 553 (1.05x), kc2 580 (1.10x)
#:   D=128 causal S=16384: bf16 627, k 711 (1.13x), kc2 805 (1.28x)
#: kc2's accuracy (B=2, seq 1008, vs fp32) 31.8-34.1 dB, as k's. Session 27
#: (benchmarks/results/h200/session27/, calls 1-4), three consumer warpgroups (x3: 192-row tiles,
#: 160 registers each): a third instruction stream hides the softmax's latency, which bounds the
#: two-warpgroup kernel at head dim 64 (each key block has half the MMA work of head dim 128).
#: Call 3 (three interleaved rounds), kc2 (two warpgroups) vs kc2x3, ratio to our bf16 Gluon forward:
#:   D=64  full   S=4096 : bf16 363, kc2 398 (1.10x), kc2x3 464 (1.28x)
#:   D=64  full   S=16384: bf16 415, kc2 496 (1.20x), kc2x3 608 (1.47x)
#:   D=64  causal S=4096 : bf16 315, kc2 326 (1.03x), kc2x3 339 (1.08x)
#:   D=64  causal S=16384: bf16 404, kc2 451 (1.11x), kc2x3 498 (1.23x)
#: At head dim 128 three warpgroups need the 64-key tile (n128 spills at 160 registers):
#: n64s6kc2x3 measured as n128s4kc2 on full rows (1.11 / 1.39x vs 1.11 / 1.38x) and below it on
#: causal ones (1.02 / 1.22x vs 1.08 / 1.27x), so head dim 128 keeps two warpgroups.
#: Call 5, persistent CTAs (t) at head dim 128: full 725 vs 674 TFLOP/s at S=4096 (1.19x vs 1.10x
#: our bf16 forward; a CTA's start-up, paid once per 32 key blocks there, now under the previous
#: tile's tail), 810 vs 796 at 16384; causal 518 vs 526 (4096) and 759 vs 726 (16384). Call 6 read
#: the other way (full 694 vs 713 at 4096, 793 vs 813 at 16384), and the same kernel timed twice in
#: one run differs by up to 8.6% (causal 16384: 732 vs 795): within that spread, so t stayed opt-in
#: (its causal tiles were dealt round-robin then; see PERSIST_D128_MAX_SEQ_K for session 31).
#: At head dim 64, t with two warpgroups lost to x3 (436 vs 485) and t with x3 spills (1.09x / 0.67x).
#: Session 29 (benchmarks/results/h200/session29/compare_fp8j_graph_call6.log, device time, 5 rounds):
#: ``j`` (each warpgroup stops at its own rows' last key block) at head dim 64, kc2x3j vs kc2x3:
#: full 578 / 648 vs 570 / 653 TFLOP/s at S=4096 / 16384, causal 454 / 596 vs 427 / 597: the default
#: at head dim 64 with 128-key tiles (the 64-key tile of 64-token scale blocks keeps the config
#: without it, which is the one run on the GPU there).
#: Session 30 (benchmarks/results/h200/session30/, device time, 5 and 7 rounds in two calls): ``l``
#: (row sums as per-lane partials, reduced once) at head dim 64, kc2lx3j vs kc2x3j, ms at S=4096 /
#: 16384: full 0.956 / 3.359 vs 0.950 / 3.386 and 0.958 / 3.392 vs 0.961 / 3.404, causal 0.596 / 1.784
#: vs 0.605 / 1.842 and 0.596 / 1.792 vs 0.607 / 1.849: the head-dim-64 default (geomean 1.245 / 1.251x
#: our bf16 forward against 1.230 / 1.234x). At head dim 128 ``l`` lost (1.317 vs 1.370x), and so did
#: ``t`` (persistent: 1.345 vs 1.374x; it led only at full S=4096) and ``e8`` (1.334x). Four
#: consumer warpgroups (256-row tiles, 64-key blocks, 112 registers; tried and removed) gave 1.18x at
#: head dim 64 (causal S=4096 0.589 ms; y2 below does better there), ``tx3j`` 0.90x.
#: FP8 tiles are half the bf16 ones, so the ring is deeper for the same shared memory: D=128
#: n128s4 is 16 KB Q + 4 x 32 KB K/V + 32 KB O. A non-contiguous k8 cannot take ``k``: the op then
#: runs the tl FP8 kernel (gluon_attn_fp8_fwd_reason names why).
_DEFAULT_CONFIGS = {(64, False): GluonAttnFp8Config(block_n=128, stages=4, consumer_regs=160, consumers=3, kperm=True,
                                                    lazy=2, lsum=True, skip=True),
                    (64, True): GluonAttnFp8Config(block_n=128, stages=4, consumer_regs=160, consumers=3, kperm=True,
                                                   lazy=2, lsum=True, skip=True),
                    (128, False): GluonAttnFp8Config(block_n=128, stages=4, kperm=True, lazy=2),
                    (128, True): GluonAttnFp8Config(block_n=128, stages=4, kperm=True, lazy=2)}
_Y2_CAUSAL_D64 = GluonAttnFp8Config.parse("n64s4kc2jy2")


#: head dim 64, causal, at most this many keys: two CTAs per SM (``n64s4kc2jy2``). A short causal
#: tile has few key blocks, so its start-up and epilogue weigh more, and a second CTA on the SM runs
#: its key loop under them. H200, session 30 call 3 (device time, 5 rounds, 32 heads, 16k tokens):
#: causal S=4096 0.571 ms against the default's 0.604 (every round: 0.563-0.573 vs 0.594-0.617);
#: causal S=16384 2.056 vs 1.804 and full S=4096 1.008 vs 0.975, where the three-warpgroup
#: default keeps the lead.
Y2_CAUSAL_MAX_SEQ_K = 4096

#: head dim 128, at most this many keys (full, causal): persistent CTAs (``t``). A CTA's start-up
#: and epilogue (Q and the first K / V loads, the peeled first block, the O store) cost about 3.8
#: key blocks' time per tile at head dim 128 (fitted from the sequence scan at fixed tokens, session
#: 31 call 1: 636 / 726 / 790 / 839 / 866 TFLOP/s at S = 1k / 2k / 4k / 8k / 16k); a persistent CTA
#: runs them under the previous tile's last blocks. Before session 31 the persistent tiles went
#: round-robin, which gave causal CTAs 12-34% more key blocks than the mean, so ``t`` lost on causal
#: rows; with the reversed odd rounds (:func:`_snake_tile`), H200 session 31 call 2 (device time, 3
#: rounds, 32 heads, 16k tokens), t vs the non-persistent config, TFLOP/s at S = 1k / 2k / 4k / 8k /
#: 16k: full 725 / 811 / 837 / 833 / 850 vs 611 / 724 / 791 / 846 / 864, causal 473 / 648 / 748 /
#: 801 / 828 vs 415 / 573 / 674 / 771 / 843 (call 1, full, the same code: 754 / 798 / 828 / 827 /
#: 845 vs 636 / 726 / 790 / 839 / 866). At head dim 64 the three-warpgroup default keeps the lead
#: over every persistent form from 4k keys (t with three warpgroups spills at 160 registers).
#: Session 32 (device time, 3 rounds each, 32 heads, 16k tokens) added two Q buffers (``q``: the next
#: tile's Q loads under the current tile) and, on full rows, per-lane row sums (``l``). Call 1,
#: TFLOP/s at S = 1k / 4k / 16k: full ``ltq`` 784 / 857 / 853 against ``t``'s 748 / 814 / 830 and the
#: non-persistent default's 747 / 810 / 840; causal ``tq`` 493 / 759 / 818 against ``t``'s 471 / 747 /
#: 812 and the non-persistent 472 / 742 (then t) / 831. Call 2, S = 8k / 16k: full ``ltq`` 892 / 891
#: against the non-persistent 848 / 862; causal ``tq`` 759 / 830 against 806 / 847. Call 3, causal
#: S = 8k, 5 rounds: ``t`` 803, non-persistent 790, ``tq`` 772 (session 31: ``t`` 801 vs 771). So full
#: rows are persistent at every length (None: no bound) with ``ltq``; causal rows take ``tq`` up to
#: :data:`Q2_D128_CAUSAL_MAX_SEQ_K` keys and ``t`` up to 8192.
PERSIST_D128_MAX_SEQ_K = {False: None, True: 8192}
Q2_D128_CAUSAL_MAX_SEQ_K = 4096
#: persistent, two warpgroups, two Q buffers, per-lane row sums: the full-row persistent default at
#: both head dims
_LTQ = GluonAttnFp8Config.parse("n128s4kc2ltq")
_PERSIST_D128 = {False: _LTQ, True: GluonAttnFp8Config.parse("n128s4kc2tq")}

#: head dim 64, full, at most this many keys: persistent CTAs of two warpgroups with per-lane row
#: sums and two Q buffers (``n128s4kc2ltq``). H200 session 31 (device time, 32 heads, 16k tokens,
#: two calls), ``lt``: S=1024 453 / 452 TFLOP/s against the three-warpgroup default's 403 / 401;
#: S=2048 505 vs 496, S=4096 535 / 522 vs 570 / 569 (the default keeps those). Session 32 (3 rounds):
#: S=1024 ``ltq`` 464 / 463 against ``t`` 452 and ``lt`` 449; S=2048 ``ltq`` 509 against ``lt`` 504 and
#: the default's 505. Causal rows keep ``y2``.
PERSIST_D64_FULL_MAX_SEQ_K = 1024


def default_attn_fp8_config(head_dim: int, blk: int = 128, causal: bool = False,
                            seq_k: Optional[int] = None) -> GluonAttnFp8Config:
    """The default config for ``head_dim`` and ``causal`` (the kernel's normalized window: causal is
    ``win_right == 0``; anything else, a right window included, takes the full-attention config),
    and, where known, the key count ``seq_k`` (head dim 64 causal up to :data:`Y2_CAUSAL_MAX_SEQ_K`
    keys, scale blocks of 128 tokens or more: two CTAs per SM; head dim 64 full up to
    :data:`PERSIST_D64_FULL_MAX_SEQ_K` keys and head dim 128 up to :data:`PERSIST_D128_MAX_SEQ_K`
    keys (full: any), 128-key tiles: persistent CTAs). With 64-token scale blocks the key
    tile shrinks to 64 (a key tile must lie in one k / v scale block: its scales are scalars).
    32-token blocks are not taken: a 32-key tile would halve the MMA widths."""
    # (64-token scale blocks keep the configs below: y2 and t ran on the GPU with 128-token blocks)
    if head_dim == 64 and seq_k is not None and blk >= 128:
        if causal and seq_k <= Y2_CAUSAL_MAX_SEQ_K:
            return _Y2_CAUSAL_D64
        if not causal and seq_k <= PERSIST_D64_FULL_MAX_SEQ_K:
            return _LTQ
    cfg = _DEFAULT_CONFIGS[(head_dim, bool(causal))]
    if 64 <= blk < cfg.block_n:  # the config run on the GPU there: no j, no l
        cfg = dataclasses.replace(cfg, block_n=blk, skip=False, lsum=False)
    elif head_dim == 128 and seq_k is not None:
        top = PERSIST_D128_MAX_SEQ_K[bool(causal)]
        if top is None or seq_k <= top:
            cfg = _PERSIST_D128[bool(causal)]
            if causal and seq_k > Q2_D128_CAUSAL_MAX_SEQ_K:
                cfg = dataclasses.replace(cfg, q_double=False)
    return cfg


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
if GLUON_AVAILABLE:

    @gluon.jit
    def _snake_count(NT):
        """How many of the ``NT`` tiles this persistent CTA runs (:func:`_snake_tile`): one per
        round of ``num_programs`` tiles, the last round's only where its index is below NT."""
        P = gl.num_programs(0)
        R = gl.cdiv(NT, P)
        return R - 1 + (_snake_tile(R - 1) < NT).to(gl.int32)

    @gluon.jit
    def _snake_tile(k):
        """The persistent CTA's k-th tile: round k of ``num_programs`` consecutive tiles, taken in
        program order in even rounds and in reverse order in odd ones. Causal tiles come longest
        first per (batch, head), so a plain round-robin gives a CTA the same few positions in every
        head (with 32 query tiles and 132 CTAs, the CTAs of ``program_id % 4 == 0`` got 20% more
        key blocks than those of ``3``, and the last CTA sets the kernel's time); the reversal pairs
        a round's long tiles with the next round's short ones (within ~3% of the mean at 1k-16k
        tokens, modelled), and each round still covers a few heads, whose K / V stay in L2."""
        P = gl.num_programs(0)
        pid = gl.program_id(0)
        return k * P + pid + (k & 1) * (P - 1 - 2 * pid)

    @gluon.jit
    def _q_slot(q_bar, q_empty, tc, NUM_WG: gl.constexpr, Q2: gl.constexpr):
        """The persistent CTA's tile ``tc``'s Q buffer: ``(ready barrier, empty barrier, phase, first
        q_smem index)``. One buffer: phase ``tc % 2``; Q2 (config ``q``): buffer ``tc % 2``, each
        barrier pair used every other tile, phase ``(tc // 2) % 2``."""
        if Q2:
            slot = tc & 1
            return q_bar.index(slot), q_empty.index(slot), (tc >> 1) & 1, slot * NUM_WG
        else:
            return q_bar, q_empty, tc & 1, 0

    @gluon.jit
    def _ptile(t, NM, H, SEQ_K, offset, win_right, HAS_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr):
        """Persistent form (config flag ``t``): tile ``t`` of ``NM`` query tiles per (batch, head),
        query tiles fastest as in :func:`_tile`'s grid (the tiles of one head run side by side and
        share its K / V in L2); causal runs each head's longest tiles first. Returns what
        :func:`_tile` returns."""
        pid_m = t % NM
        bh = t // NM
        if HAS_RIGHT:
            pid_m = NM - 1 - pid_m
        hi = SEQ_K
        if HAS_RIGHT:
            hi = gl.minimum(pid_m * BLOCK_M + BLOCK_M + offset + win_right, SEQ_K)
        n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
        return pid_m, bh // H, bh % H, n_blocks

    @gluon.jit
    def _fp8_produce_tile(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                          H, GROUP, SEQ_K, pid_m, b, h, n_blocks, it, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          NUM_WG: gl.constexpr, q_base=0):
        """The KPERM producer's work for one tile: its Q parts (into ``q_smem[q_base + w]``, ``q_bar``
        the barrier of that buffer), then K / V of its key blocks into the ring slots of the CTA's
        blocks ``it, it + 1, ...`` (``it``: blocks loaded before)."""
        HALF: gl.constexpr = q_desc.block_type.shape[1]
        hk = h // GROUP
        m0 = pid_m * (NUM_WG * HALF)
        k0 = (b * (H // GROUP) + hk) * (SEQ_K // 16)
        mbarrier.expect(q_bar, NUM_WG * q_desc.block_type.nbytes)
        for w in gl.static_range(NUM_WG):
            tma.async_copy_global_to_shared(q_desc, [b, m0 + w * HALF, h, 0], q_bar, q_smem.index(q_base + w))
        for j in range(n_blocks):
            g = it + j
            s = g % STAGES
            phase = ((g // STAGES) & 1) ^ 1  # empty barriers start one phase behind
            mbarrier.wait(k_empty.index(s), phase)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k0 + j * (BLOCK_N // 16), 0, 0, 0, 0], k_ready.index(s),
                                            k_bufs.index(s))
            mbarrier.wait(v_empty.index(s), phase)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [b, 0, hk, j * BLOCK_N], v_ready.index(s), v_bufs.index(s))

    @gluon.jit
    def _fp8_producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                      H, GROUP, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, KPERM: gl.constexpr, HEADS_FIRST: gl.constexpr = False,
                      NUM_WG: gl.constexpr = 2, PERSIST: gl.constexpr = False, NT=0, NM=0, q_empty=None,
                      Q2: gl.constexpr = False):
        """One warp: the bf16 forward's producer with V^T's keys as the box's inner dimension and,
        KPERM, K through the 5-D key-permuting descriptor (its first coordinate counts 16-key groups
        of the flattened [B * Hk * Sk] keys; Sk is a multiple of 16, so a group never straddles two
        heads; a tile's keys past Sk read the next head's keys or zeros, and are masked). PERSIST
        (KPERM only): the CTA's tiles of ``NT`` in :func:`_snake_tile`'s order, the ring
        running on across them; a tile's Q is loaded once every consumer warpgroup has released the
        previous one (``q_empty``, after its last S MMA), so the next tile's Q and first K / V
        blocks load while the consumers finish the previous tile's last PV MMA and epilogue."""
        if KPERM:
            HALF: gl.constexpr = q_desc.block_type.shape[1]
            if PERSIST:
                it = 0
                tc = 0
                for kt in range(_snake_count(NT)):
                    pid_m, b, h, n_blocks = _ptile(_snake_tile(kt), NM, H, SEQ_K, offset, win_right, HAS_RIGHT,
                                                   NUM_WG * HALF, BLOCK_N)
                    qb, qe, q_phase, q_base = _q_slot(q_bar, q_empty, tc, NUM_WG, Q2)
                    mbarrier.wait(qe, q_phase ^ 1)  # starts one phase behind: no wait at a buffer's first use
                    _fp8_produce_tile(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, qb, k_ready, k_empty,
                                      v_ready, v_empty, H, GROUP, SEQ_K, pid_m, b, h, n_blocks, it, BLOCK_N,
                                      STAGES, NUM_WG, q_base)
                    it += n_blocks
                    tc += 1
            else:
                pid_m, b, h, n_blocks = _tile(H, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT, NUM_WG * HALF, BLOCK_N,
                                              1 if HEADS_FIRST else 0)
                _fp8_produce_tile(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                                  v_empty, H, GROUP, SEQ_K, pid_m, b, h, n_blocks, 0, BLOCK_N, STAGES, NUM_WG)
        else:
            _producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                      H, GROUP, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT, BLOCK_N, STAGES, True, 0, 0, False, NUM_WG)

    @gluon.jit
    def _kperm_keys(c):
        """The key held by row ``c`` of a key-permuted K tile (config flag ``k``): inside each group
        of 32, ``c = 16 i1 + 8 i0 + 2 t + e`` holds key ``16 i1 + 4 t + 2 i0 + e``. The S accumulator
        puts column ``8 i + 2 t + e`` in lane ``t`` of a quad, register ``(i, e)``; the E4M3 A
        operand of an m64k32 wgmma puts k ``16 h + 4 t + f`` in lane ``t``, register ``(h, f)``: with
        this order the score a thread holds is the P element its own A registers need."""
        return (c & -32) | (c & 16) | (((c >> 1) & 3) << 2) | (((c >> 3) & 1) << 1) | (c & 1)

    @gluon.constexpr_function
    def _packed_p_layout(rows, groups):
        """Layout of the KPERM loop-carried P, int32 ``[rows, groups, 4]`` (A register of row, 16-key
        group, lane t of the quad) for a 4-warp consumer: what the split of the S accumulator gives,
        written out so that the joins of :func:`_p_mma_operand` put their new dimensions in the
        lowest register bits (a SliceLayout operand would make them higher bits)."""
        reg = [[8, 0, 0]] + [[0, 1 << i, 0] for i in range(groups.bit_length() - 1)]
        lane = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        warp = [[16, 0, 0], [32, 0, 0]]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [rows, groups, 4])

    @gluon.jit
    def _p_operand(p, p_layout: gl.constexpr, KPERM: gl.constexpr, after=0, AFTER: gl.constexpr = False):
        """fp32 P (in units of the static scale) -> what the loop carries to the next iteration's PV
        wgmma: without KPERM, E4M3 in the A-operand layout (a layout conversion that shuffles
        within quads); with KPERM, the A registers themselves as an int32 ``[M, N / 16, 4]`` tensor
        (:func:`_p_mma_operand` turns it into the operand). KPERM: S's columns are in
        :func:`_kperm_keys` order, so the four E4M3 codes of A register ``(row, 16-key group g,
        lane t)`` (keys ``16 g + 4 t + f``, ``f = 2 i0 + e``) are this thread's accumulator
        elements of column bits ``e`` (bit 0) and ``i0`` (bit 3): split them out (register-only) and
        pack each four with two ``cvt.rn.satfinite.e4m3x2.f32`` (the rounding of
        ``.to(float8e4nv)``). Carrying 8-bit elements through the loop instead costs a byte
        extraction and re-packing per element (the PRMT / LOP3 of the default path).

        ``after`` (KPERM, AFTER): a value the packing must wait for (an unused asm operand): the previous
        P's A registers as returned by the wait that retires its PV wgmma, so the new codes are
        written only once that wgmma no longer reads its registers (else ptxas, which reuses them,
        serializes every wgmma: note C7513)."""
        if KPERM:
            HM: gl.constexpr = p.type.shape[0]
            N: gl.constexpr = p.type.shape[1]
            pe0, pe1 = gl.split(gl.reshape(p, [HM, N // 2, 2]))  # column bit 0 (e)
            x00, x01 = gl.split(gl.permute(gl.reshape(pe0, [HM, N // 16, 2, 4]), [0, 1, 3, 2]))  # bit 3 (i0)
            x10, x11 = gl.split(gl.permute(gl.reshape(pe1, [HM, N // 16, 2, 4]), [0, 1, 3, 2]))
            if AFTER:
                after = gl.convert_layout(after, x00.type.layout, assert_trivial=True)
            # bytes f = 0..3 of the A register: (e, i0) = (0, 0), (1, 0), (0, 1), (1, 1)
            packed = gl.inline_asm_elementwise(
                """{
                .reg .b16 lo, hi;
                cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
                cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
                mov.b32 $0, {lo, hi};
                }""",
                "=r,r,r,r,r,r", [x00, x10, x01, x11, after], dtype=gl.int32, is_pure=True, pack=1)
            return gl.convert_layout(packed, _packed_p_layout(HM, N // 16), assert_trivial=True)
        else:
            return gl.convert_layout(p.to(gl.float8e4nv), p_layout)

    @gluon.jit
    def _p_mma_operand(pc, p_layout: gl.constexpr, KPERM: gl.constexpr):
        """The loop-carried P (:func:`_p_operand`) as the PV wgmma's A operand. KPERM: each int32
        register becomes its four E4M3 codes in place (an identity inline asm over four copies, so
        the bytes go from register to operand without being unpacked); keys ``16 g + 4 t + f``."""
        if KPERM:
            HM: gl.constexpr = pc.type.shape[0]
            G: gl.constexpr = pc.type.shape[1]
            x = gl.join(pc, pc)
            x = gl.join(x, x)
            p8 = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [x], dtype=gl.float8e4nv,
                                           is_pure=True, pack=4)
            return gl.convert_layout(gl.reshape(p8, [HM, 16 * G]), p_layout)
        else:
            return pc

    @gluon.jit
    def _pv_issue(p_op, v_tile, acc):
        """Issue ``O += P8 V8`` (``v_tile``: the V^T tile [D, keys] viewed as [keys, D], the B operand
        with K = keys contiguous); returns its token."""
        D_V: gl.constexpr = acc.type.shape[1]
        BLOCK_N: gl.constexpr = v_tile.type.shape[3]  # v_tile: a ring slot, [1, D, 1, keys]
        return warpgroup_mma(p_op, v_tile.reshape([D_V, BLOCK_N]).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _pv_retire(o_tok, p, WITH_P: gl.constexpr):
        """Wait for :func:`_pv_issue`'s wgmma: (O, p). WITH_P: the loop-carried P is a dependency of
        the wait (KPERM: its registers come back from the wait, see :func:`_p_operand`'s ``after``)."""
        if WITH_P:
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))
        return acc, p

    @gluon.jit
    def _fp8_softmax(s, m_i, l_i, rs, offs_m, n0, SEQ_K, diag, p_layout: gl.constexpr, HAS_RIGHT: gl.constexpr,
                     MASKED: gl.constexpr, P_LOG2: gl.constexpr, KPERM: gl.constexpr, EMU: gl.constexpr,
                     EMU_DEG: gl.constexpr, LAZY: gl.constexpr = 0, LSUM: gl.constexpr = False):
        """The bf16 forward's ``_softmax`` with a per-row scale ``rs`` (ROW_SCALE) and P in units of
        ``2**P_LOG2``, plus the FP8 flags: KPERM (S's columns are keys in :func:`_kperm_keys` order:
        the mask uses that order, P goes to the MMA without a shuffle), EMU / EMU_DEG (part of the
        exponentials of full blocks on the FMA pipe; masked blocks, whose scores may be -inf, keep
        MUFU.EX2 only), LAZY (``c<T>``: the reference maximum moves only when the row maximum
        passes it by more than LAZY; then alpha is exactly 1). Returns (fp32 P in units of
        ``2**P_LOG2``, m, l, alpha); LSUM: l is the [rows, 4] per-lane partial (:func:`_row_partial`)."""
        BLOCK_N: gl.constexpr = s.type.shape[1]
        if MASKED:
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
            if KPERM:
                cols = _kperm_keys(cols)
            offs_n = n0 + cols
            ok = gl.expand_dims(offs_n < SEQ_K, 0)
            if HAS_RIGHT:
                ok = ok & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m + diag, 1))
            s = gl.where(ok, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * rs)
        if LAZY:  # the reference moves only past the threshold (P <= 2**(P_LOG2 + LAZY) = 256)
            m_new = gl.where(m_new > m_i + LAZY, m_new, m_i)
        if MASKED:
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        x = s * gl.expand_dims(rs, 1) - gl.expand_dims(m_safe - P_LOG2, 1)
        if MASKED:
            p = gl.exp2(x)
        else:
            p = _exp2_mixed(x, EMU, EMU_DEG)
        alpha = gl.exp2(m_i - m_safe)
        if LSUM:
            part = _row_partial(p)
            a2 = gl.convert_layout(alpha, gl.SliceLayout(1, part.type.layout), assert_trivial=True)
            l_i = l_i * gl.expand_dims(a2, 1) + part
        else:
            l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _lsum_init(l0, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """[M] initial row sums -> the [M, 4] partials of :func:`_row_partial`'s layout (lane 0
        of each quad holds the value, the others 0)."""
        HM: gl.constexpr = l0.type.shape[0]
        part = _row_partial(gl.zeros([HM, BLOCK_N], gl.float32, s_layout))
        lane = gl.arange(0, 4, layout=gl.SliceLayout(0, part.type.layout))
        l0 = gl.convert_layout(l0, gl.SliceLayout(1, part.type.layout), assert_trivial=True)
        return gl.where(gl.expand_dims(lane, 0) == 0, gl.expand_dims(l0, 1), part)

    @gluon.jit
    def _row_partial(x):
        """[M, N] wgmma accumulator -> [M, 4]: each thread's sum of its own elements of each row
        (column ``8 i + 2 t + e`` is register (i, e) of lane t of the quad: the sum over i and e is
        register-only; the t axis stays in the lanes)."""
        HM: gl.constexpr = x.type.shape[0]
        N: gl.constexpr = x.type.shape[1]
        return gl.sum(gl.sum(gl.reshape(x, [HM, N // 8, 4, 2]), 3), 1)

    @gluon.jit
    def _fp8_step(j, q, q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn, s_regs, acc, p, m_i, l_i, vs_prev,
                  q_scale, ks_base, vs_base, offs_m, SEQ_K, diag, o_layout: gl.constexpr, p_layout: gl.constexpr,
                  BLK: gl.constexpr, P_LOG2: gl.constexpr, HAS_RIGHT: gl.constexpr, MASKED: gl.constexpr,
                  STAGES: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr, KPERM: gl.constexpr,
                  EMU: gl.constexpr, EMU_DEG: gl.constexpr, LAZY: gl.constexpr = 0, LSUM: gl.constexpr = False,
                  it=0, q_phase=0):
        """Iteration j >= 1: issue S_j, issue O += P8_{j-1} V8_{j-1}, softmax S_j while the PV MMA
        runs, then retire it and move O to block j's units (alpha_j * vs_{j-1} / vs_j). ``it``: the
        CTA's key blocks before this tile's (ring slot and phase of block j are those of ``it + j``);
        ``q_phase``: the phase of this tile's completed Q barrier."""
        BLOCK_N: gl.constexpr = s_regs.type.shape[1]
        D_QK: gl.constexpr = q.type.shape[1]
        s = (it + j) % STAGES
        sp = (it + j - 1) % STAGES
        # block j's scales (scalars: the key tile lies in one scale block), loaded before the
        # barrier waits so their latency hides behind them
        rs = q_scale * gl.load(ks_base + (j * BLOCK_N) // BLK)
        vs = gl.load(vs_base + (j * BLOCK_N) // BLK)
        # P_{j-1}'s A registers, made before the wgmmas are issued: ptxas serializes the wgmmas of a
        # batch when a non-wgmma instruction defines one's inputs in between (note C7513)
        p_op = _p_mma_operand(p, p_layout, KPERM)
        mbarrier.wait(k_ready.index(s), ((it + j) // STAGES) & 1)
        mbarrier.wait(v_ready.index(sp), ((it + j - 1) // STAGES) & 1)
        _take_turn(turn, j, WG, PINGPONG)
        s_tok = warpgroup_mma(q, k_bufs.index(s).reshape([BLOCK_N, D_QK]).permute((1, 0)), s_regs,
                              use_acc=False, is_async=True)
        o_tok = _pv_issue(p_op, v_bufs.index(sp), acc)
        _pass_turn(turn, WG, PINGPONG)
        s_regs = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(s), count=1)
        p_new, m_i, l_i, alpha = _fp8_softmax(s_regs, m_i, l_i, rs, offs_m, j * BLOCK_N, SEQ_K, diag, p_layout,
                                              HAS_RIGHT, MASKED, P_LOG2, KPERM, EMU, EMU_DEG, LAZY, LSUM)
        # ptxas hoists a wgmma wait as high as it can (it is ready once issued; what it stalls is
        # not modelled), i.e. above the exponentials, and the PV MMA would no longer overlap the
        # softmax. A wait on an mbarrier that has already completed (Q's) is a try_wait loop in the
        # PTX: a basic-block boundary ptxas does not schedule across, for one try_wait. P_{j-1}
        # is not a dependency of the wait (its lowering takes no 8-bit operands); ptxas keeps an
        # in-flight wgmma's A registers untouched on its own (no serialization notes).
        if LAZY:
            # vs_prev / vs of powers of two by the exponent fields (exact; no IEEE division)
            ratio = ((vs_prev.to(gl.int32, bitcast=True) - vs.to(gl.int32, bitcast=True)) + 0x3F800000).to(
                gl.float32, bitcast=True)
            mbarrier.wait(q_bar, q_phase)
            acc, p = _pv_retire(o_tok, p, KPERM)
            # the branches of the skippable rescale before P's packing, so the packed registers
            # are written once, into the A registers of the next PV wgmma
            acc = _rescale(acc, alpha * ratio, o_layout, LAZY)
            if KPERM:
                p_out = _p_operand(p_new, p_layout, KPERM, p, True)
            else:
                p_out = _p_operand(p_new, p_layout, KPERM)
            mbarrier.arrive(v_empty.index(sp), count=1)
        else:
            if KPERM:
                mbarrier.wait(q_bar, q_phase)
                acc, p = _pv_retire(o_tok, p, True)
                p_out = _p_operand(p_new, p_layout, KPERM, p, True)
            else:
                p_out = _p_operand(p_new, p_layout, KPERM)
                mbarrier.wait(q_bar, q_phase)
                acc, p = _pv_retire(o_tok, p, False)
            mbarrier.arrive(v_empty.index(sp), count=1)
            # O in units of V block j's scale from here on: powers of two, so the ratio is exact
            acc = _rescale(acc, alpha * (vs_prev / vs), o_layout, False)
        return s_regs, acc, p_out, m_i, l_i, vs

    @gluon.jit
    def _fp8_consume_tile(o_desc, q_smem, k_bufs, v_bufs, o_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                          QS, KS, VS, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, NBQ, NBK, offset, win_right, qk_scale,
                          pid_m, b, h, n_blocks, it, q_phase, q_empty,
                          WG: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, BLK: gl.constexpr, P_SCALE: gl.constexpr, P_LOG2: gl.constexpr,
                          PINGPONG: gl.constexpr, KPERM: gl.constexpr, EMU: gl.constexpr, EMU_DEG: gl.constexpr,
                          LAZY: gl.constexpr, LSUM: gl.constexpr, NUM_WG: gl.constexpr, PERSIST: gl.constexpr,
                          SKIP: gl.constexpr = False, q_base=0):
        """One warpgroup's part of one tile: query rows [WG*64, WG*64+64) of its NUM_WG x 64 rows.
        ``it``: the CTA's key blocks before this tile (ring slots and phases run on from there);
        ``q_phase``: the phase of this tile's Q barrier; PERSIST: ``q_empty`` is arrived once the
        tile's last S MMA is retired (Q may then be overwritten with the next tile's). ``SKIP``: the
        bf16 forward's ``j`` (flash_attn_fwd_gluon._consumer): only the key blocks this warpgroup's
        rows see are computed, the rest of the tile's ring slots are released unread."""
        HALF: gl.constexpr = o_desc.block_type.shape[1]
        D_QK: gl.constexpr = q_smem.type.shape[4]
        D_V: gl.constexpr = o_desc.block_type.shape[3]
        # FP8 wgmma: m64nNk32
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D_V, 32])
        # P8 as the A operand of O += P8 V8 from registers: four E4M3 codes per 32-bit register (P is
        # row-major over keys = K-major, as an FP8 A operand must be); the accumulator fragment of
        # S does not map onto it register for register, so the conversion shuffles within warps
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        hk = h // GROUP
        m0 = pid_m * (NUM_WG * HALF) + WG * HALF
        offs_m = m0 + gl.arange(0, HALF, layout=row_layout)
        diag = offset + win_right
        n_full, n_own = _own_blocks(m0, n_blocks, SEQ_Q, SEQ_K, diag, HALF, BLOCK_N, HAS_RIGHT, SKIP)

        # per-row q multiplier with softmax_scale * log2(e) folded in (the tl kernel's q_scale);
        # rows past seq_q take 1 so their scores stay finite (they are clipped at the store)
        q_scale = gl.load(QS + (b * H + h) * NBQ + offs_m // BLK, mask=offs_m < SEQ_Q, other=1.0) * qk_scale
        ks_base = KS + (b * (H // GROUP) + hk) * NBK
        vs_base = VS + (b * (H // GROUP) + hk) * NBK

        if HAS_SINK:  # the sink joins the denominator only: m = sink (base 2), l = 1 (in P units)
            sink_log2 = gl.load(SINK + h).to(gl.float32) * 1.4426950408889634
            m_i = gl.full([HALF], 0.0, gl.float32, row_layout) + sink_log2
            l_i = gl.full([HALF], P_SCALE, gl.float32, row_layout)
        else:
            m_i = gl.full([HALF], float("-inf"), gl.float32, row_layout)
            l_i = gl.full([HALF], 0.0, gl.float32, row_layout)
        if LSUM:  # per-lane partials: the initial l (the sink's) in lane 0 of each quad
            l_i = _lsum_init(l_i, s_layout, BLOCK_N)

        mbarrier.wait(q_bar, q_phase)
        q = q_smem.index(q_base + WG).reshape([HALF, D_QK])
        # block 0, peeled (always with the mask: it may be the only one, and partly masked)
        rs = q_scale * gl.load(ks_base)
        vs = gl.load(vs_base)
        s_regs = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
        s0 = it % STAGES
        mbarrier.wait(k_ready.index(s0), (it // STAGES) & 1)
        _take_turn(turn, 0, WG, PINGPONG)
        s_tok = warpgroup_mma(q, k_bufs.index(s0).reshape([BLOCK_N, D_QK]).permute((1, 0)), s_regs,
                              use_acc=False, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        s_regs = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(s0), count=1)
        p, m_i, l_i, alpha = _fp8_softmax(s_regs, m_i, l_i, rs, offs_m, 0, SEQ_K, diag, p_layout, HAS_RIGHT, True,
                                          P_LOG2, KPERM, EMU, EMU_DEG, LAZY, LSUM)
        p = _p_operand(p, p_layout, KPERM)
        acc = gl.zeros([HALF, D_V], gl.float32, o_layout)
        for j in range(1, n_full):
            s_regs, acc, p, m_i, l_i, vs = _fp8_step(j, q, q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn,
                                                     s_regs, acc, p, m_i, l_i, vs, q_scale, ks_base, vs_base, offs_m,
                                                     SEQ_K, diag, o_layout, p_layout, BLK, P_LOG2, HAS_RIGHT, False,
                                                     STAGES, WG, PINGPONG, KPERM, EMU, EMU_DEG, LAZY, LSUM, it,
                                                     q_phase)
        for j in range(gl.maximum(n_full, 1), n_own):
            s_regs, acc, p, m_i, l_i, vs = _fp8_step(j, q, q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn,
                                                     s_regs, acc, p, m_i, l_i, vs, q_scale, ks_base, vs_base, offs_m,
                                                     SEQ_K, diag, o_layout, p_layout, BLK, P_LOG2, HAS_RIGHT, True,
                                                     STAGES, WG, PINGPONG, KPERM, EMU, EMU_DEG, LAZY, LSUM, it,
                                                     q_phase)
        if PERSIST:  # every S MMA of the tile is retired: Q's buffer may take the next tile's
            mbarrier.arrive(q_empty, count=1)
        # the last block's PV
        sl = (it + n_own - 1) % STAGES
        mbarrier.wait(v_ready.index(sl), ((it + n_own - 1) // STAGES) & 1)
        _take_turn(turn, n_own, WG, PINGPONG)
        o_tok = _pv_issue(_p_mma_operand(p, p_layout, KPERM), v_bufs.index(sl), acc)
        _pass_turn(turn, WG, PINGPONG)
        acc, p = _pv_retire(o_tok, p, False)
        mbarrier.arrive(v_empty.index(sl), count=1)
        if SKIP:
            _release_blocks(n_own, n_blocks, it, k_ready, k_empty, v_ready, v_empty, STAGES)

        if LSUM:
            l_i = gl.convert_layout(gl.sum(l_i, 1), row_layout)
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("inf"), (m_i + (gl.log2(l_safe) - P_LOG2)) / 1.4426950408889634)
        gl.store(LSE + (b * H + h).to(gl.int64) * SEQ_Q + offs_m, lse, mask=offs_m < SEQ_Q)
        # O and l are both in P units; O also in the last V block's: one exact scalar factor
        out = (acc * vs) / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
        o_tile = o_smem.index(WG)
        o_tile.reshape([HALF, D_V]).store(out.to(o_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, m0, h, 0], o_tile)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _fp8_consumer(o_desc, q_smem, k_bufs, v_bufs, o_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                      QS, KS, VS, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, NBQ, NBK, offset, win_right, qk_scale,
                      WG: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, BLK: gl.constexpr, P_SCALE: gl.constexpr, P_LOG2: gl.constexpr,
                      PINGPONG: gl.constexpr, KPERM: gl.constexpr, EMU: gl.constexpr, EMU_DEG: gl.constexpr,
                      LAZY: gl.constexpr, LSUM: gl.constexpr, HEADS_FIRST: gl.constexpr = False,
                      NUM_WG: gl.constexpr = 2, PERSIST: gl.constexpr = False, NT=0, NM=0, q_empty=None,
                      SKIP: gl.constexpr = False, Q2: gl.constexpr = False):
        """One consumer warpgroup: its 64 rows of the program's tile, or (PERSIST) of each of the
        CTA's tiles in turn (the producer's order, :func:`_ptile`)."""
        HALF: gl.constexpr = o_desc.block_type.shape[1]
        if PERSIST:
            it = 0
            tc = 0
            for kt in range(_snake_count(NT)):
                pid_m, b, h, n_blocks = _ptile(_snake_tile(kt), NM, H, SEQ_K, offset, win_right, HAS_RIGHT,
                                               NUM_WG * HALF, BLOCK_N)
                qb, qe, q_phase, q_base = _q_slot(q_bar, q_empty, tc, NUM_WG, Q2)
                _fp8_consume_tile(o_desc, q_smem, k_bufs, v_bufs, o_smem, qb, k_ready, k_empty, v_ready, v_empty,
                                  turn, QS, KS, VS, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, NBQ, NBK, offset, win_right,
                                  qk_scale, pid_m, b, h, n_blocks, it, q_phase, qe, WG, HAS_RIGHT, HAS_SINK,
                                  BLOCK_N, STAGES, BLK, P_SCALE, P_LOG2, PINGPONG, KPERM, EMU, EMU_DEG, LAZY, LSUM,
                                  NUM_WG, True, SKIP, q_base)
                it += n_blocks
                tc += 1
        else:
            pid_m, b, h, n_blocks = _tile(H, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT, NUM_WG * HALF, BLOCK_N,
                                          1 if HEADS_FIRST else 0)
            _fp8_consume_tile(o_desc, q_smem, k_bufs, v_bufs, o_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                              turn, QS, KS, VS, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, NBQ, NBK, offset, win_right,
                              qk_scale, pid_m, b, h, n_blocks, 0, 0, q_empty, WG, HAS_RIGHT, HAS_SINK, BLOCK_N,
                              STAGES, BLK, P_SCALE, P_LOG2, PINGPONG, KPERM, EMU, EMU_DEG, LAZY, LSUM, NUM_WG, False,
                              SKIP)

    @gluon.jit
    def _attn_fp8_fwd_ws_kernel(
        q_desc, k_desc, v_desc, o_desc,
        QS, KS, VS, LSE, SINK,
        H, GROUP, SEQ_Q, SEQ_K, NBQ, NBK,
        offset, win_right, qk_scale, NT, NM,
        HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr, STAGES: gl.constexpr, BLK: gl.constexpr,
        P_SCALE: gl.constexpr, P_LOG2: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr = False,
        KPERM: gl.constexpr = False, EMU: gl.constexpr = 0, EMU_DEG: gl.constexpr = 3, LAZY: gl.constexpr = 0,
        LSUM: gl.constexpr = False, HEADS_FIRST: gl.constexpr = False, NUM_WG: gl.constexpr = 2,
        PERSIST: gl.constexpr = False, SKIP: gl.constexpr = False, Q2: gl.constexpr = False,
    ):
        """O, LSE of 128 query rows of one (batch, head) from E4M3 q / k / v^T: producer warp + two
        consumer warpgroups.

        Descriptors: q over [B, Sq, H, D] with boxes [1, 64, 1, D], k over [B, Sk, Hk, D] with
        [1, BLOCK_N, 1, D], v over V^T as [B, D, Hk, Sk] with [1, D, 1, BLOCK_N], o (16-bit) over
        [B, Sq, H, D] with [1, 64, 1, D]. QS / KS / VS: contiguous fp32 [B, H(k), NB(Q/K)]
        multipliers of BLK-token blocks (BLK a multiple of BLOCK_N: constexpr, it divides the key
        index). P_SCALE / P_LOG2: the static P scale (``GluonAttnFp8Config.p_log2``). HAS_RIGHT (a
        right window bound, causal = 0) adds the diagonal loop; HAS_SINK changes the init. KPERM /
        EMU / EMU_DEG / LAZY / LSUM / HEADS_FIRST: GluonAttnFp8Config's kperm / emu / emu_deg / lazy
        / lsum / heads_first (grid (B * H, query tiles)); with
        KPERM, k is a 5-D descriptor over the contiguous k8 seen as [B * Hk * Sk / 16, 2, 4, 2, D]
        with strides [16 D, 2 D, 4 D, D, 1] and box [BLOCK_N / 16, 2, 4, 2, D]: the TMA load itself
        puts the keys in :func:`_kperm_keys` order."""
        HALF: gl.constexpr = q_desc.block_type.shape[1]
        D_QK: gl.constexpr = q_desc.block_type.shape[3]
        D_V: gl.constexpr = v_desc.block_type.shape[1]
        if KPERM:
            BLOCK_N: gl.constexpr = 16 * k_desc.block_type.shape[0]
            k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N // 16, 2, 4, 2, D_QK], k_desc.layout)
        else:
            BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
            k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 1, BLOCK_N, 1, D_QK], k_desc.layout)
        gl.static_assert(v_desc.block_type.shape[3] == BLOCK_N, "K and V^T boxes cover the same keys")
        gl.static_assert(BLK % BLOCK_N == 0, "a key tile must lie in one scale block")
        QBUF: gl.constexpr = 2 if Q2 else 1  # Q2 (config q): two Q buffers for the persistent CTAs
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [QBUF * NUM_WG, 1, HALF, 1, D_QK], q_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, D_V, 1, BLOCK_N], v_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [NUM_WG, 1, HALF, 1, D_V], o_desc.layout)
        if Q2:
            q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        else:
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        if Q2:
            for i in gl.static_range(2):
                mbarrier.init(q_bar.index(i), count=1)
                mbarrier.init(q_empty.index(i), count=NUM_WG)
        else:
            mbarrier.init(q_bar, count=1)
            mbarrier.init(q_empty, count=NUM_WG)  # PERSIST: one arrival per consumer warpgroup per tile
        mbarrier.init(turn.index(0), count=1)  # PINGPONG: arrived by WG 1 when it has issued its MMAs
        mbarrier.init(turn.index(1), count=1)  # and by WG 0
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)  # the producer's expect + TMA bytes
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_WG)  # one arrival per consumer warpgroup
            mbarrier.init(v_empty.index(i), count=NUM_WG)
        # the partitions' argument tuples are written out inline (a tuple bound to a name first would
        # turn its constexpr entries into runtime values)
        if NUM_WG == 3:
            gl.warp_specialize([
                (_fp8_consumer, (o_desc, q_smem, k_bufs, v_bufs, o_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                                 QS, KS, VS, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, NBQ, NBK, offset, win_right, qk_scale,
                                 0, HAS_RIGHT, HAS_SINK, BLOCK_N, STAGES, BLK, P_SCALE, P_LOG2, PINGPONG, KPERM, EMU,
                                 EMU_DEG, LAZY, LSUM, HEADS_FIRST, NUM_WG, PERSIST, NT, NM,
                                 q_empty, SKIP, Q2)),
                (_fp8_consumer, (o_desc, q_smem, k_bufs, v_bufs, o_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                                 QS, KS, VS, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, NBQ, NBK, offset, win_right, qk_scale,
                                 1, HAS_RIGHT, HAS_SINK, BLOCK_N, STAGES, BLK, P_SCALE, P_LOG2, PINGPONG, KPERM, EMU,
                                 EMU_DEG, LAZY, LSUM, HEADS_FIRST, NUM_WG, PERSIST, NT, NM,
                                 q_empty, SKIP, Q2)),
                (_fp8_consumer, (o_desc, q_smem, k_bufs, v_bufs, o_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                                 QS, KS, VS, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, NBQ, NBK, offset, win_right, qk_scale,
                                 2, HAS_RIGHT, HAS_SINK, BLOCK_N, STAGES, BLK, P_SCALE, P_LOG2, PINGPONG, KPERM, EMU,
                                 EMU_DEG, LAZY, LSUM, HEADS_FIRST, NUM_WG, PERSIST, NT, NM,
                                 q_empty, SKIP, Q2)),
                (_fp8_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                                 H, GROUP, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT, BLOCK_N, STAGES, KPERM,
                                 HEADS_FIRST, NUM_WG, PERSIST, NT, NM, q_empty, Q2)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_fp8_consumer, (o_desc, q_smem, k_bufs, v_bufs, o_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                                 QS, KS, VS, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, NBQ, NBK, offset, win_right, qk_scale,
                                 0, HAS_RIGHT, HAS_SINK, BLOCK_N, STAGES, BLK, P_SCALE, P_LOG2, PINGPONG, KPERM, EMU,
                                 EMU_DEG, LAZY, LSUM, HEADS_FIRST, NUM_WG, PERSIST, NT, NM,
                                 q_empty, SKIP, Q2)),
                (_fp8_consumer, (o_desc, q_smem, k_bufs, v_bufs, o_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                                 QS, KS, VS, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, NBQ, NBK, offset, win_right, qk_scale,
                                 1, HAS_RIGHT, HAS_SINK, BLOCK_N, STAGES, BLK, P_SCALE, P_LOG2, PINGPONG, KPERM, EMU,
                                 EMU_DEG, LAZY, LSUM, HEADS_FIRST, NUM_WG, PERSIST, NT, NM,
                                 q_empty, SKIP, Q2)),
                (_fp8_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                                 H, GROUP, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT, BLOCK_N, STAGES, KPERM,
                                 HEADS_FIRST, NUM_WG, PERSIST, NT, NM, q_empty, Q2)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Checks and launch
# ----------------------------------------------------------------------------------------------
def use_gluon_attn_fp8_fwd() -> bool:
    """``PRIMUS_TURBO_ATTN_FP8_FWD_GLUON``: 1 and auto run this kernel for ``flash_attn_fp8_func``'s
    forward where :func:`gluon_attn_fp8_fwd_reason` allows, 0 never. Auto is on since the H200
    measurement of the ``k`` configs (session 6, ``scripts/check_gluon_attn_fp8.py --compare``, 32
    heads, 16k tokens): n128s4k 715-787 TFLOP/s at head dim 128 (1.06-1.25x the tl FP8 kernel,
    1.10-1.32x our bf16 Gluon forward), 424 / 333 at head dim 64 (1.00 / 1.05x tl). Session 7 moved
    the default to n128s4kc2 except at head dim 64 causal (geomean 1.18x our bf16 forward; see
    ``_DEFAULT_CONFIGS``)."""
    from primus_turbo.pytorch.core.env import env_auto_flag

    return env_auto_flag(GLUON_ATTN_FP8_ENV) is not False


def _views(q8, k8, v8t):
    """The descriptors' logical views: q / k as [B, S, H, D], V^T as [B, D, H, S]."""
    return q8.transpose(1, 2), k8.transpose(1, 2), v8t.transpose(1, 2)


def _fp8_config(head_dim: int, blk: int, config: Optional[GluonAttnFp8Config], win_right: int,
                seq_k: Optional[int] = None) -> GluonAttnFp8Config:
    """``config``, else the default for this head dim, scale block, window (causal: ``win_right ==
    0``) and key count."""
    return config if config is not None else default_attn_fp8_config(head_dim, blk, win_right == 0, seq_k)


def gluon_attn_fp8_operand_reason(q8, k8, v8t, q_scale_inv, k_scale_inv, v_scale_inv, blk: int, sink=None,
                                  softmax_scale: float = 1.0, win_left: int = -1, win_right: int = -1,
                                  out_dtype: torch.dtype = torch.bfloat16,
                                  config: Optional[GluonAttnFp8Config] = None) -> Optional[str]:
    """The shape / dtype / stride half of :func:`gluon_attn_fp8_fwd_reason` (no device test, so it
    is checkable on CPU). Inputs as :func:`flash_attn_fp8_fwd_triton` takes them (the op's
    :func:`quantize_tokens_fp8` outputs), normalized window bounds (causal: ``win_right = 0``)."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    f8 = torch.float8_e4m3fn
    if any(t.dtype != f8 for t in (q8, k8, v8t)):
        return f"dtypes {q8.dtype}, {k8.dtype}, {v8t.dtype}: the Gluon FP8 forward takes float8_e4m3fn q8, k8, v8t"
    if out_dtype not in _OUT_DTYPES:
        return f"out_dtype {out_dtype}: the Gluon FP8 forward writes bfloat16 or float16"
    if q8.dim() != 4 or k8.dim() != 4 or v8t.dim() != 4:
        return "q8, k8, v8t must be 4-D ([B, H, S, D], [B, Hk, S, D], [B, Hk, D, S])"
    B, H, Sq, D = q8.shape
    Hk, Dv, Sk = v8t.shape[1], v8t.shape[2], v8t.shape[3]
    if tuple(k8.shape) != (B, Hk, Sk, D) or v8t.size(0) != B:
        return f"shapes q8 {tuple(q8.shape)}, k8 {tuple(k8.shape)}, v8t {tuple(v8t.shape)} do not match"
    if D != Dv or D not in HEAD_DIMS:
        return f"head dims qk={D}, v={Dv}: the Gluon FP8 forward takes equal head dims of 64 or 128"
    if win_left >= 0:
        return f"sliding window (left={win_left}): not in the Gluon FP8 forward"
    if not softmax_scale > 0:
        return f"softmax_scale={softmax_scale}: the Gluon FP8 forward takes a positive scale (it maximizes raw scores)"
    if Sk == 0:
        return "seq_kv = 0"
    cfg = _fp8_config(D, blk, config, win_right, Sk)
    if B * H > 65535 and not cfg.heads_first:
        return f"batch * heads_q = {B * H} exceeds the grid's 65535"
    if cfg.heads_first and -(-Sq // cfg.BLOCK_M) > 65535:
        return f"seq_q {Sq}: {-(-Sq // cfg.BLOCK_M)} query tiles exceed the grid's 65535 (config flag g)"
    if H % Hk:
        return f"heads_q={H} is not a multiple of heads_kv={Hk}"
    if blk % cfg.block_n:
        return (f"scale block_size={blk}: the Gluon FP8 forward's key tile ({cfg.block_n}) must lie in one scale "
                f"block (block_size 64, 128 or 256)")
    bad = cfg.check(D)
    if bad is not None:
        return bad
    nbq, nbk = -(-Sq // blk), -(-Sk // blk)
    for name, t, shape in (("q_scale_inv", q_scale_inv, (B, H, nbq)), ("k_scale_inv", k_scale_inv, (B, Hk, nbk)),
                           ("v_scale_inv", v_scale_inv, (B, Hk, nbk))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
            return f"{name} must be contiguous float32 {list(shape)}, got {t.dtype} {list(t.shape)}"
    qv, kv, vv = _views(q8, k8, v8t)
    for name, t in (("q8", qv), ("k8", kv)):
        if _tma_strides(t) is None:
            return f"{name} strides {tuple(t.stride())}: TMA needs a unit head-dim stride and 16-byte aligned strides"
    if cfg.kperm and not k8.is_contiguous():
        return f"config {cfg.short()}: the key-permuting K descriptor (flag k) needs a contiguous k8"
    if _tma_strides(vv) is None:
        return (f"v8t strides {tuple(v8t.stride())}: TMA needs unit key stride and 16-byte aligned rows "
                f"(seq_kv={Sk} must be a multiple of 16 for the transposed FP8 V)")
    if sink is not None and (sink.dtype != torch.float32 or sink.numel() != H):
        return "sink must be float32 [heads_q]"
    return None


def gluon_attn_fp8_fwd_reason(q8, k8, v8t, q_scale_inv, k_scale_inv, v_scale_inv, blk: int, sink=None,
                              softmax_scale: float = 1.0, win_left: int = -1, win_right: int = -1,
                              out_dtype: torch.dtype = torch.bfloat16,
                              config: Optional[GluonAttnFp8Config] = None) -> Optional[str]:
    """None when :func:`flash_attn_fp8_fwd_gluon` can run these inputs on their device, else why
    not. Never raises, never synchronizes."""
    return _device_reason(gluon_attn_fp8_operand_reason, (q8, k8, v8t, q_scale_inv, k_scale_inv, v_scale_inv, blk,
                                                          sink, softmax_scale, win_left, win_right, out_dtype, config))


_GL_DTYPES = {}
if GLUON_AVAILABLE:
    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}


@functools.lru_cache(maxsize=None)
def _layout(box: tuple, dtype: torch.dtype):
    """Shared layout of a 4-D box (swizzle by the inner dimension's bytes: 128 B for D=128 FP8
    rows, 64-key FP8 rows and D=64 16-bit rows)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), _GL_DTYPES[dtype])


def _desc(t: torch.Tensor, box: tuple):
    return TensorDescriptor(t, list(t.shape), list(_tma_strides(t)), list(box), _layout(box, t.dtype))


def _num_sms(device: torch.device) -> int:
    """SMs of ``device`` (the persistent grid's size); 132 (H100 / H200 SXM) for a device that is not
    CUDA, where the launch is only ever compiled (the sm_90 compile tests)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _kernel_args(q8, k8, v8t, q_scale_inv, k_scale_inv, v_scale_inv, blk, out, lse, sink, softmax_scale: float,
                 win_right: int, cfg: GluonAttnFp8Config) -> tuple:
    """(grid, positional args, keyword args) of the launch for validated, non-empty inputs."""
    B, H, Sq, D = q8.shape
    Hk, Sk = k8.size(1), k8.size(2)
    n_m = -(-Sq // cfg.BLOCK_M)
    n_tiles = n_m * B * H
    qv, kv, vv = _views(q8, k8, v8t)
    if cfg.kperm:  # keys permuted inside each 32-key group by the descriptor's strides (see the kernel)
        k_box = (cfg.block_n // 16, 2, 4, 2, D)
        k_d = TensorDescriptor(k8, [B * Hk * Sk // 16, 2, 4, 2, D], [16 * D, 2 * D, 4 * D, D, 1], list(k_box),
                               _layout(k_box, k8.dtype))
    else:
        k_d = _desc(kv, (1, cfg.block_n, 1, D))
    args = (_desc(qv, (1, HALF_M, 1, D)), k_d, _desc(vv, (1, D, 1, cfg.block_n)),
            _desc(out, (1, HALF_M, 1, D)),
            q_scale_inv, k_scale_inv, v_scale_inv, lse, sink if sink is not None else lse,
            H, H // Hk, Sq, Sk, q_scale_inv.size(-1), k_scale_inv.size(-1), Sk - Sq, max(win_right, 0),
            float(softmax_scale) * LOG2E, n_tiles, n_m)
    kwargs = dict(HAS_RIGHT=win_right >= 0, HAS_SINK=sink is not None, STAGES=cfg.stages, BLK=int(blk),
                  P_SCALE=2.0 ** cfg.p_log2(), P_LOG2=cfg.p_log2(), CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs, PINGPONG=cfg.pingpong, KPERM=cfg.kperm, EMU=cfg.emu,
                  EMU_DEG=cfg.emu_deg, LAZY=cfg.lazy, LSUM=cfg.lsum, HEADS_FIRST=cfg.heads_first, NUM_WG=cfg.consumers,
                  PERSIST=cfg.persistent, SKIP=cfg.skip, Q2=cfg.q_double, num_warps=4)
    kwargs.update(cfg.launch_options())
    grid = (n_m, B * H)
    if cfg.heads_first:
        grid = (B * H, n_m)
    if cfg.persistent:
        grid = (min(n_tiles, _num_sms(q8.device)),)
    return grid, args, kwargs


def flash_attn_fp8_fwd_gluon(
    q8: torch.Tensor, k8: torch.Tensor, v8t: torch.Tensor, q_scale_inv: torch.Tensor, k_scale_inv: torch.Tensor,
    v_scale_inv: torch.Tensor, blk: int, sink: Optional[torch.Tensor], softmax_scale: float,
    win_left: int = -1, win_right: int = -1, out_dtype: torch.dtype = torch.bfloat16,
    config: Optional[GluonAttnFp8Config] = None, out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 attention forward on Hopper, with :func:`flash_attn_fp8_fwd_triton`'s arguments and results:
    ``q8 [B, Hq, Sq, D]``, ``k8 [B, Hk, Sk, D]``, ``v8t [B, Hk, D, Sk]`` E4M3 (D 64 or 128, Sk a multiple
    of 16) with their ``[B, H, ceil(S / blk)]`` fp32 multipliers (``blk`` 64, 128 or 256), sink fp32
    ``[Hq]`` or None, ``win_left`` -1, ``win_right`` -1 or >= 0 (causal: 0). Returns ``O [B, Sq, Hq, D]``
    in ``out_dtype`` (contiguous) and ``LSE [B, Hq, Sq]`` fp32, natural log. ``out`` / ``lse``: optional
    destinations of those shapes (``out`` with TMA-aligned strides, ``lse`` contiguous).

    Raises ValueError with :func:`gluon_attn_fp8_fwd_reason`'s text for inputs it does not take.

    Example::

        >>> args = (q8, k8, v8t, qs, ks, vs, 128, None, scale, -1, 0)  # causal
        >>> if gluon_attn_fp8_fwd_reason(*args) is None:
        ...     out, lse = flash_attn_fp8_fwd_gluon(*args)
    """
    reason = gluon_attn_fp8_fwd_reason(q8, k8, v8t, q_scale_inv, k_scale_inv, v_scale_inv, blk, sink, softmax_scale,
                                       win_left, win_right, out_dtype, config)
    if reason is not None:
        raise ValueError(f"flash_attn_fp8_fwd_gluon: {reason}")
    B, H, Sq, D = q8.shape
    out, lse = _outputs("flash_attn_fp8_fwd_gluon", out, lse, B, Sq, H, D, out_dtype, q8.device)
    if B == 0 or Sq == 0 or H == 0:
        return out, lse
    cfg = _fp8_config(D, blk, config, win_right, k8.size(2))
    grid, args, kwargs = _kernel_args(q8, k8, v8t, q_scale_inv, k_scale_inv, v_scale_inv, blk, out, lse, sink,
                                      softmax_scale, win_right, cfg)
    launch(_attn_fp8_fwd_ws_kernel, grid, args, kwargs, q8.device)
    return out, lse
