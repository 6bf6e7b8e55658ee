"""Hopper (sm_90) Gluon forward for softmax attention, warp-specialized (FlashAttention-3 ideas).

Same contract as ``flash_attn_fwd.py``'s :func:`flash_attn_fwd_triton` for the cases it takes:
``O = softmax(q k^T * scale [+ mask]) v`` in q's dtype and ``LSE`` fp32 ``[batch, heads_q, seq_q]``
in natural log (``+inf`` for a row that sees no key and has no sink), so the ``triton.language``
backward consumes this forward's O and LSE unchanged. Masks are bottom-right aligned
(``off = seq_k - seq_q``): query ``i`` sees key ``j`` iff ``j <= i + off + right`` when a right
bound is set (causal: ``right = 0``).

Algorithm: FlashAttention-2's online softmax (Dao 2023) laid out as FlashAttention-3 lays it out
on Hopper (Shah et al. 2024); the code is ours. One CTA owns ``128`` query rows of one
(batch, query head):

* warp specialization (``gl.warp_specialize``): one producer warp issues TMA loads: Q once (two
  64-row halves), then the K and V blocks into a STAGES-deep ring. K and V have separate
  ready/empty mbarriers because they are released at different times (K after ``S = Q K^T``, V
  after ``O += P V``, one iteration later); a shared slot would hold K for a whole extra
  iteration;
* two consumer warpgroups, 64 query rows each, run ``warpgroup_mma``. The two are independent
  instruction streams, so one's softmax overlaps the other's MMAs (the scheduler's ping-pong);
* inside a warpgroup the MMAs are software-pipelined: iteration ``j`` issues ``S_j = Q K_j^T``
  and then ``O += P_{j-1} V_{j-1}``, waits only for ``S_j`` (wgmma groups retire in order), runs
  the softmax of ``S_j`` while the PV MMA is still on the tensor cores, and only then waits for
  it and rescales ``O``. The row maximum of the scores is taken before scaling, so the exponent
  is one FMA (``exp2(s * scale * log2(e) - m)``). As written, ptxas hoists the PV wait above the
  softmax (the SASS has no exponential between the two waits), so the overlap is only in the
  source; config suffix ``o`` (opt-in, not yet timed) keeps it in the SASS with the FP8
  forward's fix, a wait on the already completed Q barrier before the PV wait;
* ``P`` goes to the PV MMA from registers (a wgmma A operand in the dot-operand layout of the
  accumulator, no shared-memory round trip);
* causal / right-bounded: the blocks past the diagonal are never loaded; only the blocks that
  cross the diagonal or the end of the keys run the mask arithmetic (a separate loop);
* epilogue: ``O / l`` is written through the Q buffer (no longer needed) with a TMA store that
  clips the rows past seq_q; the LSE with a masked store.

Operands are addressed by 4-D TMA descriptors over the logical ``[batch, seq, heads, dim]``
strides, so bshd, sbhd and bhsd storage all load in place, and the zero fill / clipping is per
dimension (a query or key block past the end of its sequence never reads another batch's rows).
TMA needs a unit head-dim stride and 16-byte aligned base and strides:
:func:`gluon_attn_fwd_reason` refuses anything else (and left windows, negative scales, fp32,
other head dims), and the caller runs the ``triton.language`` kernel instead.

Varlen (packed THD, :func:`flash_attn_varlen_fwd_gluon`, the contract of the tl
``flash_attn_varlen_fwd_triton``): the same producer / consumers (constexpr ``VARLEN``; the dense
kernel's code is unchanged) over the packed tensors viewed as ``[1, T, H, D]``, grid (query tiles of
``max_seqlen_q``, heads, documents). Each CTA reads its document's row ranges from the int32
``cu_seqlens`` on the device (no host sync) and exits when its tile starts past the document's end;
masks use the document's lengths (bottom-right aligned per document). A document's last key block,
when it would cross the document's end, is loaded shifted back so that the box ends exactly there
(start ``seq_k - BLOCK_N``: rows of the block before, or, for a document shorter than the block,
earlier rows or TMA's zeros before the tensor's start), and the softmax masks the keys outside
``[j * BLOCK_N, seq_k)`` (causal / window conditions on the true key index): no K / V row past a
document's end is read, so NaN / Inf past ``cu_seqlens_k[-1]`` (e.g. uninitialized padding) cannot
reach the output through ``0 * V``. A warpgroup's 64 O rows go out by TMA when they lie inside the
document, else by masked 16-byte stores from the staged tile (TMA would clip only at the tensor's
end); the LSE ``[H, T]`` with a masked store. Rows no document owns get ``O = 0``, ``LSE = +inf``
from a small tl kernel launched first.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional

import torch

from primus_turbo.triton.gemm.gemm_fp8_gluon import GLUON_AVAILABLE, SMEM_LIMIT, gluon_platform_reason
from primus_turbo.triton.launch import launch
from primus_turbo.triton import cdiv

__all__ = [
    "GLUON_ATTN_ENV",
    "GLUON_ATTN_VARLEN_ENV",
    "GluonAttnConfig",
    "default_attn_config",
    "flash_attn_fwd_gluon",
    "flash_attn_varlen_fwd_gluon",
    "gluon_attn_fwd_reason",
    "gluon_attn_operand_reason",
    "gluon_attn_varlen_fwd_reason",
    "gluon_attn_varlen_operand_reason",
    "use_gluon_attn_fwd",
    "use_gluon_attn_varlen_fwd",
]

GLUON_ATTN_ENV = "PRIMUS_TURBO_ATTN_FWD_GLUON"
GLUON_ATTN_VARLEN_ENV = "PRIMUS_TURBO_ATTN_VARLEN_GLUON"
LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)
HALF_M = 64  # query rows per consumer warpgroup (one m64 wgmma)
#: CUDA's limit on the grid's y and z axes (varlen: query heads / documents; heads-fastest: query tiles)
_MAX_GRID_YZ = 65535

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
    import triton
    import triton.language as tl

    # the tl FP8 kernel's exp2 on the FMA pipe (arithmetic and bit casts only: it compiles in a
    # Gluon caller as it is; one polynomial table for the tl and both Gluon forwards)
    from .flash_attn_fp8 import _exp2_fma


@dataclasses.dataclass(frozen=True)
class GluonAttnConfig:
    """Tile and pipeline shape. BLOCK_M is ``consumers`` warpgroups of 64 rows (2, or 3 as
    FlashAttention-3 runs head dim 64: a third instruction stream to hide the softmax under the
    others' MMAs); ``block_n`` keys per iteration; ``stages`` K (and V) buffers in the ring.
    ``consumer_regs`` / ``producer_regs``: setmaxnreg budgets; consumers x 128 x consumer + 128 x
    producer must fit 65536. ``pingpong`` (2 consumers only): the two
    consumer warpgroups take turns issuing their MMAs. ``overlap``: a wait on the (already
    completed) Q barrier right before the PV wait of each loop iteration splits the basic block, so
    ptxas cannot hoist that wait above the softmax and the exponentials run under the PV MMA (off:
    the shipped SASS, where they do not)."""

    block_n: int = 128
    stages: int = 2
    consumer_regs: int = 240
    producer_regs: int = 24
    pingpong: bool = False
    overlap: bool = False
    consumers: int = 2
    emu: int = 0
    emu_deg: int = 3
    lazy: int = 0
    skip: bool = False
    heads_fastest: bool = False

    @property
    def BLOCK_M(self) -> int:  # noqa: N802 - the kernels' name for it
        return self.consumers * HALF_M

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        q = self.BLOCK_M * head_dim * elem_bytes
        kv = 2 * self.stages * self.block_n * head_dim * elem_bytes
        return q + kv + 8 * (2 * 2 * self.stages + 3) + 1024  # + barriers, + the swizzle alignment

    def short(self) -> str:
        flags = ('p' if self.pingpong else '') + ('o' if self.overlap else '')
        wgs = f"c{self.consumers}" if self.consumers != 2 else ""
        if self.emu:
            wgs += f"e{self.emu}" + (f"d{self.emu_deg}" if self.emu_deg != 3 else "")
        if self.lazy:
            wgs += f"z{self.lazy}"
        wgs += ("j" if self.skip else "") + ("g" if self.heads_fastest else "")
        return f"n{self.block_n}s{self.stages}{flags}{wgs}r{self.consumer_regs}w{self.producer_regs}"

    @classmethod
    def parse(cls, text: str) -> "GluonAttnConfig":
        """``"n128s2"``, ``"n128s2p"``, ``"n128s2o"``, ``"n128s2po"``, ``"n64s4r232w40"``, ``"n128s3c3"``
        -> config (n: block_n, s: stages, p: ping-pong between the consumer warpgroups, o: the
        softmax kept under the PV MMA in the SASS (``overlap``), c: consumer warpgroups (default 2),
        e<N>: 1/N of the exponentials of the unmasked key blocks on the FMA pipe (N 2, 4 or 8; ``d<deg>``
        the polynomial's degree, 2-5, default 3: relative error 7.5e-5, under bf16's 3.9e-3), z<T>:
        conditional rescaling of O (``lazy``, T 1-4: a row's reference maximum moves only when the
        row maximum passes it by more than T, so P stays <= 2**T and a warp whose rows kept their
        reference skips the O multiplies), j: each warpgroup stops at its own rows' last visible key
        block (``skip``: a causal tile's lower warpgroups, and a warpgroup whose rows all lie past the
        sequence, release the tile's later K / V blocks without computing them), g: heads-fastest
        grid (``heads_fastest``: the CTAs in flight are one query tile of many heads, so causal runs
        the longest tiles of every head first), r / w: consumer / producer registers per thread; with
        ``c3`` the consumer default is 160, what three warpgroups and the producer's 24 leave)."""
        m = re.fullmatch(r"n(\d+)s(\d+)(p)?(o)?(?:c(\d+))?(?:e(\d+)(?:d(\d+))?)?(?:z(\d+))?(j)?(g)?(?:r(\d+))?"
                         r"(?:w(\d+))?", text.strip())
        if not m:
            raise ValueError(f"bad Gluon attention config {text!r}; expected e.g. n128s2, n128s2p, n128s2o, n128s2po, "
                             f"n128s3c3, n128s3e4, n64s4r232w40")
        bn, st, pp, ov, c, emu, deg, lz, sk, hf, r, w = m.groups()
        wgs = int(c or 2)
        return cls(int(bn), int(st), int(r or (240 if wgs == 2 else 160)), int(w or 24), bool(pp), bool(ov), wgs,
                   int(emu or 0), int(deg or 3), int(lz or 0), skip=bool(sk), heads_fastest=bool(hf))

    def check(self, head_dim: int) -> Optional[str]:
        if self.block_n not in (64, 128):  # Gluon tensors are power-of-two sized; 256 needs 128 S registers
            return f"block_n must be 64 or 128, got {self.block_n}"
        if self.stages < 1:
            return f"stages must be >= 1, got {self.stages}"
        if any(r % 8 or not 24 <= r <= 256 for r in (self.consumer_regs, self.producer_regs)):
            return f"setmaxnreg counts must be multiples of 8 in [24, 256], got {self.consumer_regs}, {self.producer_regs}"
        if self.consumers not in (2, 3):
            return f"consumers must be 2 or 3 warpgroups, got {self.consumers}"
        if self.emu not in (0, 2, 4, 8) or not 2 <= self.emu_deg <= 5:
            return f"emu must be 0, 2, 4 or 8 and emu_deg 2..5, got e{self.emu}d{self.emu_deg}"
        if not 0 <= self.lazy <= 4:
            return f"z{self.lazy}: the conditional-rescale threshold is 1 to 4 (log2 units)"
        if self.pingpong and self.consumers != 2:
            return "ping-pong (p) takes exactly 2 consumer warpgroups"
        if self.pingpong and self.skip:
            return "j (per-warpgroup key extent) does not take p: ping-pong turns need equal MMA counts"
        if self.consumers * 128 * self.consumer_regs + 128 * self.producer_regs > 65536:
            return (f"registers: {self.consumers} x 128 x {self.consumer_regs} + 128 x {self.producer_regs} "
                    f"> 65536")
        if self.smem_bytes(head_dim) > SMEM_LIMIT:
            return f"config {self.short()} needs {self.smem_bytes(head_dim)} bytes of shared memory at D={head_dim}"
        return None


#: per (head dim, causal). D=128: two 32 KB K/V stages next to the 32 KB Q tile (160 KB); D=64 has
#: room for three. D=64: three consumer warpgroups (192-row tiles, a third instruction stream to hide
#: the softmax, whose exponentials take as long as the MMAs at this head dim) with ``j``, each
#: warpgroup stopping at its own rows' last key block: without it a causal 192-row tile computes
#: ~18% more blocks than the 128-row one (the lower warpgroups' blocks past their diagonal) and lost
#: to two warpgroups (GPT-OSS 64/8 heads, 8 x 2048 varlen causal: 266 vs 308 TFLOP/s); with it the
#: work is the 128-row tile's. H200 device time (CUDA-graph replay, session 29,
#: benchmarks/results/h200/session29/): that causal pack 302 (j), 345-348 (j + heads-fastest grid)
#: against the per-document cuDNN loop's 343-345 and the tl kernel's 315; full 441-442 against
#: 442-443; dense 32/32 heads causal 407 / 417 at seq 4096 / 16384 (tl 371 / 409, two warpgroups
#: 367 / 427). D=128: two warpgroups; the varlen kernel takes ``j`` too (its documents' partial
#: tiles and unaligned diagonals: 32/8 heads, causal +1.5-8% over the plain config on five packs,
#: full +2-4% on three of four), the dense one keeps the plain config (a square dense tile's
#: warpgroups see the same blocks).
_DEFAULT_CONFIGS = {(64, False): GluonAttnConfig(block_n=128, stages=3, consumer_regs=160, consumers=3, skip=True),
                    (64, True): GluonAttnConfig(block_n=128, stages=3, consumer_regs=160, consumers=3, skip=True),
                    (128, False): GluonAttnConfig(block_n=128, stages=2),
                    (128, True): GluonAttnConfig(block_n=128, stages=2)}

#: query heads per kv head from which the head-dim-64 default takes the heads-fastest grid (``g``):
#: the CTAs in flight are one query tile of many heads, so the ``group`` of them that share a kv head
#: read the same K / V blocks together (GPT-OSS 64/8 heads: dense 2048 / 8192 full 458 / 476 against
#: 437 / 468 without it; varlen causal 345 against 302). Without GQA the grid keeps the query tiles
#: fastest: each head's tiles then share its K / V (32/32 heads, dense full: 429 / 459 with ``g``
#: against 450 / 471; head dim 128, dense: -10 to -16%).
HEADS_FASTEST_MIN_GROUP = 4


def _fit_grid(cfg: GluonAttnConfig, seq_q: int) -> GluonAttnConfig:
    """A default config whose heads-fastest grid would put more than 65535 query tiles of ``seq_q``
    rows on the grid's y axis takes the query-tiles-fastest grid instead (an explicit config raises)."""
    if cfg.heads_fastest and -(-seq_q // cfg.BLOCK_M) > _MAX_GRID_YZ:
        return dataclasses.replace(cfg, heads_fastest=False)
    return cfg


def default_attn_config(head_dim: int, causal: bool = False, group: int = 1, varlen: bool = False) -> GluonAttnConfig:
    """The default tile config for ``head_dim`` (64 or 128); ``causal``: any right bound (the
    kernel's ``win_right >= 0``); ``group``: query heads per kv head (GQA), which picks the grid
    order at head dim 64 (:data:`HEADS_FASTEST_MIN_GROUP`); ``varlen``: for the packed kernel
    (``j`` at every head dim)."""
    cfg = _DEFAULT_CONFIGS[(head_dim, bool(causal))]
    if varlen and not cfg.skip:
        cfg = dataclasses.replace(cfg, skip=True)
    if head_dim == 64 and group >= HEADS_FASTEST_MIN_GROUP:
        cfg = dataclasses.replace(cfg, heads_fastest=True)
    return cfg


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
if GLUON_AVAILABLE:

    @gluon.jit
    def _tile(H, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, M_AXIS: gl.constexpr = 0, VARLEN: gl.constexpr = False):
        """(pid_m, b, h, number of key blocks the tile's rows can see). Causal tiles run the
        longest rows first (the query-tile grid axis reversed) so the short ones fill the tail; at
        least one block is visited (fully masked when the rows see nothing) so the producer and
        the consumers agree on the count without a special case. ``M_AXIS``: the grid axis of the
        query tiles, the other one is batch * head (1: the FP8 forward's heads-fastest grid).
        ``VARLEN``: the grid is (query tiles, heads, documents) (``M_AXIS`` 1: (heads, query tiles,
        documents)), ``b`` the document, and SEQ_Q / SEQ_K / offset are that document's."""
        pid_m = gl.program_id(M_AXIS)
        if HAS_RIGHT:
            pid_m = gl.num_programs(M_AXIS) - 1 - pid_m
        if VARLEN:
            b = gl.program_id(2)
            h = gl.program_id(1 - M_AXIS)
        else:
            pid_bh = gl.program_id(1 - M_AXIS)
        hi = SEQ_K
        if HAS_RIGHT:
            hi = gl.minimum(pid_m * BLOCK_M + BLOCK_M + offset + win_right, SEQ_K)
        n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
        if not VARLEN:
            b = pid_bh // H
            h = pid_bh % H
        return pid_m, b, h, n_blocks

    @gluon.jit
    def _own_blocks(m0, n_blocks, SEQ_Q, SEQ_K, diag, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                    HAS_RIGHT: gl.constexpr, SKIP: gl.constexpr):
        """``(n_full, n_own)`` of a consumer warpgroup (rows ``m0 .. m0 + HALF - 1``): it computes the
        key blocks ``[0, n_own)`` of its tile's ``n_blocks``, all of them or (``SKIP``, config ``j``)
        those its own rows can see (at least block 0, so the peeled first block and the last PV
        always exist; block 0 only when every row lies past SEQ_Q, whose results are never stored),
        and blocks ``[0, n_full)`` are whole and below the diagonal for every one of its rows."""
        n_own = n_blocks
        if SKIP:
            if HAS_RIGHT:
                n_own = gl.minimum(gl.maximum(gl.cdiv(gl.minimum(m0 + HALF + diag, SEQ_K), BLOCK_N), 1), n_blocks)
            if m0 >= SEQ_Q:
                n_own = 1
        n_full = SEQ_K // BLOCK_N
        if HAS_RIGHT:
            n_full = gl.minimum(n_full, gl.maximum(m0 + diag + 1, 0) // BLOCK_N)
        return gl.minimum(n_full, n_own), n_own

    @gluon.jit
    def _release_blocks(j0, j1, it, k_ready, k_empty, v_ready, v_empty, STAGES: gl.constexpr):
        """Config ``j``: the ring slots of key blocks ``[j0, j1)`` (the CTA's blocks ``it + j``) given
        back unread. Each waits for its slot's data first, so the arrival lands in that use's phase of
        the empty barrier, never in the previous use's, which the other warpgroups may still read."""
        for j in range(j0, j1):
            sj = (it + j) % STAGES
            mbarrier.wait(k_ready.index(sj), ((it + j) // STAGES) & 1)
            mbarrier.arrive(k_empty.index(sj), count=1)
            mbarrier.wait(v_ready.index(sj), ((it + j) // STAGES) & 1)
            mbarrier.arrive(v_empty.index(sj), count=1)

    @gluon.jit
    def _key_start(j, SEQ_K, BLOCK_N: gl.constexpr):
        """Varlen: the first key (relative to the document) of the box loaded for key block ``j``:
        ``j * BLOCK_N``, or ``SEQ_K - BLOCK_N`` (possibly negative) when the block would cross the
        document's end, so that the box ends there (the producer and the consumers agree through
        this one function; the softmax masks the keys before ``j * BLOCK_N``)."""
        return gl.minimum(j * BLOCK_N, SEQ_K - BLOCK_N)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                  H, GROUP, SEQ_Q, SEQ_K, offset, win_right,
                  HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  V_KEYS_INNER: gl.constexpr = False, Q_ROW0=0, K_ROW0=0, VARLEN: gl.constexpr = False,
                  NUM_WG: gl.constexpr = 2, M_AXIS: gl.constexpr = 0):
        """One warp: Q's two halves once, then K_j and V_j into ring slot ``j % STAGES``.
        ``V_KEYS_INNER``: v_desc is over V^T viewed as [B, D, H, S] (the FP8 forward's V copy, keys
        contiguous for the K-major FP8 MMA operand), so a key block is the box's inner dimension.
        ``VARLEN``: the descriptors are over the packed [1, T, H, D] tensors and the document's rows
        start at ``Q_ROW0`` / ``K_ROW0``. A key block that would cross the document's end
        (``(j + 1) * BLOCK_N > SEQ_K``) is loaded shifted back to end exactly there (box start
        ``SEQ_K - BLOCK_N``, :func:`_key_start`; earlier rows, masked by the consumers, or zeros
        before the tensor's start), so no K / V row past the document's end is read; a Q block past
        it reads the next document's rows (or zeros), which are never stored. ``NUM_WG``: consumer
        warpgroups, one 64-row Q part each. ``M_AXIS``: the query tiles' grid axis (:func:`_tile`)."""
        HALF: gl.constexpr = q_desc.block_type.shape[1]
        pid_m, b, h, n_blocks = _tile(H, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT, NUM_WG * HALF, BLOCK_N, M_AXIS,
                                      VARLEN)
        hk = h // GROUP
        m0 = pid_m * (NUM_WG * HALF)
        if VARLEN:
            bq = 0
            mq = Q_ROW0 + m0
        else:
            bq = b
            mq = m0
        # rows past seq_q arrive zero-filled and still count their full box bytes
        mbarrier.expect(q_bar, NUM_WG * q_desc.block_type.nbytes)
        for w in gl.static_range(NUM_WG):
            tma.async_copy_global_to_shared(q_desc, [bq, mq + w * HALF, h, 0], q_bar, q_smem.index(w))
        for j in range(n_blocks):
            s = j % STAGES
            phase = ((j // STAGES) & 1) ^ 1  # empty barriers start one phase behind: no wait on the first lap
            if VARLEN:
                bk = 0
                nk = K_ROW0 + _key_start(j, SEQ_K, BLOCK_N)
            else:
                bk = b
                nk = j * BLOCK_N
            mbarrier.wait(k_empty.index(s), phase)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [bk, nk, hk, 0], k_ready.index(s), k_bufs.index(s))
            mbarrier.wait(v_empty.index(s), phase)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            if V_KEYS_INNER:
                tma.async_copy_global_to_shared(v_desc, [bk, 0, hk, nk], v_ready.index(s), v_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(v_desc, [bk, nk, hk, 0], v_ready.index(s), v_bufs.index(s))

    @gluon.jit
    def _split_top(x):
        """[M, N] -> the halves of the top column bit (a register bit of a wgmma accumulator)."""
        HM: gl.constexpr = x.type.shape[0]
        N: gl.constexpr = x.type.shape[1]
        return gl.split(gl.permute(gl.reshape(x, [HM, 2, N // 2]), [0, 2, 1]))

    @gluon.jit
    def _join_top(a, b):
        HM: gl.constexpr = a.type.shape[0]
        N: gl.constexpr = a.type.shape[1]
        b = gl.convert_layout(b, a.type.layout, assert_trivial=True)  # equal layouts, different types
        return gl.reshape(gl.permute(gl.join(a, b), [0, 2, 1]), [HM, 2 * N])

    @gluon.jit
    def _exp2_mixed(x, EMU: gl.constexpr, DEG: gl.constexpr):
        """``2**x`` with 1/EMU of the elements (EMU 0: none) on the FMA pipe (:func:`_exp2_fma`), the
        rest on MUFU.EX2. The split is over column bits a thread holds in registers (bit 0, then the
        top ones), so splitting and joining move no data; the result has x's layout."""
        if EMU == 0:
            return gl.exp2(x)
        else:
            HM: gl.constexpr = x.type.shape[0]
            N: gl.constexpr = x.type.shape[1]
            a, b = gl.split(gl.reshape(x, [HM, N // 2, 2]))
            a = gl.exp2(a)
            if EMU == 2:
                b = _exp2_fma(b, DEG)
            else:
                b0, b1 = _split_top(b)
                b0 = gl.exp2(b0)
                if EMU == 4:
                    b1 = _exp2_fma(b1, DEG)
                else:
                    b10, b11 = _split_top(b1)
                    b1 = _join_top(gl.exp2(b10), _exp2_fma(b11, DEG))
                b = _join_top(b0, b1)
            b = gl.convert_layout(b, a.type.layout, assert_trivial=True)
            y = gl.reshape(gl.join(a, b), [HM, N])
            return gl.convert_layout(y, x.type.layout, assert_trivial=True)

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, offs_m, n0, SEQ_K, diag, dtype: gl.constexpr, p_layout: gl.constexpr,
                 HAS_RIGHT: gl.constexpr, MASKED: gl.constexpr, ROW_SCALE: gl.constexpr = False,
                 P_LOG2: gl.constexpr = 0.0, N_LO=0, VARLEN: gl.constexpr = False, EMU: gl.constexpr = 0,
                 EMU_DEG: gl.constexpr = 3, LAZY: gl.constexpr = 0):
        """One key block of the online softmax on raw scores ``s`` (base 2, scale folded into the
        exponent's FMA). ``MASKED``: keys past SEQ_K and (HAS_RIGHT) past ``row + diag`` are out;
        a row that has seen no key keeps ``m = -inf`` and gets ``p = 0``, ``alpha = 0``.
        ``ROW_SCALE``: ``qk_scale`` is one positive value per row (the FP8 forward's q and k
        dequantization scales times ``scale * log2(e)``), else a scalar. ``P_LOG2``: P comes out
        multiplied by ``2**P_LOG2`` (the FP8 forward's static P scale, folded into the exponent), and
        so does ``l``. ``VARLEN`` (MASKED): column ``c`` is key ``n0 + c`` (``n0``: the block's possibly
        shifted start, :func:`_key_start`) and keys before ``N_LO`` (the block's nominal start, already
        seen by the previous block) are out as well. ``EMU`` / ``EMU_DEG`` (unmasked blocks only,
        whose scores are finite): 1/EMU of the exponentials on the FMA pipe (:func:`_exp2_mixed`).
        ``LAZY``: the reference maximum moves only when the row maximum passes it by more than LAZY
        (then P <= 2**LAZY, exact in 16 bits, and alpha is exactly 1 where it did not move).
        Returns (P in the PV MMA's A-operand layout, m, l, alpha)."""
        BLOCK_N: gl.constexpr = s.type.shape[1]
        if MASKED:
            offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
            if VARLEN:
                ok = gl.expand_dims((offs_n >= N_LO) & (offs_n < SEQ_K), 0)
            else:
                ok = gl.expand_dims(offs_n < SEQ_K, 0)
            if HAS_RIGHT:
                ok = ok & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m + diag, 1))
            s = gl.where(ok, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        if LAZY:
            m_new = gl.where(m_new > m_i + LAZY, m_new, m_i)
        if MASKED:
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        if ROW_SCALE:
            sc = gl.expand_dims(qk_scale, 1)
        else:
            sc = qk_scale
        if P_LOG2 != 0.0:
            m_exp = m_safe - P_LOG2
        else:
            m_exp = m_safe
        if MASKED:
            p = gl.exp2(s * sc - gl.expand_dims(m_exp, 1))
        else:
            p = _exp2_mixed(s * sc - gl.expand_dims(m_exp, 1), EMU, EMU_DEG)
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 1)
        p = gl.convert_layout(p.to(dtype), p_layout)
        return p, m_new, l_i, alpha

    @gluon.constexpr_function
    def _lazy_asm(pk):
        """PTX of :func:`_rescale`'s LAZY path for ``pk`` accumulator registers (``$0..``, tied to
        the inputs), their factors and the warp's vote (the first of its copies): a uniform branch
        around the multiplies. ``${:uid}`` makes the label unique per asm instance."""
        muls = "".join(f"mul.f32 ${i}, ${i}, ${2 * pk + i};\n" for i in range(pk))
        return ("{\n.reg .pred p;\nsetp.ne.u32 p, $" + str(3 * pk) + ", 0;\n@!p bra.uni SKIP${:uid};\n" + muls
                + "SKIP${:uid}:\n}")

    @gluon.constexpr_function
    def _lazy_constraints(pk):
        return ",".join(["=f"] * pk + [str(i) for i in range(pk)] + ["f"] * pk + ["r"] * pk)

    @gluon.jit
    def _rescale(acc, factor, o_layout: gl.constexpr, LAZY: gl.constexpr):
        """``acc * factor`` (one factor per row). LAZY: a warp whose rows all have factor 1 (no
        row's reference moved and, in the FP8 forward, the same V scale) skips the multiplies: a warp vote, then a uniform branch
        around the FMULs of each 16 accumulator registers (the rows a thread holds are its
        two-element row fragment, voted on as one pack)."""
        f = gl.convert_layout(factor, gl.SliceLayout(1, o_layout))
        if LAZY:
            need = gl.inline_asm_elementwise(
                """{
                .reg .pred p, q;
                setp.neu.f32 p, $2, 0f3F800000;
                setp.neu.f32 q, $3, 0f3F800000;
                or.pred p, p, q;
                vote.sync.any.pred p, p, 0xffffffff;
                selp.u32 $0, 1, 0, p;
                mov.u32 $1, $0;
                }""", "=r,=r,f,f", [f], dtype=gl.int32, is_pure=True, pack=2)
            PK: gl.constexpr = 16
            return gl.inline_asm_elementwise(_lazy_asm(PK), _lazy_constraints(PK),
                                             [acc, gl.expand_dims(f, 1), gl.expand_dims(need, 1)],
                                             dtype=gl.float32, is_pure=True, pack=PK)
        else:
            return acc * gl.expand_dims(f, 1)

    @gluon.jit
    def _take_turn(turn, c, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """PINGPONG: before its c-th batch of MMAs, a warpgroup waits until the other one has issued
        its own batch (WG 1 its c-th, WG 0 its (c-1)-th; WG 0's first wait passes: the barrier
        starts one phase behind), so the two warpgroups' MMAs alternate on the tensor cores and
        each one's softmax runs under the other's MMAs (FlashAttention-3's ping-pong schedule)."""
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (c & 1) ^ (1 - WG))

    @gluon.jit
    def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)

    @gluon.jit
    def _step(j, q, q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn, s_regs, acc, p, m_i, l_i,
              qk_scale, offs_m, SEQ_K, diag, o_layout: gl.constexpr, p_layout: gl.constexpr,
              HAS_RIGHT: gl.constexpr, MASKED: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
              PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, VARLEN: gl.constexpr = False,
              EMU: gl.constexpr = 0, EMU_DEG: gl.constexpr = 3, LAZY: gl.constexpr = 0):
        """Iteration j >= 1: issue S_j, issue O += P_{j-1} V_{j-1}, softmax S_j while the PV MMA
        runs, then retire it and rescale O by this block's alpha. ``VARLEN`` and ``MASKED``: block j
        may be the document's last, loaded shifted back (:func:`_key_start`); the unmasked blocks lie
        inside the document and never are."""
        BLOCK_N: gl.constexpr = s_regs.type.shape[1]
        s = j % STAGES
        sp = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
        _take_turn(turn, j, WG, PINGPONG)
        s_tok = warpgroup_mma(q, k_bufs.index(s).reshape([BLOCK_N, q.type.shape[1]]).permute((1, 0)), s_regs,
                              use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p, v_bufs.index(sp).reshape([BLOCK_N, acc.type.shape[1]]), acc, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        # wgmma groups retire in order: waiting down to one outstanding is S_j done, PV still running
        s_regs = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(s), count=1)
        if VARLEN and MASKED:
            p_new, m_i, l_i, alpha = _softmax(s_regs, m_i, l_i, qk_scale, offs_m, _key_start(j, SEQ_K, BLOCK_N), SEQ_K,
                                              diag, q.dtype, p_layout, HAS_RIGHT, MASKED, False, 0.0, j * BLOCK_N,
                                              True, 0, 3, LAZY)
        else:
            p_new, m_i, l_i, alpha = _softmax(s_regs, m_i, l_i, qk_scale, offs_m, j * BLOCK_N, SEQ_K, diag, q.dtype,
                                              p_layout, HAS_RIGHT, MASKED, False, 0.0, 0, False, EMU, EMU_DEG, LAZY)
        if OVERLAP:
            # ptxas hoists a wgmma wait as high as it can (here: above the exponentials), and the
            # PV MMA no longer overlaps the softmax. A wait on an mbarrier that has already
            # completed (Q's) is a try_wait loop in the PTX: a basic-block boundary ptxas does not
            # move the PV wait across (the FP8 forward's fix, flash_attn_fp8_fwd_gluon._fp8_step)
            mbarrier.wait(q_bar, 0)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p))
        mbarrier.arrive(v_empty.index(sp), count=1)
        acc = _rescale(acc, alpha, o_layout, LAZY)
        return s_regs, acc, p_new, m_i, l_i

    @gluon.jit
    def _store_rows(tile, O, Q_ROW0, m0, SEQ_Q, h, stride_os, stride_oh):
        """Rows ``m0 + i < SEQ_Q`` of the staged [HALF, D] O tile (shared memory) to packed O rows
        ``Q_ROW0 + m0 + i`` of head ``h``: 16-byte vectors, a row mask (the varlen epilogue of a
        warpgroup's half that crosses its document's end)."""
        HALF: gl.constexpr = tile.type.shape[0]
        D: gl.constexpr = tile.type.shape[1]
        COLS: gl.constexpr = D // 8  # threads along a row, 8 elements (16 bytes) each
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // COLS, COLS], [4, 1], [1, 0])
        vals = tile.load(layout)
        rows = m0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        offs = (gl.expand_dims((Q_ROW0 + rows).to(gl.int64) * stride_os, 1) + h.to(gl.int64) * stride_oh
                + gl.expand_dims(cols, 0))
        ok = gl.expand_dims(rows < SEQ_Q, 1) & gl.expand_dims(cols < D, 0)
        gl.store(O + offs, vals, mask=ok)

    @gluon.jit
    def _consumer(o_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turn, LSE, SINK,
                  H, GROUP, SEQ_Q, SEQ_K, offset, win_right, qk_scale,
                  WG: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, PINGPONG: gl.constexpr, OVERLAP: gl.constexpr,
                  O=0, stride_os=0, stride_oh=0, stride_lh=0, Q_ROW0=0, VARLEN: gl.constexpr = False,
                  NUM_WG: gl.constexpr = 2, EMU: gl.constexpr = 0, EMU_DEG: gl.constexpr = 3,
                  LAZY: gl.constexpr = 0, SKIP: gl.constexpr = False, M_AXIS: gl.constexpr = 0):
        """One warpgroup: query rows [WG*64, WG*64+64) of the tile. ``VARLEN``: SEQ_Q / SEQ_K /
        offset are the document's, its rows start at ``Q_ROW0`` of the packed O ``[T, H, D]``
        (pointer ``O``, row / head strides) and LSE ``[H, T]`` (head stride ``stride_lh``).
        ``SKIP``: the warpgroup computes only the key blocks its own rows can see (``n_own`` of the
        tile's ``n_blocks``: a causal tile's lower warpgroups see fewer blocks than its last rows,
        and a warpgroup whose rows all lie past SEQ_Q needs none, so it runs block 0 only, whose
        results are never stored) and releases the rest of the tile's ring slots unread, so that
        the warpgroups still computing get the SM's tensor and MUFU issue slots."""
        HALF: gl.constexpr = o_desc.block_type.shape[1]
        D_QK: gl.constexpr = q_smem.type.shape[4]
        D_V: gl.constexpr = o_desc.block_type.shape[3]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D_V, 16])
        # P as the A operand of O += P V straight from registers: the fp32 accumulator fragment
        # of S_j is, element for element, the 16-bit A fragment of the next wgmma (k_width 2)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        pid_m, b, h, n_blocks = _tile(H, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT, NUM_WG * HALF, BLOCK_N, M_AXIS,
                                      VARLEN)
        m0 = pid_m * (NUM_WG * HALF) + WG * HALF
        offs_m = m0 + gl.arange(0, HALF, layout=row_layout)
        diag = offset + win_right
        n_full, n_own = _own_blocks(m0, n_blocks, SEQ_Q, SEQ_K, diag, HALF, BLOCK_N, HAS_RIGHT, SKIP)

        if HAS_SINK:  # the sink joins the denominator only: start at m = sink (base 2), l = 1
            sink_log2 = gl.load(SINK + h).to(gl.float32) * 1.4426950408889634
            m_i = gl.full([HALF], 0.0, gl.float32, row_layout) + sink_log2
            l_i = gl.full([HALF], 1.0, gl.float32, row_layout)
        else:
            m_i = gl.full([HALF], float("-inf"), gl.float32, row_layout)
            l_i = gl.full([HALF], 0.0, gl.float32, row_layout)

        mbarrier.wait(q_bar, 0)
        q = q_smem.index(WG).reshape([HALF, D_QK])
        # block 0, peeled (always with the mask: it may be the only one, and partly masked)
        s_regs = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(k_ready.index(0), 0)
        _take_turn(turn, 0, WG, PINGPONG)
        s_tok = warpgroup_mma(q, k_bufs.index(0).reshape([BLOCK_N, D_QK]).permute((1, 0)), s_regs,
                              use_acc=False, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        s_regs = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(0), count=1)
        if VARLEN:  # block 0 is the document's last when SEQ_K <= BLOCK_N: loaded shifted back
            p, m_i, l_i, alpha = _softmax(s_regs, m_i, l_i, qk_scale, offs_m, _key_start(0, SEQ_K, BLOCK_N), SEQ_K,
                                          diag, dtype, p_layout, HAS_RIGHT, True, False, 0.0, 0, True, 0, 3, LAZY)
        else:
            p, m_i, l_i, alpha = _softmax(s_regs, m_i, l_i, qk_scale, offs_m, 0, SEQ_K, diag, dtype, p_layout,
                                          HAS_RIGHT, True, False, 0.0, 0, False, 0, 3, LAZY)
        acc = gl.zeros([HALF, D_V], gl.float32, o_layout)
        for j in range(1, n_full):
            s_regs, acc, p, m_i, l_i = _step(j, q, q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn,
                                             s_regs, acc, p, m_i, l_i, qk_scale, offs_m, SEQ_K, diag, o_layout,
                                             p_layout, HAS_RIGHT, False, STAGES, WG, PINGPONG, OVERLAP, False, EMU,
                                             EMU_DEG, LAZY)
        for j in range(gl.maximum(n_full, 1), n_own):
            s_regs, acc, p, m_i, l_i = _step(j, q, q_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn,
                                             s_regs, acc, p, m_i, l_i, qk_scale, offs_m, SEQ_K, diag, o_layout,
                                             p_layout, HAS_RIGHT, True, STAGES, WG, PINGPONG, OVERLAP, VARLEN, 0, 3,
                                             LAZY)
        # the last block's PV
        sl = (n_own - 1) % STAGES
        mbarrier.wait(v_ready.index(sl), ((n_own - 1) // STAGES) & 1)
        _take_turn(turn, n_own, WG, PINGPONG)
        o_tok = warpgroup_mma(p, v_bufs.index(sl).reshape([BLOCK_N, D_V]), acc, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p))
        mbarrier.arrive(v_empty.index(sl), count=1)
        if SKIP:
            _release_blocks(n_own, n_blocks, 0, k_ready, k_empty, v_ready, v_empty, STAGES)

        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe)) / 1.4426950408889634)
        if VARLEN:
            gl.store(LSE + h.to(gl.int64) * stride_lh + (Q_ROW0 + offs_m), lse, mask=offs_m < SEQ_Q)
        else:
            gl.store(LSE + (b * H + h).to(gl.int64) * SEQ_Q + offs_m, lse, mask=offs_m < SEQ_Q)
        out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
        # this warpgroup's Q half is dead (its last S MMA has retired): stage O there for the TMA
        # store, which clips the rows past seq_q
        o_smem = q_smem.index(WG)
        o_smem.reshape([HALF, D_V]).store(out.to(dtype))
        if VARLEN:
            # the TMA store clips only at the packed tensor's end: a half that crosses the document's
            # end (its rows past it are the next document's) goes out through masked stores
            if m0 + HALF <= SEQ_Q:
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [0, Q_ROW0 + m0, h, 0], o_smem)
                tma.store_wait(pendings=0)
            else:
                _store_rows(o_smem.reshape([HALF, D_V]), O, Q_ROW0, m0, SEQ_Q, h, stride_os, stride_oh)
        else:
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [b, m0, h, 0], o_smem)
            tma.store_wait(pendings=0)

    @gluon.jit
    def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, offset, win_right, qk_scale,
                     HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr, STAGES: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
                     OVERLAP: gl.constexpr, O=0, stride_os=0, stride_oh=0, stride_lh=0, Q_ROW0=0, K_ROW0=0,
                     VARLEN: gl.constexpr = False, NUM_WG: gl.constexpr = 2, EMU: gl.constexpr = 0,
                     EMU_DEG: gl.constexpr = 3, LAZY: gl.constexpr = 0, SKIP: gl.constexpr = False,
                     M_AXIS: gl.constexpr = 0):
        """The body of both kernels: shared memory, barriers, producer warp + ``NUM_WG`` (2 or 3)
        consumer warpgroups (``VARLEN``: one document's tile, the varlen arguments as
        :func:`_consumer`'s; ``SKIP`` as :func:`_consumer`'s; ``M_AXIS`` the query tiles' grid axis)."""
        HALF: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
        D_QK: gl.constexpr = q_desc.block_type.shape[3]
        D_V: gl.constexpr = v_desc.block_type.shape[3]
        gl.static_assert(D_QK == D_V, "the Q buffer doubles as the O staging buffer: D_QK == D_V")
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_WG, 1, HALF, 1, D_QK], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 1, BLOCK_N, 1, D_QK], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, BLOCK_N, 1, D_V], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(turn.index(0), count=1)  # PINGPONG: arrived by WG 1 when it has issued its MMAs
        mbarrier.init(turn.index(1), count=1)  # and by WG 0
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)  # the producer's expect + TMA bytes
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_WG)  # one arrival per consumer warpgroup
            mbarrier.init(v_empty.index(i), count=NUM_WG)
        # the partitions' argument tuples are written out inline: a tuple bound to a name first
        # would turn its constexpr entries (WG, the flags) into runtime values. The dense kernel
        # passes this function's defaults for the varlen arguments (O, strides, row starts).
        if NUM_WG == 3:
            gl.warp_specialize([
                (_consumer, (o_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turn, LSE,
                             SINK, H, GROUP, SEQ_Q, SEQ_K, offset, win_right, qk_scale, 0, HAS_RIGHT, HAS_SINK,
                             BLOCK_N, STAGES, PINGPONG, OVERLAP, O, stride_os, stride_oh, stride_lh, Q_ROW0, VARLEN,
                             NUM_WG, EMU, EMU_DEG, LAZY, SKIP, M_AXIS)),
                (_consumer, (o_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turn, LSE,
                             SINK, H, GROUP, SEQ_Q, SEQ_K, offset, win_right, qk_scale, 1, HAS_RIGHT, HAS_SINK,
                             BLOCK_N, STAGES, PINGPONG, OVERLAP, O, stride_os, stride_oh, stride_lh, Q_ROW0, VARLEN,
                             NUM_WG, EMU, EMU_DEG, LAZY, SKIP, M_AXIS)),
                (_consumer, (o_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turn, LSE,
                             SINK, H, GROUP, SEQ_Q, SEQ_K, offset, win_right, qk_scale, 2, HAS_RIGHT, HAS_SINK,
                             BLOCK_N, STAGES, PINGPONG, OVERLAP, O, stride_os, stride_oh, stride_lh, Q_ROW0, VARLEN,
                             NUM_WG, EMU, EMU_DEG, LAZY, SKIP, M_AXIS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                             v_empty, H, GROUP, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT, BLOCK_N, STAGES, False,
                             Q_ROW0, K_ROW0, VARLEN, NUM_WG, M_AXIS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (o_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turn, LSE,
                             SINK, H, GROUP, SEQ_Q, SEQ_K, offset, win_right, qk_scale, 0, HAS_RIGHT, HAS_SINK,
                             BLOCK_N, STAGES, PINGPONG, OVERLAP, O, stride_os, stride_oh, stride_lh, Q_ROW0, VARLEN,
                             NUM_WG, EMU, EMU_DEG, LAZY, SKIP, M_AXIS)),
                (_consumer, (o_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty, turn, LSE,
                             SINK, H, GROUP, SEQ_Q, SEQ_K, offset, win_right, qk_scale, 1, HAS_RIGHT, HAS_SINK,
                             BLOCK_N, STAGES, PINGPONG, OVERLAP, O, stride_os, stride_oh, stride_lh, Q_ROW0, VARLEN,
                             NUM_WG, EMU, EMU_DEG, LAZY, SKIP, M_AXIS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                             v_empty, H, GROUP, SEQ_Q, SEQ_K, offset, win_right, HAS_RIGHT, BLOCK_N, STAGES, False,
                             Q_ROW0, K_ROW0, VARLEN, NUM_WG, M_AXIS)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    @gluon.jit
    def _attn_fwd_ws_kernel(
        q_desc, k_desc, v_desc, o_desc,
        LSE, SINK,
        H, GROUP, SEQ_Q, SEQ_K,
        offset, win_right, qk_scale,
        HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr = False,
        OVERLAP: gl.constexpr = False, NUM_WG: gl.constexpr = 2, EMU: gl.constexpr = 0, EMU_DEG: gl.constexpr = 3,
        LAZY: gl.constexpr = 0, SKIP: gl.constexpr = False, HEADS_FASTEST: gl.constexpr = False,
    ):
        """O, LSE of NUM_WG x 64 query rows of one (batch, head): producer warp + NUM_WG consumer
        warpgroups; grid (query tiles, batch * heads), or (batch * heads, query tiles) with
        HEADS_FASTEST.

        Descriptors over logical [B, S, H, D]: q/o boxes [1, 64, 1, D] (a warpgroup's rows),
        k/v boxes [1, BLOCK_N, 1, D]. HAS_RIGHT (a right window bound, causal = 0) is constexpr
        because it adds the diagonal loop and reverses the grid; HAS_SINK changes the init; PINGPONG /
        OVERLAP: GluonAttnConfig's pingpong / overlap."""
        _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, LSE, SINK, H, GROUP, SEQ_Q, SEQ_K, offset, win_right, qk_scale,
                     HAS_RIGHT, HAS_SINK, STAGES, CONSUMER_REGS, PRODUCER_REGS, PINGPONG, OVERLAP, 0, 0, 0, 0, 0, 0,
                     False, NUM_WG, EMU, EMU_DEG, LAZY, SKIP, 1 if HEADS_FASTEST else 0)

    @gluon.jit
    def _attn_fwd_varlen_ws_kernel(
        q_desc, k_desc, v_desc, o_desc,
        O, LSE, SINK, CU_Q, CU_K,
        H, GROUP, stride_os, stride_oh, stride_lh,
        win_right, qk_scale,
        HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr = False,
        OVERLAP: gl.constexpr = False, NUM_WG: gl.constexpr = 2, EMU: gl.constexpr = 0, EMU_DEG: gl.constexpr = 3,
        LAZY: gl.constexpr = 0, SKIP: gl.constexpr = False, HEADS_FASTEST: gl.constexpr = False,
    ):
        """Varlen (packed THD): O, LSE of NUM_WG x 64 query rows of one (document, head); grid (query
        tiles of max_seqlen_q, heads, documents), or (heads, query tiles, documents) with
        HEADS_FASTEST. Descriptors over the packed tensors viewed as [1, T, H, D]; document ``b`` is q rows ``CU_Q[b] .. CU_Q[b+1]-1`` and k / v rows
        ``CU_K[b] .. CU_K[b+1]-1`` (int32, read here on the device), masks bottom-right aligned
        per document. A tile that starts past its document's end exits at once. O ``[T, H, D]``
        (pointer and row / head strides for the partial tiles' masked stores), LSE ``[H, T]``."""
        HALF: gl.constexpr = q_desc.block_type.shape[1]
        M_AXIS: gl.constexpr = 1 if HEADS_FASTEST else 0
        pid_m = gl.program_id(M_AXIS)
        if HAS_RIGHT:
            pid_m = gl.num_programs(M_AXIS) - 1 - pid_m
        b = gl.program_id(2)
        q_start = gl.load(CU_Q + b)
        seq_q = gl.load(CU_Q + b + 1) - q_start
        k_start = gl.load(CU_K + b)
        seq_k = gl.load(CU_K + b + 1) - k_start
        if pid_m * (NUM_WG * HALF) < seq_q:
            _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, LSE, SINK, H, GROUP, seq_q, seq_k, seq_k - seq_q, win_right,
                         qk_scale, HAS_RIGHT, HAS_SINK, STAGES, CONSUMER_REGS, PRODUCER_REGS, PINGPONG, OVERLAP,
                         O, stride_os, stride_oh, stride_lh, q_start, k_start, True, NUM_WG, EMU, EMU_DEG, LAZY,
                         SKIP, M_AXIS)


# ----------------------------------------------------------------------------------------------
# Checks and launch
# ----------------------------------------------------------------------------------------------
def use_gluon_attn_fwd(q: torch.Tensor, win_right: int) -> bool:
    """``PRIMUS_TURBO_ATTN_FWD_GLUON`` for logical ``q [B, S, H, D]``: 1 runs this kernel for the
    TRITON backend's forward wherever :func:`gluon_attn_fwd_reason` allows, 0 never, auto where it
    was measured faster than the tl forward on the H200 (2026-11-30, scripts/check_gluon_attn.py and
    benchmarks/bench_attention.py): head dim 128 (1.15-1.31x, 575-641 TFLOP/s) except causal at
    <= 2048 queries (0.96x); head dim 64 full attention (no right bound) from 2048 queries, with its
    three-warpgroup default (session 28, device time: 1.09-1.10x the tl kernel at 4096 / 16384, 1.12x
    on GPT-OSS's 64/8 heads at 2048; at 512-1024 tokens per sequence the tl kernel stays ahead);
    head dim 64 causal from 2048 queries too, since its default stops each warpgroup at its own
    diagonal (session 29, device time: 32/32 heads 1.10x / 1.02x the tl kernel at 4096 / 16384,
    64/8 heads 1.07x / 1.12x at 2048 / 8192; two warpgroups had been 0.80-0.98x)."""
    from primus_turbo.pytorch.core.env import env_auto_flag

    flag = env_auto_flag(GLUON_ATTN_ENV)
    if flag is None:
        d, s = q.size(-1), q.size(1)
        if d == 64:
            return s >= 2048
        return d == 128 and not (win_right == 0 and s <= 2048)
    return flag


def _tma_strides(t: torch.Tensor) -> Optional[tuple]:
    """t's ``[B, S, H, D]`` strides as a TMA descriptor takes them, or None when it cannot: unit
    head-dim stride, 16-byte aligned base and outer strides. A size-1 dimension's stride is never
    used (its coordinate is always 0), so it is replaced by an aligned one."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return None
    elem = t.element_size()
    span = max(st * sz for st, sz in zip(t.stride(), t.shape))
    strides = []
    for st, sz in zip(t.stride()[:-1], t.shape[:-1]):
        if sz == 1:
            st = -(-span // 8) * 8  # any 16-byte multiple; past the tensor, as if it were outermost
        if (st * elem) % 16 or st <= 0:
            return None
        strides.append(st)
    return (*strides, 1)


def gluon_attn_operand_reason(q, k, v, sink=None, softmax_scale: float = 1.0, win_left: int = -1,
                              win_right: int = -1) -> Optional[str]:
    """The shape / dtype / stride half of :func:`gluon_attn_fwd_reason` (no device test, so it is
    checkable on CPU). Inputs are the op's validated logical ``[batch, seq, heads, dim]`` tensors
    and normalized window bounds (causal: ``win_right = 0``)."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype}: the Gluon forward takes float16 and bfloat16"
    d_qk, d_v = q.size(-1), v.size(-1)
    if d_qk != d_v or d_qk not in HEAD_DIMS:
        return f"head dims qk={d_qk}, v={d_v}: the Gluon forward takes equal head dims of 64 or 128"
    if win_left >= 0:
        return f"sliding window (left={win_left}): not in the Gluon forward"
    if not softmax_scale > 0:
        return f"softmax_scale={softmax_scale}: the Gluon forward takes a positive scale (it maximizes raw scores)"
    B, Sq, H, _ = q.shape
    Sk, Hk = k.size(1), k.size(2)
    if Sk == 0:
        return "seq_kv = 0"
    if B * H > 65535:
        return f"batch * heads_q = {B * H} exceeds the grid's 65535"
    if H % Hk:
        return f"heads_q={H} is not a multiple of heads_kv={Hk}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if _tma_strides(t) is None:
            return (f"{name} strides {tuple(t.stride())}: TMA needs a unit head-dim stride and 16-byte aligned "
                    f"base and strides")
    if sink is not None and (sink.dtype != torch.float32 or sink.numel() != H):
        return "sink must be float32 [heads_q]"
    return None


def _device_reason(operand_reason, args: tuple) -> Optional[str]:
    """``operand_reason(*args)``, then the platform test on the device of ``args[0]``; any exception
    becomes the reason (the ``*_reason`` contract of the Gluon attention kernels: never raises,
    never synchronizes). Shared by the forward, the FP8 forward and the backward."""
    try:
        reason = operand_reason(*args)
        if reason is None:
            reason = gluon_platform_reason(args[0].device)
        return reason
    except Exception as exc:  # noqa: BLE001 - the contract is "never raises"
        return f"{type(exc).__name__}: {exc}"


def _outputs(fn: str, out, lse, B: int, Sq: int, H: int, D: int, dtype: torch.dtype, device) -> tuple:
    """The O ``[B, Sq, H, D]`` and LSE ``[B, H, Sq]`` destinations: new ones, or the caller's checked
    (ValueError naming ``fn``). Shared by the forward and the FP8 forward."""
    if out is None:
        out = torch.empty((B, Sq, H, D), dtype=dtype, device=device)
    elif (tuple(out.shape) != (B, Sq, H, D) or out.dtype != dtype or out.device != device
          or (out.numel() and _tma_strides(out) is None)):
        raise ValueError(f"{fn}: out must be {dtype} {[B, Sq, H, D]} on {device} with a unit "
                         f"head-dim stride and 16-byte aligned strides, got {out.dtype} {list(out.shape)} "
                         f"strides {tuple(out.stride())}")
    if lse is None:
        lse = torch.empty((B, H, Sq), dtype=torch.float32, device=device)
    elif tuple(lse.shape) != (B, H, Sq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"{fn}: lse must be contiguous float32 {[B, H, Sq]}, got {lse.dtype} "
                         f"{list(lse.shape)} strides {tuple(lse.stride())}")
    return out, lse


def gluon_attn_fwd_reason(q, k, v, sink=None, softmax_scale: float = 1.0, win_left: int = -1,
                          win_right: int = -1) -> Optional[str]:
    """None when :func:`flash_attn_fwd_gluon` can run these inputs on their device, else why not.
    Never raises, never synchronizes."""
    return _device_reason(gluon_attn_operand_reason, (q, k, v, sink, softmax_scale, win_left, win_right))


_GL_DTYPES = {}
if GLUON_AVAILABLE:
    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.lru_cache(maxsize=None)
def _layout(rows: int, head_dim: int, dtype: torch.dtype):
    """Shared layout of a [1, rows, 1, D] box: 128-byte swizzle (Triton splits a 256-byte row into two
    TMA messages)."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, head_dim], _GL_DTYPES[dtype])


def _desc(t: torch.Tensor, rows: int):
    return TensorDescriptor(t, list(t.shape), list(_tma_strides(t)), [1, rows, 1, t.size(-1)],
                            _layout(rows, t.size(-1), t.dtype))


def _launch_kwargs(cfg: GluonAttnConfig, win_right: int, sink) -> dict:
    """The constexpr / launch keywords of the dense and the varlen kernels."""
    return dict(HAS_RIGHT=win_right >= 0, HAS_SINK=sink is not None, STAGES=cfg.stages,
                CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, PINGPONG=cfg.pingpong,
                OVERLAP=cfg.overlap, NUM_WG=cfg.consumers, EMU=cfg.emu, EMU_DEG=cfg.emu_deg, LAZY=cfg.lazy,
                SKIP=cfg.skip, HEADS_FASTEST=cfg.heads_fastest, num_warps=4)


def _kernel_args(q, k, v, out, lse, sink, softmax_scale: float, win_right: int, cfg: GluonAttnConfig) -> tuple:
    """(grid, positional args, keyword args) of the launch for validated, non-empty inputs."""
    B, Sq, H, _ = q.shape
    Sk, Hk = k.size(1), k.size(2)
    args = (_desc(q, HALF_M), _desc(k, cfg.block_n), _desc(v, cfg.block_n), _desc(out, HALF_M),
            lse, sink if sink is not None else lse,
            H, H // Hk, Sq, Sk, Sk - Sq, max(win_right, 0), float(softmax_scale) * LOG2E)
    kwargs = _launch_kwargs(cfg, win_right, sink)
    grid = (-(-Sq // cfg.BLOCK_M), B * H)
    if cfg.heads_fastest:
        grid = grid[::-1]
    return grid, args, kwargs


def flash_attn_fwd_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: Optional[torch.Tensor],
                         softmax_scale: float, win_left: int = -1, win_right: int = -1,
                         config: Optional[GluonAttnConfig] = None, out: Optional[torch.Tensor] = None,
                         lse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on Hopper. q ``[B, Sq, Hq, D]``, k / v ``[B, Sk, Hk, D]`` (fp16/bf16, D 64 or
    128, unit head-dim stride, 16-byte aligned strides; ``Hq % Hk == 0``), sink fp32 ``[Hq]`` or None,
    ``win_left`` must be -1, ``win_right`` -1 or >= 0 (causal: 0). Returns ``O [B, Sq, Hq, D]`` (q's
    dtype, contiguous) and ``LSE [B, Hq, Sq]`` fp32, natural log: the forward of
    :func:`flash_attn_fwd_triton`, so its backward takes them as they are. ``out`` / ``lse``: optional
    destinations of those shapes (``out`` with TMA-aligned strides, ``lse`` contiguous).

    Raises ValueError with :func:`gluon_attn_fwd_reason`'s text for inputs it does not take.

    Example::

        >>> if gluon_attn_fwd_reason(q, k, v, None, scale, -1, 0) is None:
        ...     out, lse = flash_attn_fwd_gluon(q, k, v, None, scale, -1, 0)  # causal
    """
    reason = gluon_attn_fwd_reason(q, k, v, sink, softmax_scale, win_left, win_right)
    if reason is not None:
        raise ValueError(f"flash_attn_fwd_gluon: {reason}")
    B, Sq, H, D = q.shape
    out, lse = _outputs("flash_attn_fwd_gluon", out, lse, B, Sq, H, D, q.dtype, q.device)
    if B == 0 or Sq == 0 or H == 0:
        return out, lse
    cfg = config or _fit_grid(default_attn_config(D, win_right >= 0, H // k.size(2)), Sq)
    bad = cfg.check(D)
    if bad is not None:
        raise ValueError(f"flash_attn_fwd_gluon: {bad}")
    grid, args, kwargs = _kernel_args(q, k, v, out, lse, sink, softmax_scale, win_right, cfg)
    if cfg.heads_fastest and grid[1] > _MAX_GRID_YZ:
        raise ValueError(f"flash_attn_fwd_gluon: config {cfg.short()} puts {grid[1]} query tiles on the grid's y axis "
                         f"(at most {_MAX_GRID_YZ})")
    launch(_attn_fwd_ws_kernel, grid, args, kwargs, q.device)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Varlen (packed THD)
# ----------------------------------------------------------------------------------------------


#: ``auto`` runs the Gluon varlen forward for full attention from this ``max_seqlen_q`` on (H200,
#: session 7: it won on the full-attention packs whose longest document had 2048 tokens, lost on
#: packs of shorter documents and, with the shifted last key block, on the causal ones)
VARLEN_AUTO_MIN_SEQLEN_Q = 2048


def use_gluon_attn_varlen_fwd(max_seqlen_q: int, win_right: int, head_dim: int) -> bool:
    """``PRIMUS_TURBO_ATTN_VARLEN_GLUON`` for a varlen call's ``max_seqlen_q`` (the host int of
    ``flash_attn_varlen_func``: no sync), normalized right window (``win_right >= 0``: causal or a
    right bound) and head dim: 1 runs :func:`flash_attn_varlen_fwd_gluon` for the TRITON backend's
    varlen forward wherever :func:`gluon_attn_varlen_fwd_reason` allows, 0 never, auto (the default)
    where it was measured faster than the tl varlen forward on the H200 (16384-token packs, device
    time): every pack at head dim 128, and from ``max_seqlen_q >= 2048`` at head dim 64 (full and
    causal).

    Session 29 (CUDA-graph replay, benchmarks/results/h200/session29/), Gluon default / tl, head dim
    128, 32/8 heads: causal 8 x 2048 1.35x, 2048-64-64-64 1.26x, 128-256-512-1024 1.27x, 512 x 4
    1.33x, 57-311-800-173 1.11x; full 2048-64-64-64 1.39x, 128-256-512-1024 1.33x, 512 x 4 1.36x,
    57-311-800-173 1.12x (session 7, before the kernel's later changes, had read 0.80-0.93x on the
    last three). Head dim 64, 64/8 heads: 8 x 2048 full 1.12x, causal 1.10x, 2048-64-64-64 full
    1.05x, causal 0.98x; the packs of shorter documents keep the tl kernel (0.80-0.95x)."""
    from primus_turbo.pytorch.core.env import env_auto_flag

    flag = env_auto_flag(GLUON_ATTN_VARLEN_ENV)
    if flag is None:
        return head_dim == 128 or int(max_seqlen_q) >= VARLEN_AUTO_MIN_SEQLEN_Q
    return flag


def gluon_attn_varlen_operand_reason(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                     sink=None, softmax_scale: float = 1.0, win_left: int = -1,
                                     win_right: int = -1) -> Optional[str]:
    """The shape / dtype / stride half of :func:`gluon_attn_varlen_fwd_reason` (CPU-checkable): the
    dense forward's rules on the packed ``[T, H, D]`` tensors viewed as ``[1, T, H, D]``, plus int32
    ``cu_seqlens`` of equal length on q's device with a unit stride, at most 65535 documents."""
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"varlen q, k, v must be packed [total, heads, dim], got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D"
    reason = gluon_attn_operand_reason(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), sink, softmax_scale,
                                       win_left, win_right)
    if reason is not None:
        return reason
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            return f"{name} must be a 1-D int32 tensor with batch + 1 entries"
        if cu.device != q.device:
            return f"{name} is on {cu.device}, q on {q.device}"
        if cu.numel() > 1 and cu.stride(0) != 1:
            return f"{name} must have a unit stride, got {cu.stride(0)}"
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        return f"cu_seqlens_q has {cu_seqlens_q.numel()} entries, cu_seqlens_k {cu_seqlens_k.numel()}"
    if cu_seqlens_q.numel() - 1 > _MAX_GRID_YZ:
        return f"{cu_seqlens_q.numel() - 1} documents exceed the grid's {_MAX_GRID_YZ}"
    if q.size(1) > _MAX_GRID_YZ:
        return f"heads_q = {q.size(1)} exceeds the grid's {_MAX_GRID_YZ}"
    if max(q.size(0), k.size(0)) >= 2 ** 31 - 2 * 3 * HALF_M:  # the largest BLOCK_M (3 warpgroups)
        return f"total tokens q={q.size(0)}, k={k.size(0)}: TMA row coordinates are int32"
    if int(max_seqlen_q) < 0 or int(max_seqlen_k) < 0:
        return f"max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k} must be >= 0"
    return None


def gluon_attn_varlen_fwd_reason(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                 sink=None, softmax_scale: float = 1.0, win_left: int = -1,
                                 win_right: int = -1) -> Optional[str]:
    """None when :func:`flash_attn_varlen_fwd_gluon` can run these inputs on their device, else why
    not. Never raises, never synchronizes (``cu_seqlens`` values are not read)."""
    return _device_reason(gluon_attn_varlen_operand_reason, (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                             max_seqlen_k, sink, softmax_scale, win_left, win_right))


if GLUON_AVAILABLE:

    @triton.jit
    def _varlen_fill_outside_kernel(O, LSE, CU, NSEQ, T, H, stride_os, stride_oh, stride_lh,
                                    D: tl.constexpr, BLOCK_T: tl.constexpr):
        """O = 0 and LSE = +inf on the packed rows outside ``CU[0] .. CU[NSEQ]-1`` (the rows no
        document owns, which the attention kernel never writes): the tl varlen forward's contract.
        A block of rows inside that range returns at once (so, when the documents cover every row,
        all of them do)."""
        r0 = tl.program_id(0) * BLOCK_T
        lo = tl.load(CU)
        hi = tl.load(CU + NSEQ)
        if (r0 >= lo) & (r0 + BLOCK_T <= hi):
            return
        rows = r0 + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, D)
        outside = (rows < T) & ((rows < lo) | (rows >= hi))
        o_ptrs = O + rows[:, None].to(tl.int64) * stride_os + cols[None, :]
        lse_ptrs = LSE + rows
        for _ in range(H):
            tl.store(o_ptrs, tl.zeros([BLOCK_T, D], dtype=O.dtype.element_ty), mask=outside[:, None])
            tl.store(lse_ptrs, tl.full([BLOCK_T], float("inf"), tl.float32), mask=outside)
            o_ptrs += stride_oh
            lse_ptrs += stride_lh


def _fill_outside(out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
    """:func:`_varlen_fill_outside_kernel` on ``out [T, H, D]`` (unit head-dim stride, D a power of
    two) and ``lse [H, T]`` (unit token stride)."""
    T, H, D = out.shape
    if T == 0 or H == 0:
        return
    block_t = 64
    _varlen_fill_outside_kernel[(cdiv(T, block_t),)](
        out, lse, cu_seqlens_q, cu_seqlens_q.numel() - 1, T, H, out.stride(0), out.stride(1), lse.stride(0),
        D=D, BLOCK_T=block_t, num_warps=4)


def _varlen_outputs(out, lse, T: int, H: int, D: int, dtype: torch.dtype, device) -> tuple:
    """O ``[T, H, D]`` and LSE ``[H, T]`` destinations: new (uninitialized: the kernel writes the
    documents' rows, :func:`_fill_outside` the others) or the caller's, checked."""
    fn = "flash_attn_varlen_fwd_gluon"
    if out is None:
        out = torch.empty((T, H, D), dtype=dtype, device=device)
    elif (tuple(out.shape) != (T, H, D) or out.dtype != dtype or out.device != device
          or (out.numel() and _tma_strides(out.unsqueeze(0)) is None)):
        raise ValueError(f"{fn}: out must be {dtype} {[T, H, D]} on {device} with a unit head-dim stride and "
                         f"16-byte aligned strides, got {out.dtype} {list(out.shape)} strides {tuple(out.stride())}")
    if lse is None:
        lse = torch.empty((H, T), dtype=torch.float32, device=device)
    elif (tuple(lse.shape) != (H, T) or lse.dtype != torch.float32 or lse.device != device
          or (lse.numel() and lse.stride(1) != 1)):
        raise ValueError(f"{fn}: lse must be float32 {[H, T]} on {device} with a unit token stride, got "
                         f"{lse.dtype} {list(lse.shape)} strides {tuple(lse.stride())}")
    return out, lse


def _varlen_kernel_args(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                        softmax_scale: float, win_right: int, cfg: GluonAttnConfig) -> tuple:
    """(grid, positional args, keyword args) of :func:`_attn_fwd_varlen_ws_kernel` for validated,
    non-empty packed inputs: grid (query tiles of ``max_seqlen_q``, heads, documents)."""
    H, Hk = q.size(1), k.size(1)
    q4, k4, v4, o4 = (t.unsqueeze(0) for t in (q, k, v, out))
    args = (_desc(q4, HALF_M), _desc(k4, cfg.block_n), _desc(v4, cfg.block_n), _desc(o4, HALF_M),
            out, lse, sink if sink is not None else lse, cu_seqlens_q, cu_seqlens_k,
            H, H // Hk, out.stride(0), out.stride(1), lse.stride(0), max(win_right, 0),
            float(softmax_scale) * LOG2E)
    kwargs = _launch_kwargs(cfg, win_right, sink)
    grid = (-(-int(max_seqlen_q) // cfg.BLOCK_M), H, cu_seqlens_q.numel() - 1)
    if cfg.heads_fastest:
        grid = (H, grid[0], grid[2])
    return grid, args, kwargs


def flash_attn_varlen_fwd_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                sink: Optional[torch.Tensor], softmax_scale: float, win_left: int = -1,
                                win_right: int = -1, config: Optional[GluonAttnConfig] = None,
                                out: Optional[torch.Tensor] = None,
                                lse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (THD) attention forward on Hopper: the contract of
    :func:`flash_attn_fwd.flash_attn_varlen_fwd_triton`. q ``[Tq, Hq, D]``, k / v ``[Tk, Hk, D]``
    (the dense Gluon forward's dtypes, head dims, strides and windows); document ``b`` is q rows
    ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1`` and k / v rows ``cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1``
    (int32 ``[B+1]`` on the device, read there only: no host sync), at most ``max_seqlen_q`` query
    rows each (host int; it sizes the grid); masks are bottom-right aligned per document (causal:
    ``win_right = 0``). Returns ``O [Tq, Hq, D]`` and ``LSE [Hq, Tq]`` fp32 (natural log, ``+inf``
    for a row that sees no key and has no sink), so :func:`flash_attn_varlen_bwd_triton` takes them
    as they are; rows outside ``cu_seqlens_q[0] .. cu_seqlens_q[-1]`` get ``O = 0``, ``LSE = +inf``.

    No k / v row past a document's end is read (its last key block is loaded shifted back to end
    there), so rows past ``cu_seqlens_k[-1]`` may hold anything (NaN, uninitialized memory). A
    document shorter than the key block (128) reads up to ``128 - len`` rows before its start (the
    previous documents', masked: ``P V`` multiplies them by 0, so they must be finite, as the
    documents' rows are; before row 0, TMA reads zeros); with ``cu_seqlens_k[0] > 0`` that may
    include rows before ``cu_seqlens_k[0]``.

    Raises ValueError with :func:`gluon_attn_varlen_fwd_reason`'s text for inputs it does not take."""
    reason = gluon_attn_varlen_fwd_reason(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink,
                                          softmax_scale, win_left, win_right)
    if reason is not None:
        raise ValueError(f"flash_attn_varlen_fwd_gluon: {reason}")
    Tq, H, D = q.shape
    out, lse = _varlen_outputs(out, lse, Tq, H, D, q.dtype, q.device)
    if Tq == 0 or H == 0:
        return out, lse
    cfg = config or _fit_grid(default_attn_config(D, win_right >= 0, H // k.size(1), varlen=True), int(max_seqlen_q))
    bad = cfg.check(D)
    if bad is not None:
        raise ValueError(f"flash_attn_varlen_fwd_gluon: {bad}")
    with torch.cuda.device(q.device):
        # first, so that a (buggy) write of the attention kernel past a document's end would show
        _fill_outside(out, lse, cu_seqlens_q)
        if cu_seqlens_q.numel() > 1 and int(max_seqlen_q) > 0:
            grid, args, kwargs = _varlen_kernel_args(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     softmax_scale, win_right, cfg)
            if cfg.heads_fastest and grid[1] > _MAX_GRID_YZ:
                raise ValueError(f"flash_attn_varlen_fwd_gluon: config {cfg.short()} puts {grid[1]} query tiles on "
                                 f"the grid's y axis (at most {_MAX_GRID_YZ})")
            launch(_attn_fwd_varlen_ws_kernel, grid, args, kwargs, q.device)
    return out, lse
