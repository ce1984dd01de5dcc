"""The layer types a build holds, each defined once (LAYER_TYPES: its net.json fields, passes,
state-dict entries, what it reads): a leaf module (it imports nothing of the package but the
activations' table, another leaf), so the kernel families, the manifest reader, state I/O and the
generator all read one table without importing each other."""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .activations import ACTIVATIONS

PASSES = ("fwd", "bwd_data", "bwd_weights")
FORWARD_BACKWARD = ("fwd", "bwd_data")
REQUIRED = object()  # a net.json field with no default
WINDOW = {"kernel": REQUIRED, "stride": None, "pad": 0}


@dataclass(frozen=True)
class LayerType:
    """One layer type, defined once: its net.json fields (besides name, type, inputs and source)
    with their defaults (REQUIRED: none), its passes (every layer also has its "layout"
    conversions), its state-dict entries in PyTorch's names with their shapes ("weight": the
    layer's weight shape, "channels": (C,), "scalar": ()), and whether it reads several layers.
    netspec, the manifest reader, state I/O and the kernel families read these."""
    name: str
    passes: tuple[str, ...] = FORWARD_BACKWARD
    fields: Mapping[str, Any] = field(default_factory=dict)
    state: tuple[tuple[str, str], ...] = ()
    joins: bool = False     # reads two or more layers
    weighted: bool = False  # a conv or fc: weights trained by the optimizer's weight path, an `init`, a `bias` flag
    windowed: bool = False  # a window (kernel, stride, pad) over its input


_WEIGHTS = (("weight", "weight"), ("bias", "channels"))  # (a bias-free layer has no "bias" entry)
_INIT = {"activation": None, "bias": True, "init": "pytorch"}
LAYER_TYPES: dict[str, LayerType] = {t.name: t for t in (
    LayerType("conv", PASSES, {"out_channels": REQUIRED, **WINDOW, "stride": 1, **_INIT, "groups": 1},
              _WEIGHTS, weighted=True, windowed=True),
    LayerType("fc", PASSES, {"out_features": REQUIRED, **_INIT}, _WEIGHTS, weighted=True),
    LayerType("maxpool", fields=WINDOW, windowed=True),
    LayerType("avgpool", fields=WINDOW, windowed=True),
    LayerType("add", fields={"activation": None}, joins=True),   # the element-wise sum of two or more inputs
    LayerType("concat", joins=True),                              # two or more inputs along the channels
    LayerType("mul", joins=True),  # the element-wise product of two inputs, or one scaled by a C x 1 x 1 one
    *(LayerType(name) for name in ACTIVATIONS),                   # a standalone activation (activations.py)
    LayerType("dropout", fields={"rate": 0.5}),
    # stochastic depth: a training step drops each image's whole activation (a residual branch's) at `rate`
    LayerType("drop_path", fields={"rate": 0.1}),
    LayerType("batchnorm", PASSES, {"eps": 1e-5, "momentum": 0.1, "activation": None},
              (("weight", "channels"), ("bias", "channels"), ("running_mean", "channels"),
               ("running_var", "channels"), ("num_batches_tracked", "scalar"))),
    LayerType("softmax_cross_entropy"),
)}
LAYER_PASSES: dict[str, tuple[str, ...]] = {t.name: t.passes for t in LAYER_TYPES.values()}
WEIGHTED = tuple(t.name for t in LAYER_TYPES.values() if t.weighted)
WINDOWED = tuple(t.name for t in LAYER_TYPES.values() if t.windowed)
JOINS = tuple(t.name for t in LAYER_TYPES.values() if t.joins)  # the layers that read several
DROPS = tuple(t.name for t in LAYER_TYPES.values() if "rate" in t.fields)  # a rate and a hashed mask: dropout, drop_path
# What a join needs of its inputs (joined_shape), for the messages that refuse them
JOIN_NEEDS = {"add": "two or more inputs of one shape", "concat": "two or more inputs of one height and width",
              "mul": "two inputs of one shape, or a C x H x W and a C x 1 x 1 (a per-channel scale, either first)"}
# How a conv or fc layer's weights start (net.json "init"; layers.WeightedLayer.init_weights):
# PyTorch's default for Conv2d / Linear, He-normal, or Xavier-uniform
INITS = ("pytorch", "he", "xavier")


def joined_shape(layer_type: str, shapes: tuple[tuple[int, int, int], ...]) -> tuple[int, int, int] | None:
    """The output shape of a join of inputs of `shapes` (None: they do not fit it, JOIN_NEEDS):
    add, their common shape; concat, their channels summed; mul, the product's, a C x 1 x 1 input
    scaling every pixel of the other. netspec, the manifest reader and the front ends ask here."""
    if layer_type == "add":
        return shapes[0] if len(shapes) > 1 and len(set(shapes)) == 1 else None
    if layer_type == "concat":
        return (sum(s[0] for s in shapes), *shapes[0][1:]) if len(shapes) > 1 and len({s[1:] for s in shapes}) == 1 \
            else None
    if layer_type == "mul" and len(shapes) == 2:
        image, scale = sorted(shapes, key=lambda s: s[1:] == (1, 1))
        return image if image == scale or (scale[1:] == (1, 1) and scale[0] == image[0]) else None
    return None


class ConvKind(enum.Enum):
    """What a convolution computes, by its groups (a weight dimension, as oneDNN has it): the
    kernel families say which kinds they have kernels for (families.Family.conv_kind)."""
    DENSE = "dense"          # groups 1: every output channel reads every input channel
    GROUPED = "grouped"      # 1 < groups < channels: channel groups convolved apart (no kernels yet)
    DEPTHWISE = "depthwise"  # groups = channels: each channel with its own window


def conv_kind(layer_type: str, groups: int, in_channels: int) -> ConvKind | None:
    """The kind of a convolution of `groups` over `in_channels` input channels (None: the layer
    is not a convolution). LayerSpec, LayerEntry and families.Shape all ask here."""
    if layer_type != "conv":
        return None
    if groups == 1:
        return ConvKind.DENSE
    return ConvKind.DEPTHWISE if groups == in_channels else ConvKind.GROUPED
