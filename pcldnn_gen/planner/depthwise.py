"""The conv_depthwise family's plans (runtime/families/conv_depthwise.py; template
conv_depthwise.c.j2): planned for bandwidth, not for FMAs.

A depthwise convolution multiplies each channel by its own KH x KW window: 2 KH KW FLOPs per
output value, against conv_direct's 2 KH KW C. Its operands are a channel's lanes, so the
blocked layouts serve it as they are (a vector: V channels of one pixel), but the FLOPs per
byte moved are those of one window, a few per byte, under any CPU's balance of FMA rate to
memory bandwidth: the kernels are bound by reading their activations once and writing their
result once, and the plan's job is to keep them at that bound:

- forward: a register tile of `width` output pixels of one row (one vector each), the KH x KW
  weight vectors loaded once per tap for the tile, the input pixels read from L1 (a tile's
  input rows stay there across its taps); as many pixels as hide the FMA latency, within the
  register file;
- backward-data: dy's rows added into dx's rows tap by tap (one AXPY per tap over a row, in
  L1), every stride and padding alike, each (image, channel block) plane one thread's;
- backward-weights: a channel block's KH x KW weight vectors summed over the minibatch's
  output pixels, `width` partial sums a tap, each block one thread's (the same bits on any
  thread count).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..arch import Arch
from ..netspec import LayerSpec
from .plans import KernelPlan


@dataclass(frozen=True, kw_only=True)
class DepthwisePlan(KernelPlan):
    width: int                      # forward: output pixels a register tile; backward-weights: partial sums a tap
    ow_lo: int                      # forward: the first output column whose window needs no left padding
    ow_hi: int                      # one past the last whose window needs no right padding
    flops_per_byte: float           # nominal FLOPs of the pass over the bytes it must move (activations once)

    def blocks_summary(self) -> str:
        what = "output pixels a register tile" if self.pass_name == "fwd" else "partial sums a tap"
        return "" if self.pass_name == "bwd_data" else f"{self.width} {what}"


def plan_conv_depthwise(layer: LayerSpec, pass_name: str, arch: Arch) -> DepthwisePlan:
    v = arch.vector_floats
    kh, kw = layer.kernel
    (_, oh, ow), (_, ih, iw) = layer.out_shape, layer.in_shape
    # independent accumulators that hide the FMA latency on every unit, within the register
    # file (the tile's weight vector and an input vector beside them)
    width = max(1, min(arch.fma_latency * arch.fma_units, arch.vector_registers - 2, ow if pass_name == "fwd" else 8))
    flops = 2 * kh * kw * oh * ow  # per channel and image
    moved = 4 * (ih * iw + oh * ow)  # each pass reads one activation (x or dy) and another or writes it
    ratio = flops / moved
    machine = arch.vector_floats * 2 * arch.fma_units / arch.l2_bytes_per_cycle
    sw, pw = layer.stride[1], layer.pad[1]
    ow_lo = min(ow, -(-pw // sw))
    ow_hi = max(ow_lo, min(ow, (iw + pw - kw) // sw + 1))
    what = {"fwd": f"register tiles of {width} output pixels x one vector of {v} channels, each tap's weight "
                   "vector loaded once a tile",
            "bwd_data": "dy's rows added into dx's rows tap by tap (an AXPY over a row, in L1), a plane a thread",
            "bwd_weights": f"each tap's weight gradient in {width} partial sums over a row, a channel block a thread"}
    bound = ("bound by memory" if ratio < machine else
             "about the FMAs' balance with L2, and bound by memory wherever its activations come from beyond L2")
    reason = (f"depthwise: {ratio:.2f} FLOP per byte the pass moves (each activation read or written once) against "
              f"the {machine:.1f} FLOP per byte this CPU's FMAs take from L2 at peak: {bound}, planned for "
              f"bandwidth; {what[pass_name]}")
    return DepthwisePlan(layer=layer.name, pass_name=pass_name, kind=f"conv_{pass_name}_depthwise",
                         template="conv_depthwise.c.j2", isa=arch.isa, vector_floats=v, reason=reason,
                         width=width, ow_lo=ow_lo, ow_hi=ow_hi, flops_per_byte=round(ratio, 3))
