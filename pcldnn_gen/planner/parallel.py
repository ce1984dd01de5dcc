"""How each weighted kernel's parallel loop shares its work among threads, read off the plan
the templates render: the scaling model's thread-division term (pcldnn_runtime.scaling).

At a few images per node, a node's cores share few work items: 4 images of a 14x14 layer in
row blocks and oc-vector groups may leave some of 32 threads idle in the last round of a
static schedule. Each function returns a `ParallelLoop`: the items one call's `omp for`
shares out as a function of the minibatch (the collapsed loop extents of the template).
"""
from __future__ import annotations

from pcldnn_runtime.limits import blocks
from pcldnn_runtime.scaling import ParallelLoop

from ..netspec import LayerSpec
from .conv import kernel_layer
from .depthwise import DepthwisePlan
from .plans import ConvBwdDataPlan, ConvBwdWeightsPlan, ConvFwdPlan, FcBwdDataPlan, FcBwdWeightsPlan, FcFwdPlan, KernelPlan


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def parallel_loop(layer: LayerSpec, plan: KernelPlan) -> ParallelLoop:
    """The work items of the kernel's parallel loop (templates: collapse clauses)."""
    layer = kernel_layer(layer, plan)
    v = plan.vector_floats
    ic, ih, iw = layer.in_shape
    oc, oh, _ = layer.out_shape
    icb, ocb = blocks(ic, v), blocks(oc, v)
    if isinstance(plan, DepthwisePlan):                 # templates/conv_depthwise.c.j2
        if plan.pass_name == "fwd":                     # (image, channel block, output row)
            return ParallelLoop(ocb * oh, 1, 0)
        if plan.pass_name == "bwd_data":                # (image, channel block)
            return ParallelLoop(icb, 1, 0)
        return ParallelLoop(0, 1, ocb)                  # channel blocks; images in sequence
    tile = plan.tile
    assert tile is not None, f"{plan.kind} has no register tile"
    if isinstance(plan, ConvFwdPlan):                   # (image, oc group, row block)
        return ParallelLoop(ocb // tile.vectors * _ceil(oh, plan.rows), 1, 0)
    if isinstance(plan, ConvBwdDataPlan):
        if plan.few_channels:                           # (image, input row)
            return ParallelLoop(ih, 1, 0)
        return ParallelLoop(_ceil(icb, tile.vectors) * _ceil(ih, plan.rows), 1, 0)   # (image, ic group, row block)
    if isinstance(plan, ConvBwdWeightsPlan):            # weight tiles; images and pixel blocks in sequence
        kh, kw = layer.kernel
        lanes_per_tile = tile.width // plan.kw_taps
        return ParallelLoop(0, 1, _ceil(ocb, tile.vectors) * icb * kh * _ceil(kw, plan.kw_taps)
                            * (plan.lanes // lanes_per_tile))
    if isinstance(plan, FcFwdPlan):                     # (output-vector group, row tile), per K chunk
        return ParallelLoop(_ceil(ocb, tile.vectors), tile.width, 0)
    k = icb * v * ih * iw
    if isinstance(plan, FcBwdDataPlan):                 # K blocks, per output chunk
        return ParallelLoop(0, 1, _ceil(k, plan.k_block))
    if isinstance(plan, FcBwdWeightsPlan):              # (output-vector group, K panel), per K chunk
        return ParallelLoop(0, 1, _ceil(ocb, tile.vectors) * _ceil(min(plan.k_chunk, k), tile.width))
    raise ValueError(f"no parallel loop model for {plan.kind}")
