"""MXFP4 quantizers for bf16 input that work on bf16 *pairs* (``bf16x2``): two elements per 32-bit
register and per instruction.

The tl kernels of quant_fp4_kernel.py widen every element to fp32 and form its E2M1 code with
~15 scalar instructions (21 SASS instructions per element in all, measured at the sm_90 compile:
the single-copy quantizer is ALU bound on the H200). Here x is read as int32 (two bf16 per word:
element ``2p`` in the low half, ``2p + 1`` in the high half) and the code of both halves is formed
by one straight-line PTX sequence on packed values (``tl.inline_asm_elementwise``): ~7 SASS
instructions per element for the codes, ~12 per element in all at the sm_90 compile (21 before);
with the transposed copy ~25 (42 before). scripts/quant_sass_stats.py prints them.

Exactness (bit for bit the contract of primus_turbo.testing.quant_ref, RNE, saturation to +-6, NaN
-> 0, -0 and small negatives -> 0x8). Per pair register ``p`` with the block multiplier ``m =
2**(127 - byte)`` in both halves (a power of two, a normal bf16 for every byte the MX rule gives):

1. ``a = p & 0x7fff7fff``; ``y = mul.rn.bf16x2(a, m)``: |x| * m, exact (a power-of-two scaling of
   a bf16 whose result is < 8; bf16 has fp32's exponent range and sm_90 keeps bf16 subnormals);
   ``t = min.NaN.bf16x2(y, 6)``: the saturated magnitude, NaN kept (canonical 0x7fff).
2. ``c = (max.bf16x2(t, 1) & 0x7f807f80) | 0x00400040`` = 1.5 * 2**seg, seg = 0, 1, 2 the E2M1
   segment of t (step 0.5 below 2, 1 in [2, 4), 2 in [4, 6]).
3. ``r = fma.rn.bf16x2(c, 64, t)`` = 1.5 * 2**(6 + seg) + t rounded ONCE to bf16, whose ulp there
   is the segment's step: t rounded to its E2M1 grid, half to even (the grid's even codes are the
   even multiples of the step).
4. ``v = fma.rn.bf16x2(r, 2**-126, -c * 2**-120)`` = (r - 1.5 * 2**(6 + seg)) * 2**-126 = (E2M1
   value of t) * 2**-126, exact. Scaled by 2**-126 the E2M1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 are
   the bf16 bit patterns 0x000, 0x040, 0x080, ..., 0x1c0 (0.5 lands on the subnormal 0x40):
   ``v = code << 6`` in each half. ``-c * 2**-120`` is ``c + 0x44004400`` on the bits (exponent
   -120, sign set; no carry between halves). NaN: r and v are NaN; ``max.bf16x2(v, 0)`` turns
   them into 0 (a non-NaN max returns the other operand).
5. The sign bit (bit 15 / 31 of p) goes to bit 9 / 25 next to the code, except where v was NaN
   (its bit 9 is set, never in a code): ``z = v0 | ((p >> 6) & 0x02000200 & ~v)``.

Packing: the row-wise copy packs eight consecutive elements ``e0..e7`` (four pairs) into one
int32 word, nibble i = element i. The four pairs are re-paired with ``prmt`` to (e_j, e_{j+4})
first, so that ``word = (z0 >> 6) + (z1 >> 2) + (z2 << 2) + (z3 << 6)`` (disjoint nibbles). The
column-wise copy (the transposed copy of ``quantize_fp4_with_trans``) packs the codes of 8 rows of
one column: from 8 pair registers (rows 8i + k, the same two columns) it forms the two words of
columns 2p and 2p + 1 with shifts and three-way byte permutes.

The instruction sequences are generated from one op list (``_row_word_prog`` ...) that gives both
the PTX and a numpy model of it (``emulate``), which tests/triton/test_quant_fp4_packed.py runs
over every bf16 bit pattern against the reference encoder. The interpreter (CPU tests) runs the
``SOFT`` branch instead: the same data flow (int32 pair loads, words, scales) with the fp32 nibble
code of quant_fp4_kernel.py.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from primus_turbo.triton import cdiv, is_interpreter

from .quant_fp8_kernel import _mx_scales, _tile_pid
from .quant_fp8_packed import _load4, _maxabs2

__all__ = ["fp4_packed_ok", "fp4_packed_launch", "fp4_packed_with_trans_launch", "emulate",
           "ROW_WORD_PROG", "COL_WORDS_PROG", "AMAX_WORD_PROG"]

# ----------------------------------------------------------------------------------------------
# The op programs: (op, dst, *srcs); sources are register names or int immediates
# ----------------------------------------------------------------------------------------------
_K = {  # constant registers (bf16x2 bit patterns)
    "k6": 0x40C040C0,     # 6.0
    "k1": 0x3F803F80,     # 1.0
    "k64": 0x42804280,    # 64.0
    "ksub": 0x00800080,   # 2**-126
    "kz": 0x00000000,     # +0.0
    "kabs": 0x7FFF7FFF,
    "kexp": 0x7F807F80,
    "kmant": 0x00400040,
    "kneg": 0x44004400,
    "ksgn": 0x02000200,
    # quant_fp4_gluon.py's program
    "k96": 0x42C042C0,    # 96.0 = 1.5 * 2**6
    "kK": 0x83C083C0,     # -1.5 * 2**-120
    "kfl": 0x01000100,    # exponent field 2 (the MX scale's floor), as lanes
    "kmb": 0x80808080,
    "k3": 0x00030003,
    "kff": 0x00FF00FF,
}
_LUT_AND_OR = 0xEA       # (a & b) | c
_LUT_OR_ANDN = 0xF4      # a | (b & ~c)   [a=0xF0, b=0xCC, c=0xAA: 0xF0 | (0xCC & 0x55)]


def _pair_code(p: str, m: str, z: str, tag: str) -> list:
    """Ops forming z (code << 6 | sign << 9 in each half) from the pair p and multiplier pair m."""
    a, y, t, c, r, n, v, w, s = (f"{x}{tag}" for x in "aytcrnvws")
    return [
        ("and", a, p, "kabs"),
        ("mul_bf", y, a, m),
        ("min_nan_bf", t, y, "k6"),
        ("max_bf", c, t, "k1"),
        ("lop3", c, c, "kexp", "kmant", _LUT_AND_OR),
        ("fma_bf", r, c, "k64", t),
        ("add", n, c, "kneg"),
        ("fma_bf", v, r, "ksub", n),
        ("max_bf", w, v, "kz"),
        ("shr", s, p, 6),
        ("and", s, s, "ksgn"),
        ("lop3", z, w, s, v, _LUT_OR_ANDN),
    ]


def _row_word_prog() -> tuple:
    """Inputs p0..p3 (elements e0..e7 of one row, natural pairs), m; output word."""
    ops = [
        ("prmt", "q0", "p0", "p2", 0x5410),  # (e0, e4)
        ("prmt", "q1", "p0", "p2", 0x7632),  # (e1, e5)
        ("prmt", "q2", "p1", "p3", 0x5410),  # (e2, e6)
        ("prmt", "q3", "p1", "p3", 0x7632),  # (e3, e7)
    ]
    for j in range(4):
        ops += _pair_code(f"q{j}", "m", f"z{j}", str(j))
    ops += [
        ("shr", "o", "z0", 6),
        ("shr", "o1", "z1", 2),
        ("add", "o", "o", "o1"),
        ("shl", "o2", "z2", 2),
        ("add", "o", "o", "o2"),
        ("shl", "o3", "z3", 6),
        ("add", "o", "o", "o3"),
    ]
    return ("p0", "p1", "p2", "p3", "m"), ("o",), ops


def _col_words_prog() -> tuple:
    """Inputs p0..p7 (rows 8i + k of columns 2c, 2c + 1), m (the two columns' multipliers);
    outputs the words of column 2c and of column 2c + 1 (nibble k = row 8i + k)."""
    ops = []
    for k in range(8):
        ops += _pair_code(f"p{k}", "m", f"z{k}", str(k))
    for k in range(4):
        # rows 2k, 2k+1: column 2c's nibbles at bits 8..15 (byte 1), column 2c+1's at 24..31 (byte 3)
        ops += [("shl", f"h{k}", f"z{2 * k}", 2), ("shl", f"g{k}", f"z{2 * k + 1}", 6),
                ("add", f"h{k}", f"h{k}", f"g{k}")]
    ops += [
        ("prmt", "t0", "h0", "h1", 0x7351),  # bytes: h0.b1, h1.b1, h0.b3, h1.b3
        ("prmt", "t1", "h2", "h3", 0x7351),
        ("prmt", "oe", "t0", "t1", 0x5410),  # column 2c: rows 0..7
        ("prmt", "oo", "t0", "t1", 0x7632),  # column 2c + 1
    ]
    return tuple(f"p{k}" for k in range(8)) + ("m",), ("oe", "oo"), ops


def _amax_word_prog() -> tuple:
    """Inputs p0..p3; output an int32 whose top 16 bits are the largest |x| of the 8 bf16 as bits
    (NaN above inf), low bits unspecified: as fp32 bits its exponent field is the amax's."""
    ops = [
        ("max_nan_xsa_bf", "u", "p0", "p1"),
        ("max_nan_xsa_bf", "u", "u", "p2"),
        ("max_nan_xsa_bf", "u", "u", "p3"),
        ("and", "u", "u", "kabs"),
        ("shl", "l", "u", 16),
        ("max_u32", "o", "u", "l"),
    ]
    return ("p0", "p1", "p2", "p3"), ("o",), ops


ROW_WORD_PROG = _row_word_prog()
COL_WORDS_PROG = _col_words_prog()
AMAX_WORD_PROG = _amax_word_prog()


def _ptx(prog) -> str:
    """PTX text of an op program: inputs $n_out.., outputs $0.. (all .b32 registers)."""
    ins, outs, ops = prog
    names = {}
    for i, o in enumerate(outs):
        names[o] = f"${i}"
    for i, x in enumerate(ins):
        names[x] = f"${len(outs) + i}"
    regs = []
    for op in ops:
        if op[1] not in names:
            names[op[1]] = f"%r_{op[1]}"
            regs.append(names[op[1]])
    used_k = sorted({s for op in ops for s in op[2:] if isinstance(s, str) and s in _K})
    for k in used_k:
        names[k] = f"%r_{k}"
        regs.append(names[k])
    lines = ["{", ".reg .b32 " + ", ".join(regs) + ";"]
    lines += [f"mov.b32 {names[k]}, {_K[k]};" for k in used_k]

    def n(s):
        return str(s) if isinstance(s, int) else names[s]

    for op in ops:
        kind, d, *s = op
        if kind == "and":
            lines.append(f"and.b32 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "add":
            lines.append(f"add.u32 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "shr":
            lines.append(f"shr.u32 {n(d)}, {n(s[0])}, {s[1]};")
        elif kind == "shl":
            lines.append(f"shl.b32 {n(d)}, {n(s[0])}, {s[1]};")
        elif kind == "max_u32":
            lines.append(f"max.u32 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "lop3":
            lines.append(f"lop3.b32 {n(d)}, {n(s[0])}, {n(s[1])}, {n(s[2])}, {s[3]};")
        elif kind == "prmt":
            lines.append(f"prmt.b32 {n(d)}, {n(s[0])}, {n(s[1])}, {s[2]};")
        elif kind == "mul_bf":
            lines.append(f"mul.rn.bf16x2 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "min_nan_bf":
            lines.append(f"min.NaN.bf16x2 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "max_bf":
            lines.append(f"max.bf16x2 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "max_nan_xsa_bf":
            lines.append(f"max.NaN.xorsign.abs.bf16x2 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "fma_bf":
            lines.append(f"fma.rn.bf16x2 {n(d)}, {n(s[0])}, {n(s[1])}, {n(s[2])};")
        elif kind == "sub":
            lines.append(f"sub.u32 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "mul_hi":
            lines.append(f"mul.hi.u32 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "mov":
            lines.append(f"mov.b32 {n(d)}, {n(s[0])};")
        elif kind == "abs_bf":
            lines.append(f"abs.bf16x2 {n(d)}, {n(s[0])};")
        elif kind == "min_bf":
            lines.append(f"min.bf16x2 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "max_u16x2":
            lines.append(f"max.u16x2 {n(d)}, {n(s[0])}, {n(s[1])};")
        elif kind == "laneid":
            lines.append(f"mov.u32 {n(d)}, %laneid;")
        elif kind == "shfl":  # butterfly across the warp's lanes (all 32 converged)
            lines.append(f"shfl.sync.bfly.b32 {n(d)}, {n(s[0])}, {s[1]}, 0x1f, 0xffffffff;")
        else:  # pragma: no cover - programming error
            raise ValueError(kind)
    lines.append("}")
    return "\n".join(lines)


_ROW_WORD_PTX = tl.constexpr(_ptx(ROW_WORD_PROG))
_COL_WORDS_PTX = tl.constexpr(_ptx(COL_WORDS_PROG))
_AMAX_WORD_PTX = tl.constexpr(_ptx(AMAX_WORD_PROG))


# ----------------------------------------------------------------------------------------------
# numpy model of the PTX ops (for the exhaustive CPU test of the sequences)
# ----------------------------------------------------------------------------------------------
_CANON_NAN = 0x7FFF


def _bf_split(u: np.ndarray):
    u = u.astype(np.uint32)
    return (u & 0xFFFF).astype(np.uint16), (u >> 16).astype(np.uint16)


def _bf_to_f64(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _rne_bf16(v: np.ndarray) -> np.ndarray:
    """float64 -> bf16 bits, round to nearest even, subnormals kept, NaN canonical."""
    v = np.asarray(v, dtype=np.float64)
    nan = np.isnan(v)
    a = np.abs(np.where(nan, 0.0, v))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(e, -126.0)
    ulp = np.exp2(e - 7)
    r = np.rint(a / ulp) * ulp  # numpy rint: ties to even
    f = r.astype(np.float32)  # exact: r is a bf16 value (or overflows to inf)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)
    bits = np.where(np.isinf(a), 0x7F80, bits).astype(np.uint16)
    bits = np.where(np.signbit(v) & ~nan, bits | 0x8000, bits).astype(np.uint16)
    return np.where(nan, _CANON_NAN, bits).astype(np.uint16)


def _bf_op(fn, *args):
    halves = [_bf_split(a) for a in args]
    res = []
    for h in (0, 1):
        res.append(fn(*[x[h] for x in halves]).astype(np.uint32))
    return (res[0] | (res[1] << 16)).astype(np.uint32)


def _isnan16(h):
    return ((h & 0x7FFF) > 0x7F80)


def _minmax16(a, b, take_max: bool, nan_prop: bool):
    """max / min.bf16x2 per half: -0 < +0; with ``nan_prop`` (the .NaN forms) a NaN operand gives
    the canonical NaN, else the other operand (both NaN: canonical NaN)."""
    fa, fb = _bf_to_f64(a), _bf_to_f64(b)
    na, nb = _isnan16(a), _isnan16(b)
    key_a = np.where(fa == 0, np.where(a & 0x8000, -0.5, 0.5) * 1e-300, fa)
    key_b = np.where(fb == 0, np.where(b & 0x8000, -0.5, 0.5) * 1e-300, fb)
    r = np.where(key_a >= key_b if take_max else key_a <= key_b, a, b)
    if nan_prop:
        return np.where(na | nb, _CANON_NAN, r)
    r = np.where(na & ~nb, b, np.where(nb & ~na, a, r))
    return np.where(na & nb, _CANON_NAN, r)


def _max16_xsa_nan(a, b):
    m = np.maximum(a & 0x7FFF, b & 0x7FFF)
    r = m | ((a ^ b) & 0x8000)
    return np.where(_isnan16(a) | _isnan16(b), _CANON_NAN | ((a ^ b) & 0x8000), r)


def _prmt(a, b, sel):
    src = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    out = np.zeros(a.shape, dtype=np.uint32)
    for i in range(4):
        b = src[(sel >> (4 * i)) & 7].astype(np.uint32)
        if (sel >> (4 * i)) & 8:  # sign mode: the selected byte's msb replicated
            b = np.where(b & 0x80, 0xFF, 0).astype(np.uint32)
        out |= b << (8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros(a.shape, dtype=np.uint32)
    for bit in range(8):
        ta, tb, tc = (bit >> 2) & 1, (bit >> 1) & 1, bit & 1
        if (lut >> ((ta << 2) | (tb << 1) | tc)) & 1:
            out |= (a if ta else ~a) & (b if tb else ~b) & (c if tc else ~c)
    return out.astype(np.uint32)


def emulate(prog, *inputs: np.ndarray):
    """Run an op program on uint32 arrays with a numpy model of each PTX instruction (bf16x2
    arithmetic: exact fp64 result rounded once to bf16; this is exact for the operands here:
    products of two bf16 and sums whose exact value fits fp64 or lies far from a tie)."""
    ins, outs, ops = prog
    env = {k: np.full(inputs[0].shape, v, dtype=np.uint32) for k, v in _K.items()}
    for name, val in zip(ins, inputs):
        env[name] = np.asarray(val, dtype=np.uint32)

    def g(s):
        return np.full(inputs[0].shape, s, dtype=np.uint32) if isinstance(s, int) else env[s]

    M = np.uint64(0xFFFFFFFF)
    for op in ops:
        kind, d, *s = op
        if kind == "and":
            r = g(s[0]) & g(s[1])
        elif kind == "add":
            r = ((g(s[0]).astype(np.uint64) + g(s[1]).astype(np.uint64)) & M).astype(np.uint32)
        elif kind == "shr":
            r = g(s[0]) >> np.uint32(s[1])
        elif kind == "shl":
            r = ((g(s[0]).astype(np.uint64) << np.uint64(s[1])) & M).astype(np.uint32)
        elif kind == "max_u32":
            r = np.maximum(g(s[0]), g(s[1]))
        elif kind == "lop3":
            r = _lop3(g(s[0]), g(s[1]), g(s[2]), s[3])
        elif kind == "prmt":
            r = _prmt(g(s[0]), g(s[1]), s[2])
        elif kind == "mul_bf":
            r = _bf_op(lambda a, b: np.where(_isnan16(a) | _isnan16(b), _CANON_NAN,
                                             _rne_bf16(_bf_to_f64(a) * _bf_to_f64(b))), g(s[0]), g(s[1]))
        elif kind == "min_nan_bf":
            r = _bf_op(lambda a, b: _minmax16(a, b, False, True), g(s[0]), g(s[1]))
        elif kind == "max_bf":
            r = _bf_op(lambda a, b: _minmax16(a, b, True, False), g(s[0]), g(s[1]))
        elif kind == "max_nan_xsa_bf":
            r = _bf_op(_max16_xsa_nan, g(s[0]), g(s[1]))
        elif kind == "fma_bf":
            r = _bf_op(lambda a, b, c: np.where(_isnan16(a) | _isnan16(b) | _isnan16(c), _CANON_NAN,
                                                _rne_bf16(_bf_to_f64(a) * _bf_to_f64(b) + _bf_to_f64(c))),
                       g(s[0]), g(s[1]), g(s[2]))
        elif kind == "sub":
            r = ((g(s[0]).astype(np.uint64) - g(s[1]).astype(np.uint64)) & M).astype(np.uint32)
        elif kind == "mul_hi":
            r = ((g(s[0]).astype(np.uint64) * g(s[1]).astype(np.uint64)) >> np.uint64(32)).astype(np.uint32)
        elif kind == "mov":
            r = g(s[0])
        elif kind == "abs_bf":
            r = g(s[0]) & np.uint32(0x7FFF7FFF)
        elif kind == "min_bf":
            r = _bf_op(lambda a, b: _minmax16(a, b, False, False), g(s[0]), g(s[1]))
        elif kind == "max_u16x2":
            a, b = g(s[0]), g(s[1])
            r = np.maximum(a & 0xFFFF, b & 0xFFFF) | (np.maximum(a >> 16, b >> 16) << 16)
        elif kind == "laneid":  # the lanes are the last axis (32 wide)
            r = np.broadcast_to(np.arange(32, dtype=np.uint32), inputs[0].shape).copy()
        elif kind == "shfl":  # the lanes are the last axis (32 wide)
            v = g(s[0])
            if v.shape[-1] != 32:
                raise ValueError(f"emulate: shfl needs the lanes as the last axis (32), got shape {v.shape}")
            r = v[..., np.arange(32) ^ s[1]]
        else:  # pragma: no cover
            raise ValueError(kind)
        env[d] = np.asarray(r, dtype=np.uint32)
    return tuple(env[o] for o in outs)


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _halves(p):
    """int32 pairs -> (fp32 of the low bf16, fp32 of the high bf16)."""
    return (p << 16).to(tl.float32, bitcast=True), (p & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _nib_soft(xf, m):
    """Interpreter: the E2M1 nibble of fp32 ``xf`` under multiplier ``m`` (fp32), exact fp32 path."""
    t = tl.minimum(tl.abs(xf * m), 6.0, propagate_nan=tl.PropagateNan.ALL)
    tb = t.to(tl.int32, bitcast=True)
    e = tl.maximum(tb >> 23, 127)
    cb = (e << 23) + 188743680
    r = t + cb.to(tl.float32, bitcast=True)
    code = r.to(tl.int32, bitcast=True) - cb + 2 * e - 254
    code = code | ((xf.to(tl.int32, bitcast=True) >> 28) & 8)
    return tl.where(tb > 0x7F800000, 0, code)


@triton.jit
def _amax_word(p0, p1, p2, p3, SOFT: tl.constexpr):
    """int32 whose top 16 bits are max |x| over the 8 bf16 of p0..p3 (as bits, NaN above inf)."""
    if SOFT:
        a = tl.maximum((p0 << 16) & 0x7FFF0000, p0 & 0x7FFF0000)
        a = tl.maximum(a, tl.maximum((p1 << 16) & 0x7FFF0000, p1 & 0x7FFF0000))
        a = tl.maximum(a, tl.maximum((p2 << 16) & 0x7FFF0000, p2 & 0x7FFF0000))
        return tl.maximum(a, tl.maximum((p3 << 16) & 0x7FFF0000, p3 & 0x7FFF0000))
    else:
        return tl.inline_asm_elementwise(_AMAX_WORD_PTX, "=r,r,r,r,r", [p0, p1, p2, p3], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _row_word(p0, p1, p2, p3, m2, SOFT: tl.constexpr):
    """The packed E2M1 word of the 8 bf16 in p0..p3 (one row, consecutive) under the multiplier
    pair ``m2`` (bf16 bits in both halves)."""
    if SOFT:
        m = (m2 << 16).to(tl.float32, bitcast=True)
        w = tl.zeros(p0.shape, dtype=tl.int32)
        lo, hi = _halves(p0)
        w |= _nib_soft(lo, m) | (_nib_soft(hi, m) << 4)
        lo, hi = _halves(p1)
        w |= (_nib_soft(lo, m) << 8) | (_nib_soft(hi, m) << 12)
        lo, hi = _halves(p2)
        w |= (_nib_soft(lo, m) << 16) | (_nib_soft(hi, m) << 20)
        lo, hi = _halves(p3)
        w |= (_nib_soft(lo, m) << 24) | (_nib_soft(hi, m) << 28)
        return w
    else:
        return tl.inline_asm_elementwise(_ROW_WORD_PTX, "=r,r,r,r,r,r", [p0, p1, p2, p3, m2], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _col_words(p0, p1, p2, p3, p4, p5, p6, p7, m2, SOFT: tl.constexpr):
    """(word of column 2c, word of column 2c + 1): nibble k = the code of row k (p_k holds the
    two columns' elements of row k) under the columns' multipliers ``m2`` (low, high half)."""
    if SOFT:
        ml = (m2 << 16).to(tl.float32, bitcast=True)
        mh = (m2 & -65536).to(tl.float32, bitcast=True)
        we = tl.zeros(p0.shape, dtype=tl.int32)
        wo = tl.zeros(p0.shape, dtype=tl.int32)
        ps = (p0, p1, p2, p3, p4, p5, p6, p7)
        for k in tl.static_range(8):
            lo, hi = _halves(ps[k])
            we |= _nib_soft(lo, ml) << (4 * k)
            wo |= _nib_soft(hi, mh) << (4 * k)
        return we, wo
    else:
        return tl.inline_asm_elementwise(_COL_WORDS_PTX, "=r,=r,r,r,r,r,r,r,r,r,r",
                                         [p0, p1, p2, p3, p4, p5, p6, p7, m2], dtype=(tl.int32, tl.int32),
                                         is_pure=True, pack=1)


@triton.jit
def _mult_pair(blk_bits):
    """Block amax (fp32 bits: only the exponent field is used) -> (multiplier as a bf16 pair, byte)."""
    mult, byte = _mx_scales(blk_bits, 2)
    mb = mult.to(tl.int32, bitcast=True) >> 16  # a power of two (or 1.0): the bf16 is exact
    return mb | (mb << 16), byte


@triton.jit
def _split4(p, R: tl.constexpr, NB: tl.constexpr):
    """[R, 16 * NB] int32 pairs -> four [R, NB, 4]: pair 4w + j of block b's word w, j = 0..3 (the
    in-thread 16-byte vector). Kept 3-D (block, word) so the block amax broadcasts back to the
    words in the reduction's own layout (a 2-D reshape there costs a shared-memory round trip)."""
    a, b = tl.split(tl.reshape(p, (R, NB, 4, 2, 2)))
    p0, p2 = tl.split(a)
    p1, p3 = tl.split(b)
    return p0, p1, p2, p3


@triton.jit
def _row_words(p, R: tl.constexpr, NB: tl.constexpr, SOFT: tl.constexpr):
    """[R, 16 * NB] int32 pairs (rows of bf16) -> (words [R, NB, 4], E8M0 bytes [R, NB] int32)."""
    p0, p1, p2, p3 = _split4(p, R, NB)
    am = _amax_word(p0, p1, p2, p3, SOFT)  # [R, NB, 4]
    m2, byte = _mult_pair(tl.max(am, axis=2))
    w = _row_word(p0, p1, p2, p3, tl.broadcast_to(m2[:, :, None], (R, NB, 4)), SOFT)
    return w, byte


@triton.jit
def _store_row_words(p_ptr, s_ptr, w, byte, r, pid_c, rows, n_pairs, stride_p, stride_s,
                     R: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr, stride_sb=1):
    """Store words [R, NB, 4] and bytes [R, NB] of rows ``r`` at block column pid_c * NB (the
    bytes at ``r * stride_s + block * stride_sb``)."""
    b = pid_c * NB + tl.arange(0, NB)
    r64 = r.to(tl.int64)
    wofs = r64[:, None, None] * stride_p + (b[None, :, None] * 4 + tl.arange(0, 4)[None, None, :])
    sofs = r64[:, None] * stride_s + b.to(tl.int64)[None, :] * stride_sb
    if EVEN:
        tl.store(p_ptr + wofs, w)
        tl.store(s_ptr + sofs, byte.to(tl.uint8))
    else:
        bm = (r < rows)[:, None] & (b < n_pairs // 16)[None, :]
        tl.store(p_ptr + wofs, w, mask=bm[:, :, None])
        tl.store(s_ptr + sofs, byte.to(tl.uint8), mask=bm)


@triton.jit
def _quant_mxfp4_packed_kernel(
    x_ptr, p_ptr, s_ptr,  # x as int32 pairs, packed words, E8M0 bytes
    rows, n_pairs, n_tiles_c,  # pairs per row (cols / 2), tiles along the pairs
    stride_x, stride_p, stride_s,  # row strides: x (pairs), p (words), s (bytes)
    TR: tl.constexpr, TC: tl.constexpr, EVEN: tl.constexpr, SOFT: tl.constexpr,
):
    """MXFP4 along rows of a bf16 [TR, TC] tile read as int32 pairs (cols % 32 == 0)."""
    pid_r, pid_c = _tile_pid(n_tiles_c)
    TP: tl.constexpr = TC // 2
    NB: tl.constexpr = TC // 32
    r = pid_r * TR + tl.arange(0, TR)
    pc = pid_c * TP + tl.arange(0, TP)
    ptrs = x_ptr + r.to(tl.int64)[:, None] * stride_x + pc[None, :]
    if EVEN:
        p = tl.load(ptrs)
    else:
        p = tl.load(ptrs, mask=(r < rows)[:, None] & (pc < n_pairs)[None, :], other=0)
    w, byte = _row_words(p, TR, NB, SOFT)
    _store_row_words(p_ptr, s_ptr, w, byte, r, pid_c, rows, n_pairs, stride_p, stride_s, TR, NB, EVEN)


@triton.jit
def _packed_eighth(v, k: tl.constexpr, i, pid_c, p_ptr, s_ptr, rows, n_pairs, stride_p, stride_s, stride_sb,
                   TE: tl.constexpr, TP: tl.constexpr, EVEN: tl.constexpr, SOFT: tl.constexpr):
    """Row-wise copy of eighth k (rows 8i + k, int32 pairs [TE, TP])."""
    NB: tl.constexpr = TP // 16
    w, byte = _row_words(v, TE, NB, SOFT)
    _store_row_words(p_ptr, s_ptr, w, byte, 8 * i + k, pid_c, rows, n_pairs, stride_p, stride_s, TE, NB, EVEN,
                     stride_sb)


@triton.jit
def _quant_mxfp4_packed_dual_kernel(
    # pointers: x as int32 pairs; row-wise words + bytes; transposed words + bytes
    x_ptr, p_ptr, s_ptr, pt_ptr, st_ptr,
    rows, n_pairs, n_tiles_c,
    # row strides: x (pairs), p (words), s (bytes), pt (words: rows / 8), st (bytes); the scales'
    # strides along their blocks (1, or the other dim where the launcher stores them transposed)
    stride_x, stride_p, stride_s, stride_pt, stride_st, stride_sb, stride_stb,
    TR: tl.constexpr, TC: tl.constexpr, EVEN: tl.constexpr, SOFT: tl.constexpr, DIAG: tl.constexpr = 0,
):
    """``quantize_fp4_with_trans`` for bf16 from one read of a [TR, TC] tile, on bf16 pairs.

    As _quant_mxfp4_dual_kernel: eight row-interleaved eighths (rows 8i + k), each a [TR/8, TC/2]
    int32 tile; the row-wise copy per eighth; the column-wise words of rows 8i..8i+7 formed in
    registers (two per pair: its two columns), interleaved to [TR/8, TC], transposed through
    shared memory and stored as rows of the transposed copy (int32 [cols, rows / 8]).

    DIAG (timing only, scripts/diag_quant_stages.py --fp4): bit 2 leaves the column-wise copy out,
    bit 4 the row-wise copy."""
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_c
    pid_c = pid % n_tiles_c
    TE: tl.constexpr = TR // 8
    TP: tl.constexpr = TC // 2
    i = pid_r * TE + tl.arange(0, TE)
    pc = pid_c * TP + tl.arange(0, TP)
    base = x_ptr + (8 * i).to(tl.int64)[:, None] * stride_x + pc[None, :]
    mask = None if EVEN else (i < rows // 8)[:, None] & (pc < n_pairs)[None, :]
    v0, v1, v2, v3 = _load4(base, stride_x, mask, EVEN)
    v4, v5, v6, v7 = _load4(base + 4 * stride_x, stride_x, mask, EVEN)
    if (DIAG & 4) == 0:
        _packed_eighth(v0, 0, i, pid_c, p_ptr, s_ptr, rows, n_pairs, stride_p, stride_s, stride_sb, TE,
                           TP, EVEN, SOFT)
        _packed_eighth(v1, 1, i, pid_c, p_ptr, s_ptr, rows, n_pairs, stride_p, stride_s, stride_sb, TE,
                           TP, EVEN, SOFT)
        _packed_eighth(v2, 2, i, pid_c, p_ptr, s_ptr, rows, n_pairs, stride_p, stride_s, stride_sb, TE,
                           TP, EVEN, SOFT)
        _packed_eighth(v3, 3, i, pid_c, p_ptr, s_ptr, rows, n_pairs, stride_p, stride_s, stride_sb, TE,
                           TP, EVEN, SOFT)
        _packed_eighth(v4, 4, i, pid_c, p_ptr, s_ptr, rows, n_pairs, stride_p, stride_s, stride_sb, TE,
                           TP, EVEN, SOFT)
        _packed_eighth(v5, 5, i, pid_c, p_ptr, s_ptr, rows, n_pairs, stride_p, stride_s, stride_sb, TE,
                           TP, EVEN, SOFT)
        _packed_eighth(v6, 6, i, pid_c, p_ptr, s_ptr, rows, n_pairs, stride_p, stride_s, stride_sb, TE,
                           TP, EVEN, SOFT)
        _packed_eighth(v7, 7, i, pid_c, p_ptr, s_ptr, rows, n_pairs, stride_p, stride_s, stride_sb, TE,
                           TP, EVEN, SOFT)
    if (DIAG & 2) == 0:
        # column blocks: 32 rows = 4 octets x 8 eighths; |x| per half, max over the eighths in registers
        a = _maxabs2(_maxabs2(_maxabs2(v0, v1, SOFT), _maxabs2(v2, v3, SOFT), SOFT),
                     _maxabs2(_maxabs2(v4, v5, SOFT), _maxabs2(v6, v7, SOFT), SOFT), SOFT)
        a = tl.reshape(a, (TE // 4, 4, TP))
        blo = tl.max(a << 16, axis=1)  # fp32 bits of the low columns' amax
        bhi = tl.max(a & -65536, axis=1)
        mlo, bylo = _mx_scales(blo, 2)
        mhi, byhi = _mx_scales(bhi, 2)
        m2 = ((mlo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (mhi.to(tl.int32, bitcast=True) & -65536)
        m2 = tl.reshape(tl.broadcast_to(m2[:, None, :], (TE // 4, 4, TP)), (TE, TP))
        we, wo = _col_words(v0, v1, v2, v3, v4, v5, v6, v7, m2, SOFT)
        w = tl.reshape(tl.join(we, wo), (TE, TC))  # column 2p + h
        wt = tl.trans(w)  # [TC, TE]: row c of the transposed copy
        c = pid_c * TC + tl.arange(0, TC)
        c64 = c.to(tl.int64)
        byte = tl.reshape(tl.join(bylo, byhi), (TE // 4, TC)).to(tl.uint8)
        sb = pid_r * (TR // 32) + tl.arange(0, TR // 32)
        if EVEN:
            tl.store(pt_ptr + c64[:, None] * stride_pt + i[None, :], wt)
            tl.store(st_ptr + c64[None, :] * stride_st + sb.to(tl.int64)[:, None] * stride_stb, byte)
        else:
            tmask = (c < 2 * n_pairs)[:, None] & (i < rows // 8)[None, :]
            tl.store(pt_ptr + c64[:, None] * stride_pt + i[None, :], wt, mask=tmask)
            tl.store(st_ptr + c64[None, :] * stride_st + sb.to(tl.int64)[:, None] * stride_stb, byte,
                     mask=(sb < rows // 32)[:, None] & (c < 2 * n_pairs)[None, :])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
def fp4_packed_ok(x: torch.Tensor, with_trans: bool) -> bool:
    """Whether the pair kernels cover x: bf16, 2-D, unit column stride, cols (and, with the
    transposed copy, rows) multiples of 32, a 4-byte aligned row start."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or x.numel() == 0:
        return False
    rows, cols = x.shape
    if cols % 32 or x.stride(0) % 2 or x.data_ptr() % 4:
        return False
    return not with_trans or rows % 32 == 0


def fp4_packed_launch(x: torch.Tensor, cfg) -> tuple:
    """MXFP4 along rows of a bf16 x (see :func:`fp4_packed_ok`): ``(packed [rows, cols/2] uint8,
    scale [rows, cols/32] uint8)``. ``cfg`` = (TR, TC, num_warps[, ...])."""
    rows, cols = x.shape
    tr, tc, nw = cfg[:3]
    xp = x.contiguous().view(torch.int32)  # [rows, cols / 2]
    p = torch.empty((rows, cols // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((rows, cols // 32), dtype=torch.uint8, device=x.device)
    n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
    _quant_mxfp4_packed_kernel[(n_tr * n_tc,)](
        xp, p.view(torch.int32), s, rows, cols // 2, n_tc, cols // 2, cols // 8, cols // 32,
        TR=tr, TC=tc, EVEN=rows % tr == 0 and cols % tc == 0, SOFT=is_interpreter(), num_warps=nw,
    )
    return p, s


def fp4_packed_with_trans_launch(x: torch.Tensor, cfg) -> tuple:
    """``quantize_fp4_with_trans`` of a bf16 x (rows, cols % 32 == 0): ``(p, s, pt, st)``.
    ``cfg`` = (TR, TC, num_warps[, maxnreg[, options]]) with TR, TC multiples of 32; options,
    comma-separated: "tscale" (the scales stored transposed, returned as transposed views: a
    tile's column-block scales fill whole sectors), "diag<mask>" (timing only: outputs
    incomplete, the kernel's DIAG)."""
    opts = [o for o in str(cfg[4]).split(",") if o] if len(cfg) > 4 else []
    unknown = [o for o in opts if o != "tscale" and not o.startswith("diag")]
    if unknown:
        raise ValueError(f"unknown MXFP4 pair-kernel options {unknown} in {cfg}")
    diag = next((int(o[4:]) for o in opts if o.startswith("diag")), 0)
    ts = "tscale" in opts
    rows, cols = x.shape
    tr, tc, nw = cfg[:3]
    extra = {"maxnreg": cfg[3]} if len(cfg) > 3 and isinstance(cfg[3], int) and cfg[3] and not is_interpreter() \
        else {}
    xp = x.contiguous().view(torch.int32)
    dev = x.device
    p = torch.empty((rows, cols // 2), dtype=torch.uint8, device=dev)
    pt = torch.empty((cols, rows // 2), dtype=torch.uint8, device=dev)
    if ts:  # scales stored transposed, returned as the transposed views (same shapes and values)
        s = torch.empty((cols // 32, rows), dtype=torch.uint8, device=dev).t()
        st = torch.empty((rows // 32, cols), dtype=torch.uint8, device=dev).t()
    else:
        s = torch.empty((rows, cols // 32), dtype=torch.uint8, device=dev)
        st = torch.empty((cols, rows // 32), dtype=torch.uint8, device=dev)
    n_tr, n_tc = cdiv(rows, tr), cdiv(cols, tc)
    _quant_mxfp4_packed_dual_kernel[(n_tr * n_tc,)](
        xp, p.view(torch.int32), s, pt.view(torch.int32), st, rows, cols // 2, n_tc,
        cols // 2, cols // 8, s.stride(0), rows // 8, st.stride(0), s.stride(1), st.stride(1),
        TR=tr, TC=tc, EVEN=rows % tr == 0 and cols % tc == 0, SOFT=is_interpreter(), DIAG=diag, num_warps=nw,
        **extra,
    )
    return p, s, pt, st
