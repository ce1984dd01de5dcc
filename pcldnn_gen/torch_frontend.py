"""PyTorch models -> net description + weights (`pcldnn_gen.from_torch`). torch is an optional
extra: it is imported inside `from_torch` only. The module is traced with torch.fx, so
nn.Sequential and any module whose forward is a chain of supported calls work, whatever their
nesting; names come from the modules' qualified names (`features.0` -> `features_0`, the original
kept as each layer's `source`)."""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np

from pcldnn_runtime import limits
from pcldnn_runtime.activations import ACTIVATIONS

from .errors import ModelImportError, PcldnnError
from .frontend import INPUT, Op, fail_unsupported, input_shape_of, model_name, net_from_ops, printable

SUPPORTED = ("Conv2d (groups=1 or depthwise, dilation=1, zero padding), Linear, BatchNorm2d, MaxPool2d, AvgPool2d, "
             "AdaptiveAvgPool2d (to a size that divides the input), "
             + ", ".join(m for a in ACTIVATIONS.values() for m in a.torch_modules) + " (GELU: approximate='none'), "
             "Dropout, Flatten, Identity, a final Softmax / LogSoftmax, and torch.flatten / "
             + " / ".join(f"F.{a.torch_functions[0]}" for a in ACTIVATIONS.values())
             + " / F.dropout / F.max_pool2d / F.avg_pool2d / F.adaptive_avg_pool2d / "
             "+ (residual sums) / * (a product, or a per-channel scale: squeeze-and-excitation) / torch.cat(dim=1) / "
             "view(N, -1) in forward")


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
    nn, F = torch.nn, torch.nn.functional
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
                op, reads = _function_op(node, torch, F)
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


def _module_op(target: str, m: Any, nn: Any) -> Op:
    kind = type(m).__name__
    if isinstance(m, nn.Conv2d):
        if m.groups != 1 and not m.groups == m.in_channels == m.out_channels:
            raise _Unsupported(kind, f"groups={m.groups} (1, or depthwise: groups = in_channels = out_channels)")
        if _pair(m.dilation) != (1, 1):
            raise _Unsupported(kind, f"dilation={m.dilation} (only 1)")
        if m.padding_mode != "zeros":
            raise _Unsupported(kind, f"padding_mode={m.padding_mode!r} (only 'zeros')")
        if isinstance(m.padding, str):  # 'valid' or 'same' (stride 1)
            if m.padding not in ("valid", "same"):
                raise _Unsupported(kind, f"padding={printable(m.padding)} (an int, a pair, 'valid' or 'same')")
            k = _pair(m.kernel_size)
            if m.padding == "same" and (k[0] % 2 == 0 or k[1] % 2 == 0):
                raise _Unsupported(kind, "padding='same' with an even kernel (asymmetric padding)")
            pad = (0, 0) if m.padding == "valid" else (k[0] // 2, k[1] // 2)
        else:
            pad = _pair(m.padding)
        return Op("conv", target, kind, {"kernel": _pair(m.kernel_size), "stride": _pair(m.stride), "pad": pad,
                                         "groups": m.groups}, _array(m.weight), None if m.bias is None else _array(m.bias))
    if isinstance(m, nn.Linear):
        return Op("fc", target, kind, {}, _array(m.weight), None if m.bias is None else _array(m.bias))
    if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
        return _pool_op(target, kind, m.kernel_size, m.stride, m.padding, m.ceil_mode,
                        getattr(m, "dilation", 1), getattr(m, "return_indices", False),
                        getattr(m, "count_include_pad", True), getattr(m, "divisor_override", None))
    if isinstance(m, nn.AdaptiveAvgPool2d):
        size = m.output_size if isinstance(m.output_size, (tuple, list)) else (m.output_size, m.output_size)
        return Op("avgpool", target, kind, {"adaptive": tuple(size)})
    if isinstance(m, nn.BatchNorm2d):
        if not m.affine or not m.track_running_stats:
            raise _Unsupported(kind, "affine=False or track_running_stats=False (only BatchNorm2d's defaults)")
        if m.momentum is None:
            raise _Unsupported(kind, "momentum=None (a cumulative average; only a number)")
        return Op("batchnorm", target, kind, {"eps": m.eps, "momentum": m.momentum}, _array(m.weight), _array(m.bias),
                  (_array(m.running_mean), _array(m.running_var), int(m.num_batches_tracked)))
    for act in ACTIVATIONS.values():
        if any(isinstance(m, getattr(nn, cls)) for cls in act.torch_modules):
            _exact(kind, getattr(m, "approximate", "none"))
            return Op(act.name, target, kind)
    if isinstance(m, nn.Dropout):
        return Op("dropout", target, kind, {"rate": m.p})
    if isinstance(m, nn.Flatten):
        if (m.start_dim, m.end_dim) != (1, -1):
            raise _Unsupported(kind, f"start_dim={m.start_dim}, end_dim={m.end_dim} (only 1, -1)")
        return Op("flatten", target, kind)
    if isinstance(m, nn.Identity):
        return Op("identity", target, kind)
    if isinstance(m, (nn.Softmax, nn.LogSoftmax)):
        if m.dim not in (1, -1):
            raise _Unsupported(kind, f"dim={m.dim} (only over the classes, dim 1)")
        return Op("softmax", target, kind)
    raise _Unsupported(kind)


def _exact(kind: str, approximate: Any) -> None:
    """GELU's `approximate` (no other activation has one): 'none' (erf) only, the form the table computes."""
    if approximate != "none":
        raise _Unsupported(kind, f"approximate={printable(repr(approximate))} (only 'none', the erf form)")


def _pool_op(target: str, kind: str, kernel: Any, stride: Any, padding: Any, ceil_mode: Any, dilation: Any, return_indices: Any,
             count_include_pad: Any, divisor_override: Any) -> Op:
    k = _pair(kernel)
    s = k if stride is None or stride == [] or stride == () else _pair(stride)
    p = _pair(padding)
    if ceil_mode:
        raise _Unsupported(kind, "ceil_mode=True (only floor)")
    if _pair(dilation) != (1, 1):
        raise _Unsupported(kind, f"dilation={dilation} (only 1)")
    if return_indices:
        raise _Unsupported(kind, "return_indices=True")
    if kind.startswith("Avg") or kind == "avg_pool2d":
        if divisor_override:
            raise _Unsupported(kind, "divisor_override")
        if p != (0, 0) and not count_include_pad:
            raise _Unsupported(kind, "count_include_pad=False with padding (only padding counted as zeros)")
        return Op("avgpool", target, kind, {"kernel": k, "stride": s, "pad": p})
    return Op("maxpool", target, kind, {"kernel": k, "stride": s, "pad": p})


def _function_op(node: Any, torch: Any, F: Any) -> tuple[Op, tuple[Any, ...]]:
    """torch.* / F.* calls and tensor methods inside forward, and the nodes whose tensors they read."""
    fn, args, kwargs = node.target, node.args, node.kwargs
    kind = getattr(fn, "__name__", str(fn))
    if fn in (operator.add, operator.iadd, torch.add) or (node.op == "call_method" and fn in ("add", "add_")):
        if len(args) != 2 or kwargs or not all(isinstance(a, type(node)) for a in args):
            raise _Unsupported(kind, "only the sum of two tensors (no constant, no alpha)")
        return Op("add", node.name, kind), tuple(args)
    if fn in (operator.mul, operator.imul, torch.mul) or (node.op == "call_method" and fn in ("mul", "mul_")):
        if len(args) != 2 or kwargs or not all(isinstance(a, type(node)) for a in args):
            raise _Unsupported(kind, "only the product of two tensors (no constant)")
        return Op("mul", node.name, kind), tuple(args)
    if fn is torch.cat:
        parts = args[0] if args else kwargs.get("tensors")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if dim not in (1, -3) or not isinstance(parts, (list, tuple)) or len(parts) < 2:
            raise _Unsupported(kind, f"dim={dim} over {len(parts) if isinstance(parts, (list, tuple)) else parts} "
                               "tensors (only two or more along the channels, dim 1)")
        return Op("concat", node.name, kind), tuple(parts)
    return _one_input_op(node, torch, F, kind), tuple(args[:1])


def _one_input_op(node: Any, torch: Any, F: Any, kind: str) -> Op:
    """The calls of one tensor."""
    fn, args, kwargs = node.target, node.args, node.kwargs
    name = node.name
    for act in ACTIVATIONS.values():
        functions = [f for n in act.torch_functions for f in (getattr(F, n, None), getattr(torch, n, None)) if f]
        if fn in functions or (node.op == "call_method" and fn in act.torch_functions):
            _exact(kind, kwargs.get("approximate", "none"))  # (keyword-only in F.gelu)
            return Op(act.name, name, kind)
    if fn in (torch.flatten,) or (node.op == "call_method" and fn == "flatten"):
        start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
        end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
        if (start, end) != (1, -1):
            raise _Unsupported(kind, f"start_dim={start}, end_dim={end} (only 1, -1)")
        return Op("flatten", name, kind)
    if node.op == "call_method" and fn in ("view", "reshape"):
        dims = args[1:] if len(args) != 2 or not isinstance(args[1], (tuple, list)) else tuple(args[1])
        if len(dims) == 2 and dims[1] == -1:
            return Op("flatten", name, kind)
        raise _Unsupported(kind, f"{fn}{tuple(dims)} (only (N, -1), a flatten)")
    if fn is F.dropout or (node.op == "call_method" and fn == "dropout"):
        rate = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        return Op("dropout", name, kind, {"rate": rate})
    if fn is F.adaptive_avg_pool2d:
        size = args[1] if len(args) > 1 else kwargs.get("output_size")
        return Op("avgpool", name, kind, {"adaptive": tuple(size) if isinstance(size, (tuple, list)) else (size, size)})
    if fn in (F.max_pool2d, F.avg_pool2d):
        names = ("kernel_size", "stride", "padding")
        given = dict(zip(names, args[1:])) | {k: v for k, v in kwargs.items() if k in names}
        extra: dict[str, Any]
        if fn is F.max_pool2d:
            extra = {"ceil_mode": False, "dilation": 1, "return_indices": False}
            order = ("dilation", "ceil_mode", "return_indices")
        else:
            extra = {"ceil_mode": False, "count_include_pad": True, "divisor_override": None}
            order = ("ceil_mode", "count_include_pad", "divisor_override")
        extra |= dict(zip(order, args[4:])) | {k: v for k, v in kwargs.items() if k in extra}
        return _pool_op(name, kind, given["kernel_size"], given.get("stride"), given.get("padding", 0),
                        extra["ceil_mode"], extra.get("dilation", 1), extra.get("return_indices", False),
                        extra.get("count_include_pad", True), extra.get("divisor_override"))
    if fn in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax) or (
            node.op == "call_method" and fn in ("softmax", "log_softmax")):
        return Op("softmax", name, kind)
    raise _Unsupported(kind)
