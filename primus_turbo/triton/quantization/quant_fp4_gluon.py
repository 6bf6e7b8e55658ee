"""Hopper Gluon kernel for ``quantize_fp4_with_trans`` of bf16: both MXFP4 copies (1x32 blocks along
the rows and, transposed, along the columns) from one read, the codes and scales formed in the
registers of the thread that loaded the data.

Why a second kernel next to the tl pair kernel (quant_fp4_packed.py, its portable twin, which the
interpreter and the other shapes run): that kernel spends 24 SASS instructions per element, ~1000
of its 1550 per thread on the ALU pipe (half the FMA pipe's rate), and Triton routes its row words,
their scales and the transposed words through shared memory with four barriers per row octet
(layout conversions its coalescing pass inserts); it reads 0.66x the device copy. Here the layout
is fixed by hand (18 instructions per element, 9.5 on the ALU pipe): each thread holds 8
consecutive rows x 4 bf16 pairs (``[TI, 8, TP]`` int32, thread ``[1, 8, 4]``, ``TWP`` lanes along
the pairs, ``32 / TWP`` along the row octets), so

* a row block (32 columns) is 4 lanes and a column block (32 rows) is 4 lanes: each block amax is
  an in-thread max and two butterflies;
* the E2M1 codes of both copies come from one PTX program per thread (``dual_prog``), with the
  magnitude, the sign and the scaled inputs shared between the copies and the row-block scales
  formed two rows per register;
* each thread stores its 8 column words itself (the transposed copy's 8 nibbles of a column are
  the thread's 8 rows; 8 lanes fill a 32-byte sector) and its share of the E8M0 scale words (two
  lanes per sector); the row words go through shared memory (one barrier) so that a warp writes
  64-byte row segments: a warp's own row words are 16 bytes of a row, and those half-sector
  writes cost more than the whole kernel's arithmetic (H200: 0.65x -> 0.71x the device copy);
* the programs are persistent (4 per SM, 128 registers) and load their next tile before forming
  this one's codes, with 4 tile rows side by side (their transposed words fill the same lines):
  0.71x -> 0.80-0.82x.

The program (numpy model: ``quant_fp4_packed.emulate``, lanes as the last axis; exhaustive and
whole-tile CPU tests in tests/triton/test_quant_fp4_gluon.py):

1. Row amax: ``max.NaN.xorsign.abs`` over the thread's 4 pairs of a row, two rows joined per
   register (``prmt``), butterflies over the 4 lanes of the block, sign bits cleared: the amax bits
   of rows 2j and 2j + 1 in the halves of one register (NaN above inf).
2. E8M0 scale per half (``_scale``), with e the amax exponent field: ``F = max(e, 2) + 1`` (as
   ``<< 7``; bit 15 set only for e = 255), the NaN mask from F's top bits (``prmt`` sign
   replication), multiplier ``2**(129 - max(e, 2))`` as bf16 bits ``0x8080 - F`` (1.0 where e = 255),
   byte ``max(e, 2) - 2`` (255 where e = 255): the OCP rule of ``_mx_scales``.
3. Column amax and scales the same way over the thread's 8 rows and the 4 lanes of the column block
   (each register already holds two columns).
4. Codes, per pair p with multiplier m (the row's, then the two columns'): ``a = max(|p|, 0)``
   (NaN -> 0), shared; ``y = a * m`` (exact: a power of two); ``t = min(y, 6)``;
   ``c = max(t, 1) & 0x7f80`` = 2**seg for the E2M1 segment (step 0.5, 1, 2);
   ``r = fma(c, 96, t)``: t rounded once to its segment's grid, half to even (the ulp of
   96 * 2**seg + t is the step); ``v = fma(r, 2**-126, c * -1.5 * 2**-120)`` = (E2M1 value) *
   2**-126, whose bf16 bits are the 3-bit code << 6; the sign bit, from ``p * m_row`` (NaN ->
   canonical +NaN, -0 kept), shifted to bit 9 and or-ed in.
5. Row words: codes re-paired (e_j, e_j+4) with ``prmt``, then shifted into their nibbles; column
   words: the 8 rows' codes of a column into one word (``prmt`` byte gathers).

Output slots (the asm is elementwise with ``pack = 32``: its operands are the thread's 32 pairs in
register order, slot ``4 k + r`` = row k, pair r): ``orow`` slot ``4 k`` = the row word of row k,
slot 1 = a row-scale word (the octet's rows 0-3 on even lanes, 4-7 on odd ones: lanes 0 and 1 of
a block store the octet's 8 bytes); ``ocol`` slots ``r``, ``4 + r`` = the words of columns
``2 r`` and ``2 r + 1``, slot 8 = a column-scale word (the thread's columns 0-3 on even row
octets, 4-7 on odd ones). The stores' masks select these slots; they are constants per register,
so the other slots cost nothing.

:func:`fp4_gluon_reason` says why a call goes to the tl pair kernel instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from primus_turbo.triton.gemm.gemm_fp8_gluon import GLUON_AVAILABLE, gluon_platform_reason

from . import quant_fp4_packed as P

__all__ = ["FP4_GLUON_ENV", "FP4_GLUON_DEFAULT", "FP4_GLUON_CANDIDATES", "dual_prog", "fp4_gluon_reason",
           "fp4_gluon_with_trans_launch", "gluon_tile", "launch_config"]

#: ``auto`` / ``1``: the default ``quantize_fp4_with_trans`` dispatch takes this kernel where
#: :func:`fp4_gluon_reason` allows; ``0``: the tl pair kernel (docs/env_vars.md)
FP4_GLUON_ENV = "PRIMUS_TURBO_FP4_GLUON"
#: (TWP, WI, WP[, maxnreg, BAND, programs per SM]): lanes along the pairs, warps along the row
#: octets, warps along the pairs; the register cap (0: none), tile rows run side by side, and
#: persistent programs per SM that load their next tile before forming this one's codes (0: one
#: program per tile). H200, bf16 [16384, 7168] and [8192, 14336], device time, x the device copy
#: (scripts/diag_fp4_gluon.py, session 34): one program per tile 0.71; persistent, 4 per SM, 128
#: registers 0.76, with BAND 4 0.79-0.80 (the tl pair kernel 0.66 in the same runs)
FP4_GLUON_DEFAULT = (4, 1, 4, 128, 4, 4)
FP4_GLUON_CANDIDATES = ((4, 1, 4, 128, 4, 4), (4, 1, 4), (4, 2, 2), (4, 1, 2), (4, 1, 8, 128, 4, 2),
                        (4, 2, 4, 128, 4, 2), (4, 1, 4, 96, 4, 5), (8, 1, 4))


def gluon_tile(cfg) -> tuple:
    """(TR, TC) of a (TWP, WI, WP[, ...]) configuration."""
    twp, wi, wp = cfg[:3]
    return 8 * (32 // twp) * wi, 8 * twp * wp


# ----------------------------------------------------------------------------------------------
# The per-thread program
# ----------------------------------------------------------------------------------------------
def _scale(z: str, m: str, b: str, tag: str) -> list:
    """Ops: amax halves z (bits, sign clear) -> multiplier halves m (bf16 bits), byte halves b."""
    e, mx, f, k, mr, bt = (f"{v}{tag}" for v in ("se", "smx", "sf", "sk", "smr", "sbt"))
    return [
        ("and", e, z, "kexp"),
        ("max_u16x2", mx, e, "kfl"),
        ("add", f, mx, "ksub"),  # + 0x0080 per half: F = (max(e, 2) + 1) << 7
        ("prmt", k, f, f, 0xBB99),  # 0xffff per half where F's bit 15 (e = 255)
        ("sub", mr, "kmb", f),  # 0x8080 - F = (256 - max(e, 2)) << 7
        ("lop3", m, mr, k, "k1", 0xB8),  # k ? 1.0 : mr
        ("shr", bt, f, 7),
        ("sub", bt, bt, "k3"),
        ("lop3", b, bt, k, "kff", 0xF8),  # bt | (k & 0xff)
    ]


def _code(a: str, m: str, gs: str, z: str, tag: str) -> list:
    """Ops: magnitude pair a (NaN -> 0), multiplier pair m, shifted sign gs -> z = code << 6 |
    sign << 9 in each half."""
    y, t, c, r, n, v = (f"{q}{tag}" for q in ("y", "t", "c", "r", "n", "v"))
    return [
        ("mul_bf", y, a, m),
        ("min_bf", t, y, "k6"),
        ("max_bf", c, t, "k1"),
        ("and", c, c, "kexp"),
        ("fma_bf", r, c, "k96", t),
        ("mul_bf", n, c, "kK"),
        ("fma_bf", v, r, "ksub", n),
        ("lop3", z, v, gs, "ksgn", 0xF8),  # v | (gs & ksgn)
    ]


def dual_prog(twp: int) -> tuple:
    """The thread program for ``twp`` lanes along the pairs (4 or 8): inputs ``x{k}{r}`` (row k of
    the octet, pair r), outputs ``a0..a31`` (orow) and ``b0..b31`` (ocol)."""
    if twp not in (4, 8):
        raise ValueError(f"dual_prog: twp must be 4 or 8, got {twp}")
    ops: list = []
    mx = "max_nan_xsa_bf"
    # 1-2. row amax (two rows per register) and scales
    for k in range(8):
        ops += [(mx, f"u{k}", f"x{k}0", f"x{k}1"), (mx, f"u{k}", f"u{k}", f"x{k}2"), (mx, f"u{k}", f"u{k}", f"x{k}3")]
    for j in range(4):
        z, s = f"rz{j}", f"rs{j}"
        ops += [("prmt", f"ra{j}", f"u{2 * j}", f"u{2 * j + 1}", 0x5410),
                ("prmt", f"rb{j}", f"u{2 * j}", f"u{2 * j + 1}", 0x7632),
                (mx, z, f"ra{j}", f"rb{j}"),
                ("shfl", s, z, 1), (mx, z, z, s), ("shfl", s, z, 2), (mx, z, z, s),
                ("and", z, z, "kabs")]
        ops += _scale(z, f"rm{j}", f"rby{j}", f"r{j}")
        ops += [("prmt", f"mr{2 * j}", f"rm{j}", f"rm{j}", 0x1010),
                ("prmt", f"mr{2 * j + 1}", f"rm{j}", f"rm{j}", 0x3232)]
    # 3. column amax and scales (a register holds columns 2r, 2r + 1)
    for r in range(4):
        z, s = f"cz{r}", f"cs{r}"
        ops += [(mx, z, f"x0{r}", f"x1{r}")] + [(mx, z, z, f"x{k}{r}") for k in range(2, 8)]
        ops += [("shfl", s, z, twp), (mx, z, z, s), ("shfl", s, z, 2 * twp), (mx, z, z, s), ("and", z, z, "kabs")]
        ops += _scale(z, f"cm{r}", f"cby{r}", f"c{r}")
    # 4. codes of both copies
    for k in range(8):
        for r in range(4):
            x, a, g, gs = f"x{k}{r}", f"a_{k}{r}", f"g_{k}{r}", f"gs_{k}{r}"
            ops += [("abs_bf", a, x), ("max_bf", a, a, "kz"),
                    ("mul_bf", g, x, f"mr{k}"), ("mul_hi", gs, g, 1 << 26)]  # gs = g >> 6
            ops += _code(a, f"mr{k}", gs, f"zr{k}{r}", f"R{k}{r}")
            ops += _code(a, f"cm{r}", gs, f"zc{k}{r}", f"C{k}{r}")
    # 5. row words (slot 4k), row-scale words (slots 1, 5)
    for k in range(8):
        z = [f"zr{k}{r}" for r in range(4)]
        q = [f"q{k}{j}" for j in range(4)]
        w = f"a{4 * k}"
        ops += [("prmt", q[0], z[0], z[2], 0x5410), ("prmt", q[1], z[0], z[2], 0x7632),
                ("prmt", q[2], z[1], z[3], 0x5410), ("prmt", q[3], z[1], z[3], 0x7632),
                ("shr", f"o{k}0", q[0], 6), ("shr", f"o{k}1", q[1], 2), ("add", f"o{k}0", f"o{k}0", f"o{k}1"),
                ("shl", f"o{k}2", q[2], 2), ("add", f"o{k}0", f"o{k}0", f"o{k}2"),
                ("shl", f"o{k}3", q[3], 6), ("add", w, f"o{k}0", f"o{k}3")]
    # row-scale word of this lane (slot 1): the octet's rows 0-3 on even lanes, 4-7 on odd ones (two
    # lanes of the block store 8 consecutive bytes: whole sectors per instruction)
    ops += [("prmt", "sw0", "rby0", "rby1", 0x6420), ("prmt", "sw1", "rby2", "rby3", 0x6420),
            ("laneid", "ln", ), ("and", "lb", "ln", 1), ("sub", "lm", "kz", "lb"),
            ("lop3", "a1", "sw0", "lm", "sw1", 0xB8)]
    # column words (slots r: column 2r, 4 + r: column 2r + 1), column-scale words (slots 8, 9)
    for r in range(4):
        z = [f"zc{k}{r}" for k in range(8)]
        h = [f"h{r}{j}" for j in range(4)]
        for j in range(4):
            ops += [("shl", h[j], z[2 * j], 2), ("shl", f"hg{r}{j}", z[2 * j + 1], 6), ("add", h[j], h[j], f"hg{r}{j}")]
        ops += [("prmt", f"t{r}0", h[0], h[1], 0x7351), ("prmt", f"t{r}1", h[2], h[3], 0x7351),
                ("prmt", f"b{r}", f"t{r}0", f"t{r}1", 0x5410), ("prmt", f"b{4 + r}", f"t{r}0", f"t{r}1", 0x7632)]
    # column-scale word of this lane (slot 8): the thread's columns 0-3 on even row octets, 4-7 on
    # odd ones
    ops += [("prmt", "cw0", "cby0", "cby1", 0x6420), ("prmt", "cw1", "cby2", "cby3", 0x6420),
            ("shr", "li", "ln", twp.bit_length() - 1), ("and", "li", "li", 1), ("sub", "lmi", "kz", "li"),
            ("lop3", "b8", "cw0", "lmi", "cw1", 0xB8)]
    outs = tuple(f"a{i}" for i in range(32)) + tuple(f"b{i}" for i in range(32))
    defined = {op[1] for op in ops}
    ops += [("mov", o, 0) for o in outs if o not in defined]  # unused slots (ptxas drops them)
    ins = tuple(f"x{k}{r}" for k in range(8) for r in range(4))
    return ins, outs, ops


_PTX = {twp: P._ptx(dual_prog(twp)) for twp in (4, 8)}
_DIAG_PTX = P._ptx((tuple(f"x{j}" for j in range(32)), tuple(f"o{j}" for j in range(64)),
                    [("and", "t", "x0", "kabs")]
                    + [("lop3", "t", "t", f"x{j}", f"x{j + 1}", 0x96) for j in range(1, 31, 2)]
                    + [("lop3", "t", "t", "x31", "kz", 0x96)] + [("mov", f"o{j}", "t") for j in range(64)]))
_CONSTRAINTS = ",".join(["=r"] * 64 + ["r"] * 32)


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    _DIAG_ASM = gl.constexpr(_DIAG_PTX)

    @gluon.jit
    def _tile_of(t, n_tiles_r, n_tiles_c, BAND: gl.constexpr):
        """(tile row, tile column) of tile ``t``: BAND tile rows run side by side (vertically
        adjacent tiles at the same time: their transposed words fill the same lines)."""
        if BAND <= 1:
            return t // n_tiles_c, t % n_tiles_c
        else:
            g = t // (BAND * n_tiles_c)
            rg = gl.minimum(n_tiles_r - g * BAND, BAND)
            idx = t - g * (BAND * n_tiles_c)
            return g * BAND + idx % rg, idx // rg

    @gluon.jit
    def _tile_index(pid_r, pid_c, TI: gl.constexpr, TP: gl.constexpr, L3: gl.constexpr):
        """(row octet i, row k of the octet, pair p) of the tile's [TI, 8, TP] elements, global."""
        i1 = pid_r * TI + gl.arange(0, TI, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        k1 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        p1 = pid_c * TP + gl.arange(0, TP, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        return (gl.expand_dims(gl.expand_dims(i1, 1), 2), gl.expand_dims(gl.expand_dims(k1, 0), 2),
                gl.expand_dims(gl.expand_dims(p1, 0), 1))

    @gluon.jit
    def _tile_load(x_ptr, pid_r, pid_c, cols, ok, TI: gl.constexpr, TP: gl.constexpr, L3: gl.constexpr):
        i3, k3, p3 = _tile_index(pid_r, pid_c, TI, TP, L3)
        row = i3 * 8 + k3
        ptrs = x_ptr + (row * (cols // 2) + p3)
        if ok is None:
            return gl.load(ptrs)
        else:
            return gl.load(ptrs, mask=(row >= 0) & ok, other=0)

    @gluon.jit
    def _tile_quant(x, pid_r, pid_c, p_ptr, s_ptr, pt_ptr, st_ptr, rows, cols,
                    TI: gl.constexpr, TP: gl.constexpr, WI: gl.constexpr, WP: gl.constexpr, L3: gl.constexpr,
                    ASM: gl.constexpr, CON: gl.constexpr, DIAG: gl.constexpr):
        i3, k3, p3 = _tile_index(pid_r, pid_c, TI, TP, L3)
        r3 = p3 & 3  # the pair's register within the thread: a constant per register (bit ops fold)
        # int32 offsets (the launcher keeps rows * cols < 2**31): one wide multiply-add per address
        row = i3 * 8 + k3
        if (DIAG & 4) == 0:
            orow, ocol = gl.inline_asm_elementwise(ASM, CON, [x], dtype=(gl.int32, gl.int32), is_pure=True, pack=32)
        else:  # timing only: every slot the xor of the thread's 32 pairs (all loads kept, ~no compute)
            orow, ocol = gl.inline_asm_elementwise(_DIAG_ASM, CON, [x], dtype=(gl.int32, gl.int32), is_pure=True,
                                                   pack=32)
        # row words: [rows, cols / 8]
        if (DIAG & 2) == 0:
            # the row words (slots r = 0) to [TI * 8, TP / 4] (register renames), then through
            # shared memory to a layout whose warps write 64-byte row segments: a warp's own
            # words are 16 bytes of a row, half a sector, which costs the L2 (H200:
            # scripts/diag_fp4_gluon.py, the stores alone 0.71x the copy)
            w5 = gl.reshape(orow, [TI, 8, TP // 4, 2, 2])
            w4, _w = gl.split(w5)
            w3, _w = gl.split(w4)
            w2 = gl.reshape(w3, [TI * 8, TP // 4])
            LW: gl.constexpr = gl.BlockedLayout([1, 4], [512 // TP, TP // 16], [WI * WP, 1], [1, 0])
            w2 = gl.convert_layout(w2, LW)
            wr = pid_r * (TI * 8) + gl.arange(0, TI * 8, layout=gl.SliceLayout(1, LW))
            wc = pid_c * (TP // 4) + gl.arange(0, TP // 4, layout=gl.SliceLayout(0, LW))
            gl.store(p_ptr + (gl.expand_dims(wr, 1) * ((cols // 64) * 8) + gl.expand_dims(wc, 0)), w2)  # 16-byte rows
        # row-scale words: the scales stored [cols / 32, rows] (rows contiguous), as int32
        # [cols / 32, rows / 4]; lanes 0, 1 of the block's four store the octet's two words
        if (DIAG & 8) == 0:
            gl.store(s_ptr + ((p3 >> 4) * (rows // 4) + i3 * 2 + ((p3 >> 2) & 1) + k3 * 0), orow,
                     mask=(r3 == 1) & (k3 == 0) & (((p3 >> 2) & 2) == 0))
        # column words: the transposed copy [cols, rows / 8] (int32), column 2p + h, word i
        if (DIAG & 1) == 0:
            gl.store(pt_ptr + ((p3 * 2 + k3) * (rows // 8) + i3), ocol, mask=(k3 < 2) & (r3 >= 0))
        # column-scale words: stored [rows / 32, cols] (columns contiguous) as int32 [rows / 32,
        # cols / 4]; the thread's 8 columns are words (p - r) / 2 + 0, 1, stored by the row octets
        # 0, 1 of the block's four
        stofs = (i3 >> 2) * (cols // 4) + ((p3 - r3) >> 1) + (i3 & 1) + k3 * 0
        if (DIAG & 8) == 0:
            gl.store(st_ptr + stofs, ocol, mask=(k3 == 2) & (r3 == 0) & ((i3 & 2) == 0))

    @gluon.jit
    def _mxfp4_dual_gluon_kernel(
        x_ptr, p_ptr, s_ptr, pt_ptr, st_ptr,  # x as int32 pairs; words / scale words as int32
        rows, cols, n_tiles_r, n_tiles_c,
        TWP: gl.constexpr, WI: gl.constexpr, WP: gl.constexpr, ASM: gl.constexpr, CON: gl.constexpr,
        BAND: gl.constexpr = 1, PERSIST: gl.constexpr = 0, DIAG: gl.constexpr = 0,
    ):
        TWI: gl.constexpr = 32 // TWP
        TI: gl.constexpr = TWI * WI  # row octets of the tile
        TP: gl.constexpr = 4 * TWP * WP  # bf16 pairs of the tile
        L3: gl.constexpr = gl.BlockedLayout([1, 8, 4], [TWI, 1, TWP], [WI, 1, WP], [2, 1, 0])
        pid = gl.program_id(0)
        if PERSIST == 0:
            pid_r, pid_c = _tile_of(pid, n_tiles_r, n_tiles_c, BAND)
            x = _tile_load(x_ptr, pid_r, pid_c, cols, None, TI, TP, L3)
            _tile_quant(x, pid_r, pid_c, p_ptr, s_ptr, pt_ptr, st_ptr, rows, cols, TI, TP, WI, WP, L3, ASM, CON,
                        DIAG)
        else:
            # persistent programs: the next tile's load is issued before this tile's codes
            n_tiles = n_tiles_r * n_tiles_c
            nprog = gl.num_programs(0)
            pid_r, pid_c = _tile_of(pid, n_tiles_r, n_tiles_c, BAND)
            x = _tile_load(x_ptr, pid_r, pid_c, cols, None, TI, TP, L3)
            for t in range(pid, n_tiles, nprog):
                nr, nc = _tile_of(t + nprog, n_tiles_r, n_tiles_c, BAND)
                xn = _tile_load(x_ptr, nr, nc, cols, t + nprog < n_tiles, TI, TP, L3)
                _tile_quant(x, pid_r, pid_c, p_ptr, s_ptr, pt_ptr, st_ptr, rows, cols, TI, TP, WI, WP, L3, ASM,
                            CON, DIAG)
                x = xn
                pid_r = nr
                pid_c = nc


def fp4_gluon_reason(x: torch.Tensor, cfg=None) -> Optional[str]:
    """None when the Gluon kernel can take ``quantize_fp4_with_trans`` of x with configuration
    ``cfg`` (default :data:`FP4_GLUON_DEFAULT`), else why not. (The default dispatch also honours
    :data:`FP4_GLUON_ENV`, docs/env_vars.md.)"""
    cfg = tuple(cfg or FP4_GLUON_DEFAULT)
    if len(cfg) not in (3, 6) or any(not isinstance(v, int) or v < 0 for v in cfg) or cfg[0] not in (4, 8) \
            or min(cfg[1:3]) < 1:
        return f"configuration {cfg}: (TWP in 4, 8; WI, WP >= 1[, maxnreg, BAND, programs per SM >= 0])"
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        return f"x must be 2-D bf16, got {x.dtype} of shape {tuple(x.shape)}"
    tr, tc = gluon_tile(cfg)
    rows, cols = x.shape
    if rows == 0 or cols == 0 or rows % tr or cols % tc:
        return f"shape {tuple(x.shape)} is not a multiple of the {tr} x {tc} tile"
    if not x.is_contiguous() or x.data_ptr() % 16:
        return "x must be contiguous and 16-byte aligned"
    if rows * cols >= 2**31:
        return f"{rows} x {cols} elements: the kernel's int32 offsets cover fewer than 2**31"
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not importable"
    return gluon_platform_reason(x.device)


def fp4_gluon_with_trans_launch(x: torch.Tensor, cfg=None) -> tuple:
    """``quantize_fp4_with_trans`` of a bf16 x that :func:`fp4_gluon_reason` accepts: ``(p [rows,
    cols / 2], s [rows, cols / 32] (a transposed view), pt [cols, rows / 2], st [cols, rows / 32]
    (a transposed view))``, uint8."""
    cfg = tuple(cfg or FP4_GLUON_DEFAULT)
    reason = fp4_gluon_reason(x, cfg)
    if reason is not None:
        raise ValueError(f"fp4_gluon_with_trans_launch: {reason}")
    return launch_config(x, cfg)


def launch_config(x: torch.Tensor, cfg: tuple) -> tuple:
    """The launch of configuration ``cfg`` (3 or 6 values) without the checks (the sm_90 compile
    checks run it on CPU tensors)."""
    if len(cfg) == 6:
        return _launch(x, cfg[:3], maxnreg=cfg[3], band=max(cfg[4], 1), persist=cfg[5])
    return _launch(x, cfg)


def _num_sms(dev) -> int:
    if dev.type != "cuda":
        return 132  # sm_90 compile checks on CPU tensors
    from .quant_fp8_kernel import _sm_count

    return _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())


def _launch(x: torch.Tensor, cfg: tuple, maxnreg: int = 0, diag: int = 0, band: int = 1, persist: int = 0) -> tuple:
    """The launch itself (scripts/quant_sass_stats.py compiles it on CPU tensors). ``maxnreg`` caps
    the registers, ``band`` tile rows run side by side, ``persist`` persistent programs per SM
    (0: one program per tile); ``diag`` (timing only, scripts/diag_fp4_gluon.py; outputs
    incomplete): bit 1 leaves the transposed words out, bit 2 the row words, bit 4 the codes (every
    slot the xor of the thread's pairs: the loads stay), bit 8 the scales."""
    rows, cols = x.shape
    twp, wi, wp = cfg[:3]
    tr, tc = gluon_tile(cfg)
    dev = x.device
    p = torch.empty((rows, cols // 2), dtype=torch.uint8, device=dev)
    pt = torch.empty((cols, rows // 2), dtype=torch.uint8, device=dev)
    sb = torch.empty((cols // 32, rows), dtype=torch.uint8, device=dev)
    stb = torch.empty((rows // 32, cols), dtype=torch.uint8, device=dev)
    n_tr, n_tc = rows // tr, cols // tc
    grid = n_tr * n_tc if not persist else min(n_tr * n_tc, persist * _num_sms(dev))
    _mxfp4_dual_gluon_kernel[(grid,)](
        x.view(torch.int32), p.view(torch.int32), sb.view(torch.int32), pt.view(torch.int32), stb.view(torch.int32),
        rows, cols, n_tr, n_tc, TWP=twp, WI=wi, WP=wp, ASM=_PTX[twp], CON=_CONSTRAINTS, BAND=band,
        PERSIST=int(bool(persist)), DIAG=diag, num_warps=wi * wp,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    return p, sb.t(), pt, stb.t()
