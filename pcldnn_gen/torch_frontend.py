"""PyTorch models -> net description + weights (`pcldnn_gen.from_torch`). torch is an optional
extra: it is imported inside `from_torch` only. The module is traced with torch.fx, so
nn.Sequential and any module whose forward is a chain of supported calls work, whatever their
nesting; names come from the modules' qualified names (`features.0` -> `features_0`, the original
kept as each layer's `source`)."""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcldnn_runtime import limits
from pcldnn_runtime.activations import ACTIVATIONS

from .errors import ModelImportError, PcldnnError
from .frontend import INPUT, Op, fail_unsupported, input_shape_of, model_name, net_from_ops, printable

# How to get PyTorch without its CUDA build (several GB, PyPI's default on Linux): the README's
# set-up says the same.
TORCH_CPU_INSTALL = "pip install 'torch>=2.1,<3' --index-url https://download.pytorch.org/whl/cpu"


def from_torch(module: Any, input_shape: Any, name: str | None = None, loss: bool = True) -> tuple[dict, dict[str, np.ndarray]]:
    """(net dict, state) for a PyTorch module taking (N, C, H, W) images, input_shape = (C, H, W).
    The state maps `<layer>.weight` / `<layer>.bias` to float32 arrays in canonical layouts
    (bias-free convolutions get zeros). With `loss`, a softmax_cross_entropy layer follows the
    last Linear (nn.CrossEntropyLoss's computation; `classes` = its out_features). Anything the
    net description cannot express is one ModelImportError listing every such node."""
    try:
        import torch
        import torch.fx
    except ImportError:
        raise ModelImportError(f"from_torch needs PyTorch; its CPU build: {TORCH_CPU_INSTALL}") from None
    shape = input_shape_of(input_shape)
    if not isinstance(module, torch.nn.Module):
        raise ModelImportError(f"from_torch: expected a torch.nn.Module, got {type(module).__name__}")
    origin = f"from_torch({type(module).__name__})"
    _check_tensors(module, origin, torch)
    try:
        traced = torch.fx.symbolic_trace(module)
    except Exception as e:  # torch.fx raises TraceError, TypeError, ... on dynamic control flow
        raise ModelImportError(f"from_torch: torch.fx cannot trace {type(module).__name__} "
                               f"({type(e).__name__}: {str(e)[:200]}); supported: {SUPPORTED}") from None
    try:
        ops = _ops(traced, torch, origin)
        return net_from_ops(ops, shape, model_name(name, type(module).__name__), origin, loss)
    except PcldnnError:
        raise
    except Exception as e:  # torch or a module's own code failing where the checks did not foresee
        raise ModelImportError(f"{origin}: cannot translate ({type(e).__name__}: {str(e)[:200]})") from None


def _check_tensors(module: Any, origin: str, torch: Any) -> None:
    """Every parameter and buffer holds numbers we can copy: on a real device (a meta tensor has
    no values), dense, real-valued, and all of them together within the memory bound, checked
    from their sizes before any is copied."""
    total = 0
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in items:
            what = f"{origin}: {kind} {name}"
            if t.device.type == "meta":
                raise ModelImportError(f"{what} is on the meta device (it has no values): materialise the model "
                                       "(module.to_empty(device='cpu') and load its weights) first")
            if t.layout != torch.strided or t.is_quantized:
                raise ModelImportError(f"{what}: {t.layout} {'quantized ' * t.is_quantized}tensor (only dense ones)")
            if t.is_complex() or not (t.is_floating_point() or t.dtype in (torch.int8, torch.int16, torch.int32,
                                                                            torch.int64, torch.uint8, torch.bool)):
                raise ModelImportError(f"{what}: dtype {t.dtype} (only real numbers)")
            total += t.numel() * 4
    bound = limits.max_memory()
    if total > bound:
        raise ModelImportError(f"{origin}: its tensors take {limits.format_bytes(total)} as float32, more than the "
                               f"{limits.format_bytes(bound)} memory bound ({limits.MEMORY_ENV})")


def _pair(value: Any) -> tuple:
    """A module's size argument as PyTorch pairs it, unchecked: net_from_ops checks ranges."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def _array(t: Any) -> np.ndarray:
    return t.detach().cpu().float().numpy().copy()


def _ops(traced: Any, torch: Any, origin: str) -> list[Op]:
    """The traced graph as Ops in its (topological) order, each naming the tensors it reads;
    every unsupported node collected, then one error."""
    nn = torch.nn
    rows = _function_rows(torch)
    modules = dict(traced.named_modules())
    problems: list[str] = []
    ops: list[Op] = []
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ModelImportError(f"{origin}: forward must take one tensor, it takes {len(placeholders)} arguments")
    names = {placeholders[0]: INPUT}  # fx node -> the tensor name Ops use
    for node in traced.graph.nodes:
        if node.op == "placeholder" or _is_shape_query(node, torch):
            continue
        if node.op == "output":
            if not ops or node.args[0] is not _node_of(traced, ops[-1].tensor):
                problems.append("output: the model's result is not the last node of its graph")
            break
        label = printable(node.target if node.op == 'call_module' else node.name)
        try:
            if node.op == "call_module":
                op = _module_op(str(node.target), modules[node.target], nn)
                reads = node.args[:1]
            elif node.op in ("call_function", "call_method"):
                op, reads = _function_op(node, torch, rows)
            else:
                raise _Unsupported(node.op)
            if not reads or not all(r in names for r in reads):
                raise _Unsupported(type(modules[node.target]).__name__ if node.op == "call_module" else str(node.target),
                                   "reads no tensor of the model's graph (a constant, or a node that was refused)")
        except _Unsupported as e:
            problems.append(f"{label} ({e.args[0]})" + (f": {e.args[1]}" if len(e.args) > 1 else ""))
            names[node] = node.name  # (the nodes after it still translate: one error lists them all)
            continue
        names[node] = node.name
        ops.append(dataclasses.replace(op, tensor=node.name, inputs=tuple(names[r] for r in reads)))
    fail_unsupported(origin, problems, SUPPORTED)
    return ops


def _node_of(traced: Any, name: str) -> Any:
    return next((n for n in traced.graph.nodes if n.name == name), None)


class _Unsupported(Exception):
    """(type name[, reason]) of a node the net description cannot express."""


def _is_shape_query(node: Any, torch: Any) -> bool:
    """x.size(...), x.shape, or an index into one: only the minibatch size of a view(N, -1)."""
    if node.op == "call_method" and node.target == "size":
        return True
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",):
        return True
    return (node.op == "call_function" and node.target is operator.getitem and hasattr(node.args[0], "op")
            and (node.args[0].op, node.args[0].target) in (("call_method", "size"), ("call_function", getattr)))




# The table: our ops and PyTorch's spellings of them, read and written in both directions --------


@dataclass(frozen=True)
class TorchRow:
    """One op of ours and PyTorch's spellings of it: its torch.nn modules, its functions (looked up
    in torch.nn.functional, torch and operator) and tensor methods, and its arguments in the
    functions' order after the input, with their defaults. A module's attributes of those names
    and a call's arguments are read alike (`arguments`), so a module and its functional form are
    one row and one reader; `build` makes the module back from a layer (torch_module)."""
    kind: str
    read: Callable[[str, str, dict[str, Any]], Op]  # (source, PyTorch's type name, arguments) -> Op
    modules: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    params: tuple[tuple[str, Any], ...] = ()
    tensors: int = 1  # the tensors a call reads first: 1, 2 (add, mul), or 0: one list of them (cat)
    build: Callable[[Any, Any], Any] | None = None  # (layer, torch.nn) -> a module computing it; None: a graph op
    supported: str = ""  # what SUPPORTED says of the row's conditions


def _conv(source: str, kind: str, a: dict[str, Any]) -> Op:
    m = a["module"]
    if a["groups"] != 1 and not a["groups"] == m.in_channels == m.out_channels:
        raise _Unsupported(kind, f"groups={a['groups']} (1, or depthwise: groups = in_channels = out_channels)")
    if _pair(a["dilation"]) != (1, 1):
        raise _Unsupported(kind, f"dilation={a['dilation']} (only 1)")
    if a["padding_mode"] != "zeros":
        raise _Unsupported(kind, f"padding_mode={a['padding_mode']!r} (only 'zeros')")
    k = _pair(m.kernel_size)
    if isinstance(a["padding"], str):  # 'valid' or 'same' (stride 1)
        if a["padding"] not in ("valid", "same"):
            raise _Unsupported(kind, f"padding={printable(a['padding'])} (an int, a pair, 'valid' or 'same')")
        if a["padding"] == "same" and (k[0] % 2 == 0 or k[1] % 2 == 0):
            raise _Unsupported(kind, "padding='same' with an even kernel (asymmetric padding)")
        pad = (0, 0) if a["padding"] == "valid" else (k[0] // 2, k[1] // 2)
    else:
        pad = _pair(a["padding"])
    return Op("conv", source, kind, {"kernel": k, "stride": _pair(a["stride"]), "pad": pad, "groups": a["groups"]},
              _array(a["weight"]), None if a["bias"] is None else _array(a["bias"]))


def _linear(source: str, kind: str, a: dict[str, Any]) -> Op:
    return Op("fc", source, kind, {}, _array(a["weight"]), None if a["bias"] is None else _array(a["bias"]))


def _batchnorm(source: str, kind: str, a: dict[str, Any]) -> Op:
    m = a["module"]
    if not m.affine or not m.track_running_stats:
        raise _Unsupported(kind, "affine=False or track_running_stats=False (only BatchNorm2d's defaults)")
    if m.momentum is None:
        raise _Unsupported(kind, "momentum=None (a cumulative average; only a number)")
    return Op("batchnorm", source, kind, {"eps": m.eps, "momentum": m.momentum}, _array(m.weight), _array(m.bias),
              (_array(m.running_mean), _array(m.running_var), int(m.num_batches_tracked)))


def _pool(source: str, kind: str, a: dict[str, Any]) -> Op:
    """max and average pooling, as modules (MaxPool2d, AvgPool2d) and functions alike."""
    k = _pair(a["kernel_size"])
    stride = a["stride"]
    s = k if stride is None or stride == [] or stride == () else _pair(stride)
    if a["ceil_mode"]:
        raise _Unsupported(kind, "ceil_mode=True (only floor)")
    if _pair(a.get("dilation", 1)) != (1, 1):
        raise _Unsupported(kind, f"dilation={a['dilation']} (only 1)")
    if a.get("return_indices"):
        raise _Unsupported(kind, "return_indices=True")
    if "count_include_pad" in a:  # average pooling
        if a["divisor_override"]:
            raise _Unsupported(kind, "divisor_override")
        if _pair(a["padding"]) != (0, 0) and not a["count_include_pad"]:
            raise _Unsupported(kind, "count_include_pad=False with padding (only padding counted as zeros)")
        return Op("avgpool", source, kind, {"kernel": k, "stride": s, "pad": _pair(a["padding"])})
    return Op("maxpool", source, kind, {"kernel": k, "stride": s, "pad": _pair(a["padding"])})


def _adaptive(source: str, kind: str, a: dict[str, Any]) -> Op:
    size = a["output_size"]
    return Op("avgpool", source, kind, {"adaptive": tuple(size) if isinstance(size, (tuple, list)) else (size, size)})


def _activation(act: str) -> Callable[[str, str, dict[str, Any]], Op]:
    def read(source: str, kind: str, a: dict[str, Any]) -> Op:
        if a["approximate"] != "none":  # (GELU's: no other activation has one)
            raise _Unsupported(kind, f"approximate={printable(repr(a['approximate']))} (only 'none', the erf form)")
        return Op(act, source, kind)
    return read


def _activation_module(cls: str) -> Callable[[Any, Any], Any]:
    return lambda layer, nn: getattr(nn, cls)()


def _dropout(source: str, kind: str, a: dict[str, Any]) -> Op:
    return Op("dropout", source, kind, {"rate": a["p"]})


def _flatten(source: str, kind: str, a: dict[str, Any]) -> Op:
    if (a["start_dim"], a["end_dim"]) != (1, -1):
        raise _Unsupported(kind, f"start_dim={a['start_dim']}, end_dim={a['end_dim']} (only 1, -1)")
    return Op("flatten", source, kind)


def _view(source: str, kind: str, a: dict[str, Any]) -> Op:
    dims = a["args"] if len(a["args"]) != 1 or not isinstance(a["args"][0], (tuple, list)) else tuple(a["args"][0])
    if len(dims) == 2 and dims[1] == -1:
        return Op("flatten", source, kind)
    raise _Unsupported(kind, f"{kind}{tuple(dims)} (only (N, -1), a flatten)")


def _softmax(source: str, kind: str, a: dict[str, Any]) -> Op:
    if a["dim"] not in (1, -1):
        raise _Unsupported(kind, f"dim={a['dim']} (only over the classes, dim 1)")
    return Op("softmax", source, kind)


def _binary(op: str, what: str) -> Callable[[str, str, dict[str, Any]], Op]:
    def read(source: str, kind: str, a: dict[str, Any]) -> Op:
        if a["extra"]:
            raise _Unsupported(kind, f"only the {what} of two tensors (no constant{', no alpha' if op == 'add' else ''})")
        return Op(op, source, kind)
    return read


def _stochastic_depth(source: str, kind: str, a: dict[str, Any]) -> Op:
    """torchvision.ops.stochastic_depth (StochasticDepth's forward, kept a call by torch.fx.wrap)."""
    if a["mode"] != "row":
        raise _Unsupported(kind, f"mode={printable(repr(a['mode']))} (only 'row': each image's branch dropped apart)")
    return Op("identity", source, kind) if a["p"] == 0 else Op("drop_path", source, kind, {"rate": a["p"]})


def _cat(source: str, kind: str, a: dict[str, Any]) -> Op:
    if a["dim"] not in (1, -3) or len(a["tensors"]) < 2:
        raise _Unsupported(kind, f"dim={a['dim']} over {len(a['tensors'])} tensors (only two or more along the "
                           "channels, dim 1)")
    return Op("concat", source, kind)


_POOL_PARAMS = (("kernel_size", None), ("stride", None), ("padding", 0))
ROWS: tuple[TorchRow, ...] = (
    TorchRow("conv", _conv, modules=("Conv2d",), params=(
        ("weight", None), ("bias", None), ("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1),
        ("padding_mode", "zeros")),
        build=lambda l, nn: nn.Conv2d(l.in_shape[0], l.out_shape[0], l.kernel, l.stride, l.pad, groups=l.groups,
                                      bias=l.bias),
        supported="groups=1 or depthwise, dilation=1, zero padding"),
    TorchRow("fc", _linear, modules=("Linear",), params=(("weight", None), ("bias", None)),
             build=lambda l, nn: nn.Linear(l.in_shape[0] * l.in_shape[1] * l.in_shape[2], l.out_shape[0], bias=l.bias)),
    TorchRow("batchnorm", _batchnorm, modules=("BatchNorm2d",),
             build=lambda l, nn: nn.BatchNorm2d(l.in_shape[0], eps=l.eps, momentum=l.momentum)),
    TorchRow("maxpool", _pool, modules=("MaxPool2d",), functions=("max_pool2d",),
             params=(*_POOL_PARAMS, ("dilation", 1), ("ceil_mode", False), ("return_indices", False)),
             build=lambda l, nn: nn.MaxPool2d(l.kernel, l.stride, l.pad)),
    TorchRow("avgpool", _pool, modules=("AvgPool2d",), functions=("avg_pool2d",),
             params=(*_POOL_PARAMS, ("ceil_mode", False), ("count_include_pad", True), ("divisor_override", None)),
             build=lambda l, nn: nn.AvgPool2d(l.kernel, l.stride, l.pad)),
    TorchRow("avgpool", _adaptive, modules=("AdaptiveAvgPool2d",), functions=("adaptive_avg_pool2d",),
             params=(("output_size", None),), supported="to a size that divides the input"),
    *(TorchRow(a.name, _activation(a.name), modules=a.torch_modules, functions=a.torch_functions,
               methods=a.torch_functions, params=(("inplace", False), ("approximate", "none")),
               build=_activation_module(a.torch_modules[0]),
               supported="approximate='none'" if a.name == "gelu" else "") for a in ACTIVATIONS.values()),
    TorchRow("dropout", _dropout, modules=("Dropout",), functions=("dropout",), methods=("dropout",),
             params=(("p", 0.5),), build=lambda l, nn: nn.Dropout(l.rate)),
    TorchRow("drop_path", _stochastic_depth, functions=("torchvision.ops.stochastic_depth",),
             params=(("p", None), ("mode", None), ("training", True)), supported="mode='row'"),
    TorchRow("flatten", _flatten, modules=("Flatten",), params=(("start_dim", 1), ("end_dim", -1))),
    TorchRow("flatten", _flatten, functions=("flatten",), methods=("flatten",),
             params=(("start_dim", 0), ("end_dim", -1)), supported="from dim 1"),
    TorchRow("flatten", _view, methods=("view", "reshape"), supported="(N, -1)"),
    TorchRow("identity", lambda source, kind, a: Op("identity", source, kind), modules=("Identity",)),
    TorchRow("softmax", _softmax, modules=("Softmax", "LogSoftmax"), functions=("softmax", "log_softmax"),
             methods=("softmax", "log_softmax"), params=(("dim", None),), supported="the last node, over dim 1"),
    TorchRow("add", _binary("add", "sum"), functions=("add", "iadd"), methods=("add", "add_"), tensors=2,
             supported="of two tensors: residual sums"),
    TorchRow("mul", _binary("mul", "product"), functions=("mul", "imul"), methods=("mul", "mul_"), tensors=2,
             supported="of two tensors, or a per-channel scale: squeeze-and-excitation"),
    TorchRow("concat", _cat, functions=("cat",), params=(("dim", 0),), tensors=0, supported="dim=1"),
)


# How SUPPORTED writes a function that is not torch.nn.functional's
_SPELLED = {"add": "+", "iadd": "+=", "mul": "*", "imul": "*=", "cat": "torch.cat", "flatten": "torch.flatten"}


def _names(row: TorchRow) -> str:
    """How SUPPORTED names a row: its modules, its functions (F.x, operators as written), its methods."""
    functions = [_SPELLED.get(f, f if "." in f else f"F.{f}") for f in row.functions]
    methods = [f".{m}()" for m in row.methods if m not in row.functions]
    return " / ".join([*row.modules, *functions, *methods]) + (f" ({row.supported})" if row.supported else "")


SUPPORTED = "; ".join(_names(row) for row in ROWS)


def _function_rows(torch: Any) -> dict[Any, TorchRow]:
    """Each row's functions, as the objects torch.fx records as call targets (a dotted name is
    another library's function, matched by its module and name: torchvision need not be here)."""
    found: dict[Any, TorchRow] = {}
    for row in ROWS:
        for name in row.functions:
            if "." in name:
                found.setdefault(name, row)
                continue
            for space in (torch.nn.functional, torch, operator):
                fn = getattr(space, name, None)
                if fn is not None:
                    found.setdefault(fn, row)
    return found


def _row_of_call(fn: Any, rows: dict[Any, TorchRow]) -> TorchRow | None:
    """The row of a call target: by identity, or (another library's function) by package and name."""
    if fn in rows:
        return rows[fn]
    module, name = getattr(fn, "__module__", None) or "", getattr(fn, "__name__", "")
    for key, row in rows.items():
        if isinstance(key, str):
            package, function = key.rsplit(".", 1)
            if name == function and (module == package or module.startswith(package + ".")):
                return row
    return None


def _module_row(m: Any, nn: Any) -> TorchRow | None:
    return next((row for row in ROWS for cls in row.modules if isinstance(m, getattr(nn, cls))), None)


def _module_op(target: str, m: Any, nn: Any) -> Op:
    row = _module_row(m, nn)
    if row is None:
        raise _Unsupported(type(m).__name__)
    arguments = {name: getattr(m, name, default) for name, default in row.params} | {"module": m}
    return row.read(target, type(m).__name__, arguments)


def _function_op(node: Any, torch: Any, rows: dict[Any, TorchRow]) -> tuple[Op, tuple[Any, ...]]:
    """torch.* / F.* calls and tensor methods inside forward, and the nodes whose tensors they read."""
    fn, args, kwargs = node.target, node.args, node.kwargs
    kind = getattr(fn, "__name__", str(fn))
    row = next((r for r in ROWS if fn in r.methods), None) if node.op == "call_method" else _row_of_call(fn, rows)
    if row is None:
        raise _Unsupported(kind)
    if row.tensors == 0:  # one list of tensors (torch.cat)
        listed = args[0] if args else kwargs.get("tensors")
        tensors = tuple(listed) if isinstance(listed, (list, tuple)) else ()
        rest, given = args[1:], {k: v for k, v in kwargs.items() if k != "tensors"}
    else:
        tensors, rest, given = tuple(args[:row.tensors]), args[row.tensors:], dict(kwargs)
    arguments = dict(row.params) | dict(zip((p for p, _ in row.params), rest)) | given | {"args": rest, "tensors": tensors}
    if row.tensors == 2:  # a constant operand, or an argument (alpha) beside the two tensors
        arguments["extra"] = bool(rest or kwargs) or not all(isinstance(t, type(node)) for t in tensors)
    return row.read(node.name, kind, arguments), tensors


def torch_module(layer: Any) -> Any:
    """A torch.nn module computing `layer` (a LayerSpec) from the same row its import reads (None:
    a graph operation: add, mul, concat; the loss). The benchmarks' PyTorch nets are built so."""
    import torch
    build = next((r.build for r in ROWS if r.kind == layer.type and r.build is not None), None)
    return build(layer, torch.nn) if build is not None else None
