"""A build directory's manifest.json (the contract between generator and runtime), read
through one typed, validated schema.

The runtime trusts nothing in the file's structure: every field is type- and range-checked,
shapes must chain from the net's input and follow from each layer's window, every kernel
entry must name the symbols and kinds its layer type needs, and library paths stay inside
the build directory. Any defect is one `BuildDirError` naming the field.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import cpu, families, limits
from .activations import ACTIVATIONS, Activation, activation
from .errors import BuildDirError
from .families.fusion import plan_fusions
from .layer_types import INITS, JOINS, LAYER_PASSES, PASSES, WEIGHTED, WINDOWED, ConvKind, conv_kind, joined_shape
from .validate import LABEL_RE, NAME_RE, SHA256_RE, Fields, read_json, show

# 2: the first layer's few-channel input is packed (geometry.input_pixel_floats); a /1 build's
# kernels read it padded to V lanes, so it is refused rather than fed the wrong layout.
# 3: stride-1 AMX conv forward and backward-data kernels copy each band's source rows into a
# buffer of their own (geometry.AmxConvGeometry.banded); a /2 build's wrote the whole padded source
# into a scratch the runtime no longer sizes for them.
# 4: vdpbf16ps conv backward-weights kernels pair x and dy rows per band into rings
# (geometry.bf16_weight_scratch); a /3 build's paired the whole minibatch into a scratch that big.
# 5: the packed first layer's AMX forward reads kernel rows in place, its weight tiles sized for
# either layout (geometry.amx_packed_weight_values).
# 6: the packed first layer's backward-data runs on AMX tiles (conv_bwd_data_packed_amx) in AMX
# builds, where a /5 build has the fp32 kernel the manifest check would now refuse by kind.
# 7: a vdpbf16ps build's packed first layer has bf16 forward and backward-weights kernels
# (conv_fwd_packed_bf16, conv_bwd_weights_packed_bf16) where a /6 build has the fp32 ones.
# 8: the SGD update kernel reports non-finite weights through a flag argument a /7 build's lacks.
# 9: a conv layer may be depthwise (`groups`, kernels conv_*_depthwise, weights (C, 1, KH, KW)); a
# layer may be a batchnorm (`eps`, `momentum`), a relu6, or read other layers than the one before it
# (`inputs`; add and concat read several).
# 10: conv_fwd kernels take a statistics fusion's mean and var, batchnorm_fwd a residual fusion's
# shortcut (families.fusion); `fusion` says whether the build's kernels were planned with them.
# A layer's activation is one field, `activation` (activations.py; absent: none): /10 manifests
# written before it say `relu` (true: some activation) and `relu6` (it clips at 6); they still load.
FORMAT = "pcldnn-build/10"
FORMAT_FAMILY = "pcldnn-build/"
MANIFEST = "manifest.json"
WEIGHTS_FILE = "weights.npz"  # initial weights recorded by `compile --weights` (canonical layouts)
MAX_MANIFEST_BYTES = 64 * 1024 * 1024

# Layout conversions (symbol suffix -> kernel kind); weighted layers also convert weights.
ACT_LAYOUTS = ("in_to_blocked", "in_from_blocked", "out_to_blocked", "out_from_blocked")
WEIGHT_LAYOUTS = ("wt_to_blocked", "wt_from_blocked")
# bf16 builds: a layer with a vdpbf16ps conv forward kernel also converts its blocked input to
# the bf16 copy that kernel reads (where the input is not stored as bf16 already).
BF16_LAYOUTS = {"in_to_bf16": "act_to_bf16"}
# bf16 builds: a layer whose input or output is stored as bf16 (families.bf16_outputs: a bf16
# edge of the net) converts that canonical activation and its gradient to and from blocked bf16
# in one pass (the per-layer API); an fp32 edge's layer has the fp32 conversions only
ACT16_LAYOUTS = {"in_to_blocked16": "act_layout_to_bf16", "in_from_blocked16": "act_layout_from_bf16",
                 "out_to_blocked16": "act_layout_to_bf16", "out_from_blocked16": "act_layout_from_bf16"}
# bf16 builds: an fc layer's weights as the bf16 tiles its kernels read (geometry.FcTileGeometry)
FC_TILE_LAYOUTS = {"wt_to_tiles": "fc_weight_tiles"}


def kernel_kinds(layer: families.LayerShape, target: families.Target,
                 stored16: tuple[bool, bool] = (False, False)) -> dict[str, dict[str, str]]:
    """{pass or "layout": {symbol suffix: kernel kind}} of one layer: the one list generator
    and manifest reader share, each pass's kind from the family that computes it
    (families.choose). The bf16 copies are converted by the layout library for a vdpbf16ps conv
    forward kernel's blocked input and an fc layer's weight tiles, by a conv forward or
    backward-data kernel's library (`<pass>_tiles`, AMX or vdpbf16ps) for its weight copy
    (weight copies are kept between calls: made once after each change of the weights); the
    other kernels convert their own operands (a packed image too). stored16: whether the layer's
    (input, output) activations are stored as bf16 in its net (the bf16 layout roles)."""
    ltype = layer.type
    chosen = {p: families.choose(layer, p, target) for p in LAYER_PASSES[ltype]}
    out = {p: {p: kind.name} for p, (_, kind) in chosen.items()}
    for p, (_, kind) in chosen.items():  # their weight copies, made by a function of their own library
        if kind.weight_copy:
            out[p][f"{p}_tiles"] = "conv_weight_tiles"
    roles = ACT_LAYOUTS + (WEIGHT_LAYOUTS if ltype in WEIGHTED else ())
    out["layout"] = {r: ("weight_layout" if r.startswith("wt_") else "act_layout") for r in roles}
    if ltype == "conv" and chosen["fwd"][0].name == "conv_vdpbf16":
        out["layout"] |= BF16_LAYOUTS
    if ltype == "fc" and any(kind.engine is not families.Engine.FP32 for _, kind in chosen.values()):
        out["layout"] |= FC_TILE_LAYOUTS
    bf16_sides = {side for side, stored in zip(("in", "out"), stored16) if stored}
    out["layout"] |= {r: k for r, k in ACT16_LAYOUTS.items() if r.split("_")[0] in bf16_sides}
    return out

PEAK_SYMBOL = "pcldnn_peak"  # the build's FMA peak kernel (pcldnn_gen.codegen.render_peak)
SGD_SYMBOL = "pcldnn_sgd"    # the build's SGD update (pcldnn_gen.codegen.render_sgd)
_REL_PATH = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_./-]{0,250}")


@dataclass(frozen=True)
class KernelEntry:
    """One compiled file of a layer: its library (relative to the build directory), digest,
    C source, and {symbol: kernel kind}."""

    library: str
    sha256: str
    source: str
    symbols: dict[str, str]
    plan: dict | None  # the planner's record (for people and tools; the runtime reads no sizes from it)


@dataclass(frozen=True)
class LayerEntry:
    index: int          # position in the net (the first layer's input may be packed: geometry.input_pixel_floats)
    name: str
    type: str
    in_shape: tuple[int, int, int]
    out_shape: tuple[int, int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    pad: tuple[int, int]
    activation: str | None  # applied to its output (activations.py); an activation layer's own
    rate: float
    weight_shape: tuple[int, ...] | None
    kernels: dict[str, KernelEntry]  # by pass name, and "layout"
    bias: bool = True   # conv / fc: False keeps the bias at zero (not trained, not in the state)
    groups: int = 1     # conv: 1, or its channels (depthwise)
    eps: float = 1e-5   # batchnorm: added to the variance
    momentum: float = 0.1  # batchnorm: the running statistics' update weight
    inputs: tuple[str, ...] = ()  # the layers it reads ("input": the net's); parse_manifest sets them
    in_shapes: tuple[tuple[int, int, int], ...] = ()  # add / concat: each input's shape
    init: str = "pytorch"  # conv / fc: how the weights start (layer_types.INITS)

    @property
    def conv_kind(self) -> ConvKind | None:
        """A convolution's kind (dense, grouped, depthwise); None for other layers."""
        return conv_kind(self.type, self.groups, self.in_shape[0])

    @property
    def act(self) -> Activation | None:
        """The activation this layer applies to its output: its row of the table, or None."""
        return activation(self.activation)


@dataclass(frozen=True)
class Manifest:
    format: str
    generator: str
    net_name: str
    net_input: tuple[int, int, int]
    classes: int | None
    net_hash: str
    arch: dict          # the generator's CPU description, as recorded (validated: isa, width, flags)
    layers: tuple[LayerEntry, ...]
    weights_sha256: str | None = None  # WEIGHTS_FILE's digest when the build carries initial weights
    peak: KernelEntry | None = None  # the FMA peak kernel (PCLDNN_VERBOSE's % of peak); None in older builds
    peak_flops_per_iteration: int = 0  # its FLOPs per thread and loop iteration
    precision: str = "fp32"  # cpu.PRECISIONS: the number format of its bf16-capable kernels
    sgd: KernelEntry | None = None  # the optimizer's update kernel; None in older builds (numpy then)
    fusion: bool = False  # whether kernels do the work of layers fused into them (families.fusion)

    @property
    def isa(self) -> str:
        return self.arch["isa"]

    @property
    def vector_floats(self) -> int:
        return self.arch["vector_bits"] // 32

    @property
    def target(self) -> families.Target:
        """What the families' choices need of this build (families.choose, families.fusion)."""
        return families.Target(self.precision, self.arch.get("amx") is True, self.vector_floats)

    @property
    def uses_amx(self) -> bool:
        """Whether any kernel runs on AMX tiles (the process must be granted their state)."""
        kinds = (families.kind_named(kind) for layer in self.layers for entry in layer.kernels.values()
                 for kind in entry.symbols.values())
        return any(kind is not None and kind.engine is families.Engine.AMX for kind in kinds)


def read_manifest(build_dir: Path) -> Manifest:
    """Parse and validate `build_dir/manifest.json`."""
    path = Path(build_dir) / MANIFEST
    try:
        if not path.exists():
            raise BuildDirError(f"{build_dir}: not a build directory (no {MANIFEST}); "
                                "run `pcldnn-gen compile NET.json` first")
    except (OSError, ValueError) as e:
        raise BuildDirError(f"{build_dir}: not a usable build directory path ({e})") from None
    data = read_json(path, BuildDirError, MAX_MANIFEST_BYTES)
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt != FORMAT:
        raise BuildDirError(f"{path}: format is {fmt!r}, expected {FORMAT!r}; recompile with this version")
    return parse_manifest(data, str(path))


def parse_manifest(data: Any, origin: str) -> Manifest:
    f = Fields(origin, BuildDirError)
    f.obj(data, "", {"format", "generator", "net", "arch", "layers"}, {"weights", "peak", "precision", "sgd", "fusion"})
    net = f.obj(data["net"], "net", {"name", "input", "classes", "hash"})
    name = f.string(net["name"], "net.name", NAME_RE, "a net name")
    net_input = _shape(f, net["input"], "net.input", limits.MAX_CHANNELS)
    classes = None if net["classes"] is None else f.int_in(net["classes"], "net.classes", 1, limits.MAX_FEATURES)
    net_hash = f.string(net["hash"], "net.hash", SHA256_RE, "a sha256 digest")
    arch = _arch(f, data["arch"])
    v = arch["vector_bits"] // 32
    precision = f.choice(data.get("precision", "fp32"), "precision", cpu.PRECISIONS)
    if arch["isa"] not in cpu.PRECISION_ISAS[precision]:
        f.fail("precision", f"{precision} kernels exist for {', '.join(cpu.PRECISION_ISAS[precision])} builds, "
               f"not {arch['isa']}")
    raw_layers = f.array(data["layers"], "layers", 1, limits.MAX_LAYERS)
    layers: list[LayerEntry] = []
    outputs = {NET_INPUT: net_input}
    for i, raw in enumerate(raw_layers):
        inputs = _inputs(f, raw, i, layers[-1].name if layers else NET_INPUT, outputs)
        shapes = tuple(outputs[n] for n in inputs)
        layer = _layer(f, raw, i, _joined(f, raw, i, shapes), v, precision, arch.get("amx") is True)
        if layer.name in outputs:
            f.fail(f"layers[{i}].name", f"duplicate layer name {layer.name!r}")
        layers.append(dataclasses.replace(layer, inputs=inputs, in_shapes=shapes if len(inputs) > 1 else ()))
        outputs[layer.name] = layer.out_shape
    # Activations and gradients stored as bf16: the build's kernels read and write what
    # families.bf16_outputs and bf16_gradients say, so the manifest must say the same (a build
    # from a generator with another rule would have its activations misread).
    target = families.Target(precision, arch.get("amx") is True, v)
    stored = families.bf16_outputs(precision, target.amx, v, layers)
    for key, flags, what in (("output", stored, "that activation"),
                             ("gradient", families.bf16_gradients(precision, target.amx, v, layers),
                              "that activation's gradient")):
        for i, bf16 in enumerate(flags):
            want = "bf16" if bf16 else "fp32"
            got = f.choice(raw_layers[i].get(key, "fp32"), f"layers[{i}].{key}", ("fp32", "bf16"))
            if got != want:
                f.fail(f"layers[{i}].{key}", f"is {got} but this runtime stores {what} as {want}: "
                       "compile the net again with this version")
    for i, (layer, stored16) in enumerate(zip(layers, families.sides(stored), strict=True)):
        # each layer's layout library, now that its bf16 edges are known
        roles = kernel_kinds(layer, target, stored16)["layout"]
        layers[i] = dataclasses.replace(layer, kernels={
            **layer.kernels, **_kernels(f, raw_layers[i]["kernels"], f"layers[{i}].kernels", layer.name, {"layout": roles})})
    weights = None
    if "weights" in data:
        entry = f.obj(data["weights"], "weights", {"file", "sha256"})
        f.choice(entry["file"], "weights.file", (WEIGHTS_FILE,))
        weights = f.string(entry["sha256"], "weights.sha256", SHA256_RE, "a sha256 digest")
    peak, peak_flops = None, 0
    if "peak" in data:
        raw = f.obj(data["peak"], "peak", {"library", "sha256", "source", "symbols", "flops_per_iteration"})
        peak = _entry(f, raw, "peak", {PEAK_SYMBOL: "peak"})
        peak_flops = f.int_in(raw["flops_per_iteration"], "peak.flops_per_iteration", 1, 1 << 16)
    sgd = None
    if "sgd" in data:
        raw = f.obj(data["sgd"], "sgd", {"library", "sha256", "source", "symbols"})
        sgd = _entry(f, raw, "sgd", {SGD_SYMBOL: "sgd"})
    fusion = f.boolean(data.get("fusion", False), "fusion")
    if fusion:
        _check_fusions(f, raw_layers, layers, target)
    return Manifest(FORMAT, f.text(data["generator"], "generator"), name, net_input, classes, net_hash, arch,
                    tuple(layers), weights, peak, peak_flops, precision, sgd, fusion)


def _check_fusions(f: Fields, raw_layers: list, layers: list[LayerEntry], target: families.Target) -> None:
    """A fused build's kernels were planned for the fusions this runtime makes (families.fusion):
    their plans say so (a build from a generator with another rule would skip a layer's work)."""
    fusions = plan_fusions(layers, target)
    for i, passes in [(i, ("fwd",)) for i in fusions.statistics] + [(i, PASSES) for i in fusions.residual]:
        for p in passes:
            plan = raw_layers[i]["kernels"][p].get("plan")
            if not isinstance(plan, dict) or not isinstance(plan.get("fusion"), dict):
                f.fail(f"layers[{i}].kernels.{p}.plan.fusion", "is missing but this runtime fuses the layer's kernel: "
                       "compile the net again with this version")


NET_INPUT = "input"  # what `inputs` calls the net's input


def _inputs(f: Fields, raw: Any, index: int, previous: str, outputs: dict) -> tuple[str, ...]:
    """The layers a manifest layer reads: its `inputs` (earlier layers), else the one before it."""
    if not isinstance(raw, dict) or "inputs" not in raw:
        return (previous,)
    where = f"layers[{index}].inputs"
    names = f.array(raw["inputs"], where, 1, limits.MAX_LAYERS)
    for k, name in enumerate(names):
        if not isinstance(name, str) or name not in outputs or name in names[:k] or (name == NET_INPUT and index):
            f.fail(f"{where}[{k}]", f"must name an earlier layer (or {NET_INPUT!r}, the first layer's) once, "
                   f"got {show(name)}")
    if (len(names) > 1) != (raw.get("type") in JOINS):
        f.fail(where, f"{', '.join(JOINS)} read two or more layers, every other layer one")
    return tuple(names)


def _joined(f: Fields, raw: Any, index: int, shapes: tuple[tuple[int, int, int], ...]) -> tuple[int, int, int]:
    """The input shape a layer of these input shapes has: the one input's; a join's, as
    layer_types.joined_shape says."""
    if len(shapes) == 1:
        return shapes[0]
    joined = joined_shape(str(raw.get("type")), shapes)
    if joined is not None:
        return joined
    return f.fail(f"layers[{index}].inputs", f"inputs of shapes {[list(s) for s in shapes]} cannot be joined by "
                  f"{show(raw.get('type'))}")


def _shape(f: Fields, value: Any, where: str, max_channels: int) -> tuple[int, int, int]:
    items = f.array(value, where, 3, 3)
    return (f.int_in(items[0], f"{where}[0]", 1, max_channels),
            f.int_in(items[1], f"{where}[1]", 1, limits.MAX_SPATIAL),
            f.int_in(items[2], f"{where}[2]", 1, limits.MAX_SPATIAL))


def _pair(f: Fields, value: Any, where: str, lo: int, hi: int) -> tuple[int, int]:
    items = f.array(value, where, 2, 2)
    return (f.int_in(items[0], f"{where}[0]", lo, hi), f.int_in(items[1], f"{where}[1]", lo, hi))


def _arch(f: Fields, value: Any) -> dict:
    """The recorded CPU description: its ISA, that ISA's width and exactly its compiler flags
    (what the libraries really target); the other fields are numbers the runtime only reports."""
    arch = f.obj(value, "arch", {"name", "isa", "vector_bits", "cflags"}, set(value) if isinstance(value, dict) else ())
    f.string(arch["name"], "arch.name", LABEL_RE, "an arch label")
    isa = f.choice(arch["isa"], "arch.isa", tuple(cpu.ISA_FLAGS))
    f.choice(arch["vector_bits"], "arch.vector_bits", (cpu.ISA_VECTOR_BITS[isa],))
    if arch["cflags"] != list(cpu.ISA_CFLAGS[isa]):
        f.fail("arch.cflags", f"{isa} builds are compiled with exactly {list(cpu.ISA_CFLAGS[isa])}, "
               f"got {arch['cflags']!r:.80}")
    for key, item in arch.items():
        if key == "amx":
            f.boolean(item, "arch.amx")
        elif key not in ("name", "isa", "vector_bits", "cflags"):
            f.number_in(item, f"arch.{key}", 0, 1 << 40)
    return dict(arch)


def _layer(f: Fields, raw: Any, index: int, in_shape: tuple[int, int, int], v: int, precision: str,
           amx: bool) -> LayerEntry:
    where = f"layers[{index}]"
    keys = {"name", "type", "in_shape", "out_shape", "kernel", "stride", "pad", "rate", "weight_shape", "kernels"}
    f.obj(raw, where, keys, {"activation", "relu", "relu6", "bias", "groups", "eps", "momentum", "inputs", "init",
                             "output", "gradient"})
    name = f.string(raw["name"], f"{where}.name", NAME_RE, "a layer name")
    ltype = f.choice(raw["type"], f"{where}.type", tuple(LAYER_PASSES))
    got_in = _shape(f, raw["in_shape"], f"{where}.in_shape", limits.MAX_FEATURES)
    if got_in != in_shape:
        f.fail(f"{where}.in_shape", f"is {list(got_in)} but its inputs (or the net input) give {list(in_shape)}")
    out = _shape(f, raw["out_shape"], f"{where}.out_shape", limits.MAX_FEATURES)
    kmax = limits.MAX_SPATIAL
    kernel = _pair(f, raw["kernel"], f"{where}.kernel", 1, kmax)
    stride = _pair(f, raw["stride"], f"{where}.stride", 1, kmax)
    pad = _pair(f, raw["pad"], f"{where}.pad", 0, limits.MAX_PAD)
    act = _activation(f, raw, ltype, where)
    rate = f.number_in(raw["rate"], f"{where}.rate", 0.0, 1.0, open_hi=True)
    c, h, w = in_shape
    groups = f.int_in(raw.get("groups", 1), f"{where}.groups", 1, limits.MAX_FEATURES)
    if groups != 1 and not (ltype == "conv" and groups == c == out[0]):
        f.fail(f"{where}.groups", f"is {groups}: 1, or a depthwise convolution's channels ({c} in, {out[0]} out)")
    if ltype in WINDOWED:
        oc = out[0] if ltype == "conv" else c
        want = (oc, limits.out_size(h, kernel[0], stride[0], pad[0]), limits.out_size(w, kernel[1], stride[1], pad[1]))
    elif ltype == "fc":
        want = (out[0], 1, 1)
        if kernel != (h, w) or stride != (1, 1) or pad != (0, 0):
            f.fail(f"{where}.kernel", f"an fc layer's window is its whole {h}x{w} input, got kernel {list(kernel)}, "
                   f"stride {list(stride)}, pad {list(pad)}")
    else:
        want = in_shape
    if out != want or min(want) < 1:
        f.fail(f"{where}.out_shape", f"is {list(out)} but the layer's input and window give {list(want)}")
    weight_shape = None
    if ltype in WEIGHTED:
        expect = (out[0], c // groups, *kernel) if ltype == "conv" else (out[0], c * h * w)
        weight_shape = tuple(f.array(raw["weight_shape"], f"{where}.weight_shape", len(expect), len(expect)))
        if weight_shape != expect:
            f.fail(f"{where}.weight_shape", f"is {list(weight_shape)} but the layer's shapes give {list(expect)}")
    elif raw["weight_shape"] is not None:
        f.fail(f"{where}.weight_shape", f"must be null for a {ltype} layer")
    for size, what in ((limits.padded(out[0], v) * out[1] * out[2], "out_shape"),
                       (limits.padded(out[0], v) * limits.padded(c // groups, v) * kernel[0] * kernel[1], "weight_shape")):
        if size > limits.MAX_TENSOR_FLOATS:
            f.fail(f"{where}.{what}", f"a tensor of {size} floats per image, more than the {limits.MAX_TENSOR_FLOATS} allowed")
    kinds = kernel_kinds(families.Shape(index, ltype, in_shape, kernel, stride, pad, groups),
                         families.Target(precision, amx, v))
    f.obj(raw["kernels"], f"{where}.kernels", set(kinds))
    # the layout library's bf16 roles depend on the net's bf16 edges: parse_manifest checks it after them
    kernels = _kernels(f, raw["kernels"], f"{where}.kernels", name, {p: r for p, r in kinds.items() if p != "layout"})
    bias = f.boolean(raw.get("bias", True), f"{where}.bias")
    if not bias and ltype not in WEIGHTED:
        f.fail(f"{where}.bias", f"a {ltype} layer has no bias")
    if ltype != "batchnorm" and ("eps" in raw or "momentum" in raw):
        f.fail(f"{where}.eps" if "eps" in raw else f"{where}.momentum", f"a {ltype} layer has no running statistics")
    eps = f.number_in(raw.get("eps", 1e-5), f"{where}.eps", 1e-12, 1.0)
    momentum = f.number_in(raw.get("momentum", 0.1), f"{where}.momentum", 0.0, 1.0)
    init = f.choice(raw.get("init", "pytorch"), f"{where}.init", INITS if ltype in WEIGHTED
                    else ("pytorch",))
    return LayerEntry(index, name, ltype, in_shape, out, kernel, stride, pad, act, rate, weight_shape, kernels, bias,
                      groups, eps, momentum, init=init)


def _activation(f: Fields, raw: dict, ltype: str, where: str) -> str | None:
    """A layer's `activation`: an activation layer's own name, a name of the table that fuses into
    its type, or absent; an earlier /10 manifest's `relu` and `relu6` booleans say the same."""
    own = ltype if ltype in ACTIVATIONS else None
    if "activation" in raw:
        for old in ("relu", "relu6"):
            if old in raw:
                f.fail(f"{where}.{old}", "comes with `activation` in no manifest: one or the other")
        act = raw["activation"]
        if act is not None:
            act = f.choice(act, f"{where}.activation", tuple(ACTIVATIONS))
    else:
        relu = f.boolean(raw.get("relu", own is not None), f"{where}.relu")
        relu6 = f.boolean(raw.get("relu6", ltype == "relu6"), f"{where}.relu6")
        if relu6 and not relu:
            f.fail(f"{where}.relu6", "is true without relu")
        act = ("relu6" if relu6 else "relu") if relu else None
    if own is not None and act != own:
        f.fail(f"{where}.activation", f"is {show(act)} for a {ltype} layer, which is its own activation {own!r}")
    if own is None and act is not None and ltype not in ACTIVATIONS[act].fuses_into:
        f.fail(f"{where}.activation", f"{act} is not fused into a {ltype} layer")
    return act


def _kernels(f: Fields, value: dict, where: str, layer: str, kinds: dict[str, dict[str, str]]) -> dict[str, KernelEntry]:
    out = {}
    for p, roles in kinds.items():
        at = f"{where}.{p}"
        raw = f.obj(value[p], at, {"library", "sha256", "source", "symbols"}, {"plan"})
        out[p] = _entry(f, raw, at, {f"pcldnn_{layer}_{r}": kind for r, kind in roles.items()})
    return out


def _entry(f: Fields, raw: dict, at: str, want: dict[str, str]) -> KernelEntry:
    """One compiled file's entry, which must define exactly the symbols (and kinds) of `want`."""
    symbols = f.obj(raw["symbols"], f"{at}.symbols", set(want))
    for sym, kind in want.items():
        if symbols[sym] != kind:
            f.fail(f"{at}.symbols.{sym}", f"must be {kind!r}, got {symbols[sym]!r:.60}")
    plan = raw.get("plan")
    if plan is not None and not isinstance(plan, dict):
        f.fail(f"{at}.plan", "must be an object")
    return KernelEntry(f.string(raw["library"], f"{at}.library", _REL_PATH, "a relative path"),
                       f.string(raw["sha256"], f"{at}.sha256", SHA256_RE, "a sha256 digest"),
                       f.string(raw["source"], f"{at}.source", _REL_PATH, "a relative path"),
                       dict(want), plan)


def file_sha256(path: Path) -> str:
    """The digest a manifest records for each library."""
    with open(path, "rb") as f:
        return stream_sha256(f)


def stream_sha256(f: Any) -> str:
    """sha256 of what remains of an open binary file."""
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def inside(build_dir: Path, relative: str) -> Path:
    """Resolve a manifest path, refusing any that escapes the build directory."""
    root = Path(build_dir).resolve()
    target = (root / relative).resolve()
    if root not in target.parents:
        raise BuildDirError(f"{build_dir}/{MANIFEST}: path {relative!r} escapes the build directory")
    return target
