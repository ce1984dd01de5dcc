"""Which kernels compute two layers' work together (docs/design.md, "Fusion"): decided once from
the layer list, by the generator when it plans a build (the kernels are written for it) and by
the runtime when it loads one (it calls them so), as `choose` decides families.

Two fusions, each where it saves a pass over an activation and changes no result:
- statistics: an fp32 convolution (direct or depthwise) whose only reader is a batchnorm
  computes that batchnorm's batch statistics (per-channel mean and variance) from each block of
  output rows it has just written, while they are in cache; the batchnorm's forward then reads
  its input once (apply) instead of three times (sum, squares, apply).
- residual: a batchnorm whose only reader is a two-input add computes the add too: its forward
  writes relu(bn(x) + shortcut) into the add's output (the add kernel and the batchnorm's own
  output are skipped); its backward masks dy by that output in place (the add's ReLU backward),
  and the masked dy is the shortcut's gradient as it is (the add's fan-out: no copy).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..layer_types import ConvKind
from .base import Engine, LayerShape, Target


class FusableLayer(LayerShape, Protocol):
    @property
    def activation(self) -> str | None: ...


@dataclass(frozen=True)
class Fusions:
    """statistics: convolution index -> the batchnorm index whose statistics it computes;
    residual: batchnorm index -> the add index whose sum (and activation) it computes."""
    statistics: Mapping[int, int] = field(default_factory=dict)
    residual: Mapping[int, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.statistics or self.residual)


NONE = Fusions()


def plan_fusions(layers: Sequence[FusableLayer], target: Target) -> Fusions:
    """The fusions of a net's layers (in file order) on `target`."""
    index = {layer.name: i for i, layer in enumerate(layers)}
    readers: dict[int, list[int]] = {}
    for j, layer in enumerate(layers):
        for name in layer.inputs:
            if name in index:
                readers.setdefault(index[name], []).append(j)

    def only_reader(i: int) -> int | None:
        found = readers.get(i, [])
        return found[0] if len(found) == 1 else None

    residual: dict[int, int] = {}
    for j, layer in enumerate(layers):
        if layer.type != "add" or len(layer.inputs) != 2:
            continue
        for name in layer.inputs:  # the first batchnorm input that qualifies
            norm = index.get(name)
            if norm is not None and layers[norm].type == "batchnorm" and not layers[norm].activation \
                    and only_reader(norm) == j:
                residual[norm] = j
                break
    statistics: dict[int, int] = {}
    for i, layer in enumerate(layers):
        reader = only_reader(i)
        if (layer.type == "conv" and not layer.activation and reader is not None and layers[reader].type == "batchnorm"
                and _direct_fp32(layer, target)):
            statistics[i] = reader
    return Fusions(statistics, residual)


def _direct_fp32(layer: FusableLayer, target: Target) -> bool:
    """The convolution's forward is a kernel that fills statistics (Family.fills_statistics: the
    fp32 ones; the bf16 kernels compute none, yet) of an fp32 output: in bf16 builds a dense
    convolution's output into a batchnorm is stored as bf16 (families.bf16_outputs), a depthwise
    one's is not."""
    from . import choose  # the package imports this module
    family, kind = choose(layer, "fwd", target)
    fp32_output = target.precision != "bf16" or layer.conv_kind is not ConvKind.DENSE
    return family.fills_statistics and fp32_output and kind.engine is Engine.FP32
