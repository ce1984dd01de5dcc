"""KernelPlan → C source, by rendering the Jinja templates in `templates/`.

Templates stay free of decisions: block sizes and edge geometry come from the plan, and
every C intrinsic from the target's spelling tables (`spelling`: `vec`, `bf`, `tile`), so one
template serves scalar C, AVX2 and AVX-512 and never assumes a vector width.
"""
from __future__ import annotations

import functools
import re
import textwrap
from dataclasses import replace
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
from .spelling import BF16_ISA, VECTOR_ISAS, target_spellings

COPY_SYMBOL = "pcldnn_copy"  # bench's copy-rate kernel (render_copy); no build carries it


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
    if plan.fusion is not None:
        lines += [("fused   : " if i == 0 else "          ") + w
                  for i, w in enumerate(textwrap.wrap(c_comment(plan.fusion.describe()), 88))]
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
    if plan.fusion is not None and plan.fusion.activation and plan.pass_name != "fwd":
        # a residual fusion's backward masks dy by the add's activation
        layer = replace(layer, activation=plan.fusion.activation)
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
        if arch.dot_rate != 1:
            text += f"; vdpbf16ps runs at {arch.dot_rate:g}x the fp32 kernels' FLOP rate on {arch.name} (arch dot_rate)"
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
        symbol=symbol, **target_spellings(arch.isa, arch.amx),
        params=SIGNATURES[kind], tile_params=SIGNATURES["conv_weight_tiles"], version=__version__, plan_lines=lines,
        elem="unsigned short" if bf16 else "float", lane_step=2 if bf16 else 1,
        R=plan.tile.vectors if plan.tile else 0, icb=icb, ocb=blocks(layer.out_shape[0], v),
        xv=input_pixel_floats(layer.index, layer.type, c, v, layer.groups),
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
        tile_params=SIGNATURES["conv_weight_tiles"], **target_spellings(arch.isa, arch.amx),
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


BF16_LAYOUT_ROLES = {"in_to_bf16", "wt_to_tiles", "in_to_blocked16", "out_to_blocked16"}  # need -mavx512bf16
# Layout conversions are memory-bound register transposes written in intrinsics: -O2 runs them as
# fast as -O3 (VGG-A conv4's, fp32 and bf16, timed alternately; `benchmarks/api_overhead.py` fp32
# ratios unchanged) and compiles in about half the time (0.22 s against 0.38 s a library, with the
# precompiled header; a third of the test suite's compile time was theirs)
LAYOUT_CFLAGS = ("-O2",)


def render_layout(layer: LayerSpec, arch: Arch, precision: str = "fp32",
                  activations: tuple[bool, bool] = (False, False)) -> Source:
    """C source of a layer's canonical <-> blocked conversions (activations and weights), and
    in a bf16 build the bf16 copies its vdpbf16ps forward kernel reads, or an AMX fc layer's
    weight tiles; `activations` (build.net_activations): its (input, output) stored as bf16,
    converted to and from canonical fp32 in one pass."""
    packed = reads_packed_image(layer, arch)
    roles = kernel_kinds(layer, arch.target(precision), activations)["layout"]
    wshape = None
    if layer.weighted:
        oc, ic = layer.out_shape[0], layer.in_shape[0]
        wshape = (oc, ic, *layer.kernel)
    text = template_env().get_template("layout.c.j2").render(
        layer=layer, arch=arch, V=arch.vector_floats, vec=VECTOR_ISAS[arch.isa], version=__version__,
        prefix=f"pcldnn_{c_identifier(layer.name)}", wshape=wshape, params=SIGNATURES, **target_spellings(arch.isa, arch.amx),
        packed_input=packed,
        bf16="in_to_bf16" in roles, act16={side for side in ("in", "out") if f"{side}_to_blocked16" in roles},
        fc_tiles=fc_tile_geometry(layer.in_shape, layer.out_shape[0], arch.vector_floats) if "wt_to_tiles" in roles else None)
    prefix = f"pcldnn_{c_identifier(layer.name)}_"
    return Source(f"{layer.name}_layout.c", text, {prefix + r: kind for r, kind in roles.items()},
                  LAYOUT_CFLAGS + (cpu.PRECISION_CFLAGS["bf16"] if BF16_LAYOUT_ROLES & set(roles) else ()))



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


def render_copy(arch: Arch) -> Source:
    """C source of the memory copy micro-kernel: `bench`'s copy rate, the bound its memory-bound
    rows (depthwise convolution, batchnorm) are judged against."""
    text = template_env().get_template("copy.c.j2").render(
        arch=arch, vec=VECTOR_ISAS[arch.isa], symbol=COPY_SYMBOL, version=__version__, params=SIGNATURES["copy"])
    return Source("copy.c", text, {COPY_SYMBOL: "copy"})


def render_sgd() -> Source:
    """C source of the optimizer's update over the flat parameter buffer (pcldnn_runtime.optim)."""
    text = template_env().get_template("sgd.c.j2").render(version=__version__, symbol=SGD_SYMBOL,
                                                          params=SIGNATURES["sgd"])
    return Source("sgd.c", text, {SGD_SYMBOL: "sgd"})


def peak_flops_per_iteration(arch: Arch) -> int:
    """FLOPs of one thread's loop iteration of the peak kernel."""
    return 2 * arch.vector_floats * peak_accumulators(arch)
