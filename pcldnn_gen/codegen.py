"""KernelPlan → C source, by rendering the Jinja templates in `templates/`.

Templates stay free of decisions: block sizes and edge geometry come from the plan, and
the few ISA spellings (vector type, load, broadcast, FMA) come from `VectorISA`, so one
template serves scalar C, AVX2 and AVX-512 and never assumes a vector width.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import textwrap
from dataclasses import dataclass
from importlib import resources

import jinja2

from pcldnn_runtime import cpu
from pcldnn_runtime.abi import SIGNATURES
from pcldnn_runtime.families import Engine
from pcldnn_runtime.geometry import (
    amx_conv_geometry,
    amx_packed_reduction,
    amx_packed_row_steps,
    bf16_weight_ring_rows,
    fc_tile_geometry,
    input_pixel_floats,
)
from pcldnn_runtime.limits import blocks
from pcldnn_runtime.manifest import PEAK_SYMBOL, SGD_SYMBOL, kernel_kinds
from pcldnn_runtime.validate import NAME_RE, full_match, show

from . import __version__
from .arch import Arch
from .compiler import Source
from .errors import PlanError
from .netspec import LayerSpec
from .planner import KernelPlan, kernel_layer, reads_packed_image
from .planner.plans import ConvBwdWeightsPlan


@dataclass(frozen=True)
class VectorISA:
    """How one ISA spells the vector operations the templates use."""

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
                      _AVX2_TRANSPOSE),
    "avx512": VectorISA("__m512", "immintrin.h", "_mm512_loadu_ps({a})", "_mm512_storeu_ps({a}, {v})",
                        "_mm512_set1_ps(*({a}))", "_mm512_fmadd_ps({a}, {b}, {c})",
                        "_mm512_max_ps({a}, {b})", "_mm512_set1_ps({v})", "_mm512_add_ps({a}, {b})", "__m512",
                        "{{ const __mmask16 gt = _mm512_cmp_ps_mask({v}, {b}, _CMP_GT_OQ); "
                        "{b} = _mm512_mask_blend_ps(gt, {b}, {v}); "
                        "{w} = _mm512_mask_blend_ps(gt, {w}, _mm512_castsi512_ps(_mm512_set1_epi32({p}))); }}",
                        "_mm512_storeu_ps((float *)({a}), {v})", '__asm__("" : "+v"({v}));', "_mm512_reduce_add_ps({v})",
                        _avx512_transpose()),
    "scalar": VectorISA("float", "", "*({a})", "*({a}) = {v}", "*({a})", "{c} + {a} * {b}",
                        "fmaxf({a}, {b})", "({v})", "{a} + {b}", "int",
                        "if ({v} > {b}) {{ {b} = {v}; {w} = {p}; }}", "*({a}) = {v}"),
}

# bf16 kernels: the AVX-512 spellings, except for the reduction. A weight vector is 16 oc lanes
# x a pair of input channels (32 bf16), an input operand is one pixel's pair broadcast to every
# lane (32 bits), and vdpbf16ps adds both products of each lane's pair to its fp32 accumulator.
BF16_ISA = dataclasses.replace(
    VECTOR_ISAS["avx512"], operand_type="__m512bh",
    _operand_load="(__m512bh)_mm512_loadu_si512((const void *)({a}))",
    _operand_broadcast="(__m512bh)_mm512_set1_epi32(bf16_pair({a}))",
    _fma="_mm512_dpbf16_ps({c}, {a}, {b})")


def c_comment(text: object) -> str:
    """Text made inert inside a C block comment: printable ASCII only (no newline, no
    backslash that could splice lines), and no sequence that ends or opens a comment or
    forms a trigraph. Every string from a user (names, descriptions) reaches generated
    comments through this function only."""
    out = re.sub(r"[^ -~]|\\", "?", str(text))
    while "*/" in out or "/*" in out or "??" in out:
        out = out.replace("*/", "* /").replace("/*", "/ *").replace("??", "? ?")
    return out


def c_identifier(name: str) -> str:
    """A name that becomes part of a C symbol: it must fully match NAME_RE (netspec enforces
    the same pattern; this is the generator's own check, at the point of use)."""
    if not full_match(NAME_RE, name):
        raise PlanError(f"{show(name)} cannot be used in a C identifier (must match {NAME_RE.pattern})")
    return name


def c_float(value: float) -> str:
    """A float literal in exponent form (a float in C even when whole: 2 -> 2.000000000e+00f),
    9 digits after the point: round-trips a float32."""
    return f"{float(value):.9e}f"


def c_hex_ull(value: int) -> str:
    """An unsigned long long literal in hex."""
    if not 0 <= value < 2 ** 64:
        raise PlanError(f"{value} does not fit an unsigned long long")
    return f"0x{value:X}ULL"


@functools.lru_cache(maxsize=1)
def template_env() -> jinja2.Environment:
    """The templates, found through the package (editable install or wheel alike)."""
    folder = resources.files("pcldnn_gen.templates")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(folder)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["c_comment"] = c_comment
    env.filters["c_float"] = c_float
    env.filters["c_hex_ull"] = c_hex_ull
    env.globals["blocks"] = blocks  # channel blocks of V lanes: the one rounding rule
    env.globals["bf16_weight_ring_rows"] = bf16_weight_ring_rows  # the runtime sizes the rings' scratch by it
    env.globals["pair_column_phases"] = pair_column_phases
    return env


def pair_column_phases(kernel_w: int, stride_w: int) -> tuple[int, ...]:
    """The column phases (column mod 2 SW) of a vdpbf16ps backward-weights x pair copy that some
    kernel column reads: kernel column kw reads columns 2 j SW + kw, phase kw mod 2 SW; only
    those are copied (a 1x1 window reads one of 2 SW)."""
    return tuple(sorted({kw % (2 * stride_w) for kw in range(kernel_w)}))


def kernel_symbol(layer: str, pass_name: str) -> str:
    return f"pcldnn_{c_identifier(layer)}_{c_identifier(pass_name)}"


def _comment_lines(plan: KernelPlan) -> list[str]:
    lines = [f"pass    : {plan.pass_name} ({plan.kind})"]
    if plan.tile is not None:
        blocks_line = f"blocks  : register tile {plan.tile.width} x {plan.tile.vectors} vectors"
        if plan.reduction_chunk():
            blocks_line += f", reduction chunk {plan.reduction_chunk()}"
        if plan.remainders:
            blocks_line += f", remainder tiles {list(plan.remainders)}"
        lines.append(blocks_line)
    elif plan.blocks_summary():
        lines += [("blocks  : " if i == 0 else "          ") + w
                  for i, w in enumerate(textwrap.wrap(c_comment(plan.blocks_summary()), 88))]
    wrapped = textwrap.wrap(c_comment(plan.reason), 88)
    lines += [("why     : " if i == 0 else "          ") + w for i, w in enumerate(wrapped)]
    if plan.measured is not None:
        m = plan.measured
        times = ", ".join(f"{t.width}x{t.vectors} {t.ms:.3f} ms" for t in m.timings)
        tuned = (f"tile from the tuning database (model's first choice {m.model[0]}x{m.model[1]}); "
                 f"measured at minibatch {m.batch}, {m.threads} thread(s): {times}")
        lines += [("tuned   : " if i == 0 else "          ") + w for i, w in enumerate(textwrap.wrap(c_comment(tuned), 88))]
    return lines


def render_kernel(layer: LayerSpec, plan: KernelPlan, arch: Arch) -> Source:
    """C source of one (layer, pass) kernel: the plan's template with the plan, the ISA's
    spellings and the layer's blocked sizes. A bf16 plan (kind *_bf16: plan_layer with bf16)
    reads bf16 operands in pairs (lane_step 2) with the BF16_ISA spellings."""
    net_layer, layer = layer, kernel_layer(layer, plan)
    v = arch.vector_floats
    symbol = kernel_symbol(layer.name, plan.pass_name)
    c, h, w = layer.in_shape
    icb = blocks(c, v)
    kind = plan.kind
    bf16 = plan.engine is Engine.VDPBF16
    lines = _comment_lines(plan)
    if plan.engine is Engine.AMX or (layer.type == "fc" and bf16):
        return _render_tiled(layer, plan, arch, symbol, lines)
    if bf16:
        pairs = "neighbouring output pixels" if plan.pass_name == "bwd_weights" else (
            "output channels" if plan.pass_name == "bwd_data" else
            "a kernel row's window values" if kind == "conv_fwd_packed_bf16" else "input channels")
        text = (f"bf16 operands, a pair of {pairs} per 32-bit lane (vdpbf16ps), fp32 accumulation; "
                "blocks planned for 2-byte operands")
        if kind == "conv_fwd_packed_bf16":
            text += "; the fp32 image converted by the kernel into a padded bf16 copy, read in place"
        if kind == "conv_bwd_weights_packed_bf16":
            text += ("; x and dy paired by the kernel, band by band, x as words of a pair copy of each padded row "
                     "(its values a window's, and its neighbour pixel's)")
        if isinstance(plan, ConvBwdWeightsPlan):
            x_ring, dy_ring = bf16_weight_ring_rows(plan.block_rows, layer.stride, layer.kernel, plan.band_images,
                                                    layer.in_shape[1])
            band = (f"{plan.band_images} whole images" if plan.band_images > 1 else f"{plan.block_rows} output rows")
            text += (f"; x and dy paired band by band ({band}) into rings of two bands' "
                     f"rows ({x_ring} input, {dy_ring} output rows per channel block), read by the band's tiles "
                     "from L2")
        lines += [("precision: " if i == 0 else "           ") + w for i, w in enumerate(textwrap.wrap(text, 87))]
    text = template_env().get_template(plan.template).render(
        layer=layer, net_layer=net_layer, arch=arch, plan=plan, V=v, vec=BF16_ISA if bf16 else VECTOR_ISAS[arch.isa],
        symbol=symbol,
        params=SIGNATURES[kind], tile_params=SIGNATURES["conv_weight_tiles"], version=__version__, plan_lines=lines,
        elem="unsigned short" if bf16 else "float", lane_step=2 if bf16 else 1,
        R=plan.tile.vectors if plan.tile else 0, icb=icb, ocb=blocks(layer.out_shape[0], v),
        xv=input_pixel_floats(layer.index, layer.type, c, v),
        ic_tail=c - (icb - 1) * v, k=icb * v * h * w, size=icb * v * h * w, classes=c, ld=icb * v)
    flags = cpu.PRECISION_CFLAGS["bf16"] if bf16 or any(plan.activations) or any(plan.gradients) else ()
    symbols = {symbol: kind}
    if plan.kernel_kind.weight_copy:  # and the function making its weight copy
        symbols[symbol + "_tiles"] = "conv_weight_tiles"
    return Source(f"{layer.name}_{plan.pass_name}.c", text, symbols, flags)


def _render_tiled(layer: LayerSpec, plan: KernelPlan, arch: Arch, symbol: str, lines: list[str]) -> Source:
    """An AMX tile kernel, or an fc layer's vdpbf16ps kernel on the same tile layouts: bf16
    operands it converts itself (an fc layer's weights: its tile copies), fp32 results."""
    v = arch.vector_floats
    amx = plan.engine is Engine.AMX
    if layer.type == "fc":
        text = {"fwd": "the input", "bwd_data": "the output gradient, masked by the ReLU",
                "bwd_weights": "the input transposed, the output gradient, masked by the ReLU, in image pairs"
                }[plan.pass_name]
        if plan.pass_name != "bwd_weights":
            text += "; the weights: the layer's tile copy, made once after each change of the weights"
    else:
        packed = plan.kernel_kind.packed and amx
        in_place = getattr(plan, "in_place", False)
        text = {"fwd": ("the input as a padded bf16 copy whose kernel rows the A tiles read in place" if in_place else
                        "the input's windows as im2col rows") + ", the weights as B tiles" if packed else
                "the input with its zero padding, the weights as B tiles",
                "bwd_data": "the output gradient, masked by the ReLU, a bf16 copy of each row whose pixels the A "
                            "tiles read in place, the weights transposed as B tiles" if packed else
                            "the output gradient, masked by the ReLU, with its zero padding, the weights as B tiles",
                "bwd_weights": "the output gradient (masked by the ReLU) channel-major, the input's windows as "
                               "im2col rows in pixel pairs" if packed else
                               "the input channel-major with its zero padding, the output gradient, masked by the "
                               "ReLU, in pixel pairs"}[plan.pass_name]
        if getattr(plan, "direct", False):  # planner.amx.reads_source_in_place
            text = ("the input" if plan.pass_name == "fwd" else "the output gradient") + \
                ", read in place as it is stored in bf16; the weights as B tiles"
    how = "AMX tdpbf16ps into fp32 tiles" if amx else "vdpbf16ps into fp32 registers"
    text = f"bf16 operands converted by the kernel ({text}), {how}; fp32 results"
    lines += [("precision: " if i == 0 else "           ") + w for i, w in enumerate(textwrap.wrap(text, 87))]
    c, h, w = layer.in_shape
    text = template_env().get_template(plan.template).render(
        layer=layer, arch=arch, plan=plan, V=v, symbol=symbol, params=SIGNATURES[plan.kind],
        tile_params=SIGNATURES["conv_weight_tiles"],
        version=__version__, plan_lines=lines, vec=VECTOR_ISAS[arch.isa], dot=BF16_ISA, amx=amx,
        icb=blocks(c, v), ocb=blocks(layer.out_shape[0], v), k=blocks(c, v) * v * h * w,
        geo=amx_conv_geometry(plan.pass_name, layer.in_shape, layer.out_shape, layer.kernel, layer.pad, layer.stride)
        if layer.type == "conv" else fc_tile_geometry(layer.in_shape, layer.out_shape[0], v),
        kp=amx_packed_reduction(layer.in_shape, layer.kernel), row_steps=amx_packed_row_steps(layer.in_shape, layer.kernel))
    symbols = {symbol: plan.kind}
    if plan.kernel_kind.weight_copy:  # and the function making its weight tiles
        symbols[symbol + "_tiles"] = "conv_weight_tiles"
    return Source(f"{layer.name}_{plan.pass_name}.c", text, symbols,
                  cpu.PRECISION_CFLAGS["bf16"] + (cpu.AMX_CFLAGS if amx else ()))


def render_layout(layer: LayerSpec, arch: Arch, precision: str = "fp32") -> Source:
    """C source of a layer's canonical <-> blocked conversions (activations and weights), and
    in a bf16 build the bf16 copies its vdpbf16ps forward kernel reads, or an AMX fc layer's
    weight tiles."""
    packed = reads_packed_image(layer, arch)
    roles = kernel_kinds(layer, arch.target(precision))["layout"]
    wshape = None
    if layer.weighted:
        oc, ic = layer.out_shape[0], layer.in_shape[0]
        wshape = (oc, ic, *layer.kernel)
    text = template_env().get_template("layout.c.j2").render(
        layer=layer, arch=arch, V=arch.vector_floats, vec=VECTOR_ISAS[arch.isa], version=__version__,
        prefix=f"pcldnn_{c_identifier(layer.name)}", wshape=wshape, params=SIGNATURES,
        packed_input=packed,
        bf16="in_to_bf16" in roles,
        fc_tiles=fc_tile_geometry(layer.in_shape, layer.out_shape[0], arch.vector_floats) if "wt_to_tiles" in roles else None)
    prefix = f"pcldnn_{c_identifier(layer.name)}_"
    return Source(f"{layer.name}_layout.c", text, {prefix + r: kind for r, kind in roles.items()},
                  cpu.PRECISION_CFLAGS["bf16"] if "in_to_bf16" in roles or "wt_to_tiles" in roles else ())



def peak_accumulators(arch: Arch) -> int:
    """Independent FMA chains of the peak kernel: latency x units keeps every unit busy."""
    return min(max(2 * arch.fma_latency * arch.fma_units, 1), arch.vector_registers - 2)


def render_peak(arch: Arch) -> Source:
    """C source of the FMA peak micro-kernel (the denominator of every efficiency figure):
    `bench` and `peak` time it, and every build carries it for PCLDNN_VERBOSE's % of peak."""
    text = template_env().get_template("peak.c.j2").render(
        arch=arch, vec=VECTOR_ISAS[arch.isa], symbol=PEAK_SYMBOL, version=__version__,
        params=SIGNATURES["peak"], accumulators=peak_accumulators(arch))
    return Source("peak.c", text, {PEAK_SYMBOL: "peak"})


def render_sgd() -> Source:
    """C source of the optimizer's update over the flat parameter buffer (pcldnn_runtime.optim)."""
    text = template_env().get_template("sgd.c.j2").render(version=__version__, symbol=SGD_SYMBOL,
                                                          params=SIGNATURES["sgd"])
    return Source("sgd.c", text, {SGD_SYMBOL: "sgd"})


def peak_flops_per_iteration(arch: Arch) -> int:
    """FLOPs of one thread's loop iteration of the peak kernel."""
    return 2 * arch.vector_floats * peak_accumulators(arch)
