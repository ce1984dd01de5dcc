"""How each target spells the operations the templates name: the only place C intrinsics live.

Templates say what they do (`vec.load(p)`, `bf.to_bf16_words(v)`, `tile.dot(c, a, b)`) and a
target's table says how its CPU does it, so one template serves every target that has a table
for it, and a new target (another ISA, another bf16 or tile engine) is a new table, not a new
template (docs/design.md, section 4):

- `VectorISA` (`vec`): the fp32 kernels' vector type and operations on scalar C, AVX2 and
  AVX-512, every fp32 template's spellings (and, as BF16_ISA, the vdpbf16ps reduction's);
- `Spelling` tables of named operations, each filled with its operands in order: `bf`, what the
  bf16 and AMX kernels do on vectors (fp32 loads, stores and masks, the bf16 conversions, the
  16-bit word shuffles that pair channels), and `tile`, the AMX tile operations.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class VectorISA:
    """How one ISA spells the vector operations the templates use. Operands are names, loads or
    other spelled calls: the scalar spellings are plain C operators (`{c} + {a} * {b}`) and do
    not parenthesize an operand, so a sum passed as one would bind wrongly (give it a name)."""

    type: str
    include: str
    _load: str
    _store: str
    _broadcast: str
    _fma: str
    _max: str
    _set1: str
    _add: str
    index_type: str       # a vector of int32 lane indices (kept as float bits in AVX registers)
    _argmax: str          # statement: where the value beats best, take it and its index
    _index_store: str
    # Statement that pins a value in a register: gcc otherwise folds a streamed weight load into
    # every FMA that uses it (3 loads instead of 1 for a 3-pixel tile), which saturates the load
    # ports (llvm-mca: VGG-A conv2 forward's 3x4 tile at 84% of peak, 100% with the value pinned).
    _pin: str = ""
    _hsum: str = "{v}"   # expression: the sum of a vector's lanes (few-channel conv backward-data)
    # Body of transpose_vxv(s, ss, d, ds): d[j * ds + i] = s[i * ss + j] for one V x V block, in
    # registers (fc backward-data panels, layout conversions); empty: _common's scalar loop.
    transpose: str = ""
    # The reduction operands (weights, broadcast inputs) where they differ from the accumulators:
    # bf16 kernels hold bf16 pairs (operand_type) and accumulate them with a dot product (_fma).
    operand_type: str = ""
    _operand_load: str = ""
    _operand_broadcast: str = ""
    _min: str = ""       # lane-wise minimum (a ReLU6's clip)
    # The arithmetic of the activations computed from their input (templates/_activation.c.j2):
    _mul: str = ""
    _sub: str = ""
    _div: str = ""
    _abs: str = ""
    _round: str = ""     # to the nearest integer, as a float
    _pow2: str = ""      # 2^n of an integral n in [-126, 127], by its exponent bits
    _if_negative: str = ""  # where x < 0 (its sign bit), a, else b

    def mul(self, a: str, b: str) -> str:
        return self._mul.format(a=a, b=b)

    def sub(self, a: str, b: str) -> str:
        """a - b"""
        return self._sub.format(a=a, b=b)

    def div(self, a: str, b: str) -> str:
        """a / b"""
        return self._div.format(a=a, b=b)

    def abs(self, a: str) -> str:
        return self._abs.format(a=a)

    def round(self, a: str) -> str:
        return self._round.format(a=a)

    def pow2(self, n: str) -> str:
        return self._pow2.format(a=n)

    def if_negative(self, x: str, a: str, b: str) -> str:
        return self._if_negative.format(x=x, a=a, b=b)

    def operand(self) -> str:
        return self.operand_type or self.type

    def operand_load(self, addr: str) -> str:
        return (self._operand_load or self._load).format(a=addr)

    def operand_broadcast(self, addr: str) -> str:
        return (self._operand_broadcast or self._broadcast).format(a=addr)

    def pin(self, var: str) -> str:
        return self._pin.format(v=var)

    def hsum(self, var: str) -> str:
        return self._hsum.format(v=var)

    def argmax_update(self, value: str, best: str, where: str, pos: str) -> str:
        return self._argmax.format(v=value, b=best, w=where, p=pos)

    def index_zero(self) -> str:
        return "0" if self.index_type == "int" else self.zero()  # all-zero bits are int32 zeros

    def index_store(self, addr: str, value: str) -> str:
        return self._index_store.format(a=addr, v=value)

    def load(self, addr: str) -> str:
        return self._load.format(a=addr)

    def store(self, addr: str, value: str) -> str:
        return self._store.format(a=addr, v=value)

    def broadcast(self, addr: str) -> str:
        return self._broadcast.format(a=addr)

    def fma(self, a: str, b: str, acc: str) -> str:
        """acc + a*b"""
        return self._fma.format(a=a, b=b, c=acc)

    def max(self, a: str, b: str) -> str:
        return self._max.format(a=a, b=b)

    def min(self, a: str, b: str) -> str:
        return self._min.format(a=a, b=b)

    def set1(self, value: str) -> str:
        return self._set1.format(v=value)

    def zero(self) -> str:
        return self.set1("0.0f")

    def add(self, a: str, b: str) -> str:
        return self._add.format(a=a, b=b)


_AVX2_TRANSPOSE = """\
    /* unpack pairs of rows, shuffle (4 x 4 blocks within 128-bit halves), swap halves */
    const __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ss), r2 = _mm256_loadu_ps(s + 2 * ss),
                 r3 = _mm256_loadu_ps(s + 3 * ss), r4 = _mm256_loadu_ps(s + 4 * ss), r5 = _mm256_loadu_ps(s + 5 * ss),
                 r6 = _mm256_loadu_ps(s + 6 * ss), r7 = _mm256_loadu_ps(s + 7 * ss);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
                 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
                 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(d + 0 * ds, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(d + 1 * ds, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(d + 2 * ds, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(d + 3 * ds, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(d + 4 * ds, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(d + 5 * ds, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(d + 6 * ds, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(d + 7 * ds, _mm256_permute2f128_ps(u3, u7, 0x31));"""


def _avx512_transpose() -> str:
    """16 x 16 in registers: unpack pairs of rows (2 x 2 float blocks), shuffle pairs of those
    (4 x 4 within each 128-bit lane), then exchange 128-bit lanes twice."""
    lines = ["    /* unpack, shuffle, two lane exchanges */"]
    decl = lambda name, exprs: "    const __m512 " + ",\n                 ".join(  # noqa: E731
        ", ".join(f"{name}{i} = {e}" for i, e in list(enumerate(exprs))[k:k + 2]) for k in range(0, 16, 2)) + ";"
    lines.append(decl("r", [f"_mm512_loadu_ps(s + {i} * ss)" for i in range(16)]))
    lines.append(decl("t", [f"_mm512_unpack{'lo' if i % 2 == 0 else 'hi'}_ps(r{i - i % 2}, r{i - i % 2 + 1})"
                            for i in range(16)]))
    u = []
    for i in range(16):  # within each group of four: (t0, t2) lo/hi halves, (t1, t3) lo/hi halves
        g, j = divmod(i, 4)
        a, b = (4 * g, 4 * g + 2) if j < 2 else (4 * g + 1, 4 * g + 3)
        u.append(f"_mm512_shuffle_ps(t{a}, t{b}, {'0x44' if j % 2 == 0 else '0xEE'})")
    lines.append(decl("u", u))
    v = []
    for i in range(16):  # 128-bit lanes 0, 2 (0x88) and 1, 3 (0xDD) of rows j and j + 4 in each half
        h, j = divmod(i, 8)
        v.append(f"_mm512_shuffle_f32x4(u{8 * h + j % 4}, u{8 * h + 4 + j % 4}, {'0x88' if j < 4 else '0xDD'})")
    lines.append(decl("v", v))
    for i in range(16):
        lines.append(f"    _mm512_storeu_ps(d + {i} * ds, _mm512_shuffle_f32x4(v{i % 8}, v{8 + i % 8}, "
                     f"{'0x88' if i < 8 else '0xDD'}));")
    return "\n".join(lines)


VECTOR_ISAS: dict[str, VectorISA] = {
    "avx2": VectorISA("__m256", "immintrin.h", "_mm256_loadu_ps({a})", "_mm256_storeu_ps({a}, {v})",
                      "_mm256_broadcast_ss({a})", "_mm256_fmadd_ps({a}, {b}, {c})",
                      "_mm256_max_ps({a}, {b})", "_mm256_set1_ps({v})", "_mm256_add_ps({a}, {b})", "__m256",
                      "{{ const __m256 gt = _mm256_cmp_ps({v}, {b}, _CMP_GT_OQ); {b} = _mm256_blendv_ps({b}, {v}, gt); "
                      "{w} = _mm256_blendv_ps({w}, _mm256_castsi256_ps(_mm256_set1_epi32({p})), gt); }}",
                      "_mm256_storeu_ps((float *)({a}), {v})", '__asm__("" : "+x"({v}));',
                      "({{ __m128 s_ = _mm_add_ps(_mm256_castps256_ps128({v}), _mm256_extractf128_ps({v}, 1)); "
                      "s_ = _mm_add_ps(s_, _mm_movehl_ps(s_, s_)); _mm_cvtss_f32(_mm_add_ss(s_, _mm_movehdup_ps(s_))); }})",
                      _AVX2_TRANSPOSE, _min="_mm256_min_ps({a}, {b})", _mul="_mm256_mul_ps({a}, {b})",
                      _sub="_mm256_sub_ps({a}, {b})", _div="_mm256_div_ps({a}, {b})",
                      _abs="_mm256_andnot_ps(_mm256_set1_ps(-0.0f), {a})",
                      _round="_mm256_round_ps({a}, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)",
                      _pow2="_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32({a}), "
                            "_mm256_set1_epi32(127)), 23))",
                      _if_negative="_mm256_blendv_ps({b}, {a}, {x})"),
    "avx512": VectorISA("__m512", "immintrin.h", "_mm512_loadu_ps({a})", "_mm512_storeu_ps({a}, {v})",
                        "_mm512_set1_ps(*({a}))", "_mm512_fmadd_ps({a}, {b}, {c})",
                        "_mm512_max_ps({a}, {b})", "_mm512_set1_ps({v})", "_mm512_add_ps({a}, {b})", "__m512",
                        "{{ const __mmask16 gt = _mm512_cmp_ps_mask({v}, {b}, _CMP_GT_OQ); "
                        "{b} = _mm512_mask_blend_ps(gt, {b}, {v}); "
                        "{w} = _mm512_mask_blend_ps(gt, {w}, _mm512_castsi512_ps(_mm512_set1_epi32({p}))); }}",
                        "_mm512_storeu_ps((float *)({a}), {v})", '__asm__("" : "+v"({v}));', "_mm512_reduce_add_ps({v})",
                        _avx512_transpose(), _min="_mm512_min_ps({a}, {b})", _mul="_mm512_mul_ps({a}, {b})",
                        _sub="_mm512_sub_ps({a}, {b})", _div="_mm512_div_ps({a}, {b})", _abs="_mm512_abs_ps({a})",
                        _round="_mm512_roundscale_ps({a}, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)",
                        _pow2="_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32({a}), "
                              "_mm512_set1_epi32(127)), 23))",
                        _if_negative="_mm512_mask_blend_ps(_mm512_cmp_ps_mask({x}, _mm512_setzero_ps(), _CMP_LT_OQ), "
                                     "{b}, {a})"),
    "scalar": VectorISA("float", "", "*({a})", "*({a}) = {v}", "*({a})", "{c} + {a} * {b}",
                        "fmaxf({a}, {b})", "({v})", "{a} + {b}", "int",
                        "if ({v} > {b}) {{ {b} = {v}; {w} = {p}; }}", "*({a}) = {v}", _min="fminf({a}, {b})",
                        _mul="{a} * {b}", _sub="{a} - {b}", _div="{a} / {b}", _abs="fabsf({a})", _round="rintf({a})",
                        _pow2="ldexpf(1.0f, (int){a})", _if_negative="{x} < 0.0f ? {a} : {b}"),
}

# bf16 kernels: the AVX-512 spellings, except for the reduction. A weight vector is 16 oc lanes
# x a pair of input channels (32 bf16), an input operand is one pixel's pair broadcast to every
# lane (32 bits), and vdpbf16ps adds both products of each lane's pair to its fp32 accumulator.
BF16_ISA = dataclasses.replace(
    VECTOR_ISAS["avx512"], operand_type="__m512bh",
    _operand_load="(__m512bh)_mm512_loadu_si512((const void *)({a}))",
    _operand_broadcast="(__m512bh)_mm512_set1_epi32(bf16_pair({a}))",
    _fma="_mm512_dpbf16_ps({c}, {a}, {b})")


@dataclass(frozen=True)
class Spelling:
    """A target's spellings of named operations: `table.op(a, b)` is the op's C pattern with its
    operands in order at {0}, {1}, ... ({*}: all of them, comma-separated). A template that
    names an op the target lacks fails to render: there is no fallback spelling."""
    target: str
    ops: Mapping[str, str]

    def __getattr__(self, op: str) -> Callable[..., str]:
        if op.startswith("__") or op in ("target", "ops"):  # copy, pickle and dataclass probes
            raise AttributeError(op)
        pattern = self.ops.get(op)
        if pattern is None:
            raise AttributeError(f"{self.target} has no spelling of {op!r}")

        def spell(*operands: object) -> str:
            return _FIELD.sub(lambda m: ", ".join(map(str, operands)) if m[1] == "*" else str(operands[int(m[1])]),
                              pattern)
        return spell


_FIELD = re.compile(r"\{(\d+|\*)\}")


# What the bf16 and AMX kernels do on AVX-512 vectors (AVX512_BF16 for the conversions): fp32
# vectors (__m512, lanes chosen by a __mmask16), bf16 values as 16-bit words (__m512i: 32, or
# __m256i: 16 of them), and the word shuffles that make channel pairs.
AVX512_BF16 = Spelling("AVX-512 with AVX512_BF16", {
    # fp32 vectors
    "load": "_mm512_loadu_ps({0})",
    "load_aligned": "_mm512_load_ps({0})",
    "load_masked": "_mm512_maskz_loadu_ps({0}, {1})",                # (lanes, address): others zero
    "load_masked_aligned": "_mm512_maskz_load_ps({0}, {1})",
    "gather_masked": "_mm512_mask_i32gather_ps({0}, {1}, {2}, {3}, 4)",  # (else, lanes, float indices, base)
    "store": "_mm512_storeu_ps({0}, {1})",
    "store_aligned": "_mm512_store_ps({0}, {1})",
    "stream": "_mm512_stream_ps({0}, {1})",                          # non-temporal, aligned
    "zero": "_mm512_setzero_ps()",
    "set1": "_mm512_set1_ps({0})",
    "add": "_mm512_add_ps({0}, {1})",
    "mul": "_mm512_mul_ps({0}, {1})",
    "mul_masked": "_mm512_maskz_mul_ps({0}, {1}, {2})",              # (lanes, a, b): others zero
    "max": "_mm512_max_ps({0}, {1})",
    "masked": "_mm512_maskz_mov_ps({0}, {1})",                       # (lanes, v): others zero
    "greater": "_mm512_cmp_ps_mask({0}, {1}, _CMP_GT_OQ)",           # lanes where a > b (false on NaN)
    "greater_masked": "_mm512_mask_cmp_ps_mask({0}, {1}, {2}, _CMP_GT_OQ)",
    "as_floats": "_mm512_castsi512_ps({0})",                         # 32-bit words read as floats
    "as_words": "_mm512_castps_si512({0})",
    # fp32 -> bf16 (round to nearest even) and back (exact, by a shift)
    "to_bf16": "_mm512_cvtneps_pbh({0})",                            # 16 floats -> __m256bh
    "to_bf16_words": "(__m256i)_mm512_cvtneps_pbh({0})",             # the same as 16 words
    "load_bf16": "_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *){0})), 16))",
    "widen_words": "_mm512_cvtepu16_epi32({0})",                     # 16 words -> the low halves of 16 dwords
    "shift_left": "_mm512_slli_epi32({0}, {1})",                     # dwords
    # 16-bit words and 32-bit dwords
    "words_load": "_mm512_loadu_si512({0})",
    "words_load_aligned": "_mm512_load_si512({0})",
    "words_load_masked": "_mm512_maskz_loadu_epi16({0}, {1})",       # (__mmask32 words, address)
    "words_store": "_mm512_storeu_si512({0}, {1})",
    "words_store_masked": "_mm512_mask_storeu_epi16({0}, {1}, {2})",  # (address, words, value)
    "words_stream": "_mm512_stream_si512({0}, {1})",
    "words_zero": "_mm512_setzero_si512()",
    "words_masked": "_mm512_maskz_mov_epi16({0}, {1})",
    "words_or": "_mm512_or_si512({0}, {1})",
    "words_and": "_mm512_and_si512({0}, {1})",
    "set_words": "_mm512_set_epi16({*})",                            # 32 words, the last lane first
    "set1_word": "_mm512_set1_epi16({0})",
    "set_dwords": "_mm512_set_epi32({*})",                           # 16 dwords, the last lane first
    "set1_dword": "_mm512_set1_epi32({0})",
    "mul_dwords": "_mm512_mullo_epi32({0}, {1})",
    "permute_words": "_mm512_permutexvar_epi16({0}, {1})",           # (indices, words)
    "permute_words2": "_mm512_permutex2var_epi16({0}, {1}, {2})",    # (a, indices, b): from two sources
    "align_dwords": "_mm512_alignr_epi32({0}, {1}, {2})",            # (high, low, count): shifted across
    "words_greater": "_mm512_cmpgt_epi16_mask({0}, {1})",            # signed
    "words_at_most_masked": "_mm512_mask_cmple_epi16_mask({0}, {1}, {2})",
    "dwords_nonzero": "_mm512_test_epi32_mask({0}, {1})",            # lanes where a & b != 0
    # half vectors: 16 words
    "half_load": "_mm256_loadu_si256({0})",
    "half_store": "_mm256_storeu_si256({0}, {1})",
    "half_store_aligned": "_mm256_store_si256({0}, {1})",
    "half_stream": "_mm256_stream_si256({0}, {1})",
    "half_zero": "_mm256_setzero_si256()",
    "widen_half": "_mm512_castsi256_si512({0})",                     # the upper half undefined
    "insert_upper_half": "_mm512_inserti64x4({0}, {1}, 1)",
    # memory
    "prefetch_l1": "_mm_prefetch({0}, _MM_HINT_T0)",
    "prefetch_l2": "_mm_prefetch({0}, _MM_HINT_T1)",
    "fence_streams": "_mm_sfence()",                                 # streamed stores visible to later loads
})


# AMX (tile registers 0-7, 16 rows of up to 64 bytes; palette 1): the tile operations.
AMX_TILES = Spelling("AMX-BF16", {
    "configure": "_tile_loadconfig({0})",
    "load": "_tile_loadd({0}, {1}, {2})",          # (tile, base, bytes between rows)
    "store": "_tile_stored({0}, {1}, {2})",
    "zero": "_tile_zero({0})",
    "dot": "_tile_dpbf16ps({0}, {1}, {2})",        # C += A B: (C, A, B), bf16 pairs into fp32
    "release": "_tile_release()",
})



def target_spellings(isa: str, amx: bool) -> dict[str, Spelling | None]:
    """The `bf` and `tile` tables of a build's target (None where it has none: a template that
    reaches one of its operations then fails to render)."""
    return {"bf": AVX512_BF16 if isa == "avx512" else None, "tile": AMX_TILES if amx else None}
