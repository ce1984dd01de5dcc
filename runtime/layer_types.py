"""The layer types a build holds and the passes each has: a leaf module (it imports nothing of
the package but the activations' table, another leaf), so the kernel families, the manifest
reader and the generator all read one table without importing each other."""
from __future__ import annotations

import enum

from .activations import ACTIVATIONS

PASSES = ("fwd", "bwd_data", "bwd_weights")
# The passes each layer type has; every layer also has its "layout" conversions.
LAYER_PASSES: dict[str, tuple[str, ...]] = {
    "conv": PASSES, "fc": PASSES,
    "maxpool": ("fwd", "bwd_data"), "avgpool": ("fwd", "bwd_data"),
    **dict.fromkeys(ACTIVATIONS, ("fwd", "bwd_data")), "dropout": ("fwd", "bwd_data"),
    "drop_path": ("fwd", "bwd_data"), "batchnorm": PASSES,
    "add": ("fwd", "bwd_data"), "concat": ("fwd", "bwd_data"), "mul": ("fwd", "bwd_data"),
    "softmax_cross_entropy": ("fwd", "bwd_data"),
}
WEIGHTED = ("conv", "fc")
WINDOWED = ("conv", "maxpool", "avgpool")
JOINS = ("add", "concat", "mul")  # the layers that read several
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
