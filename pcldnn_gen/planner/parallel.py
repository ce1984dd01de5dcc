"""How each weighted kernel's parallel loop shares its work among threads, read off the plan
the templates render: the scaling model's thread-division term (pcldnn_runtime.scaling). One
function an fp32 compute family (LOOPS, by family name).

At a few images per node, a node's cores share few work items: 4 images of a 14x14 layer in
row blocks and oc-vector groups may leave some of 32 threads idle in the last round of a
static schedule. Each function returns a `ParallelLoop`: the items one call's `omp for`
shares out as a function of the minibatch (the collapsed loop extents of the template).
"""
from __future__ import annotations

from collections.abc import Callable

from pcldnn_runtime import families
from pcldnn_runtime.limits import blocks
from pcldnn_runtime.scaling import ParallelLoop

from ..netspec import LayerSpec
from .conv import kernel_layer
from .depthwise import DepthwisePlan
from .plans import ConvBwdDataPlan, ConvBwdWeightsPlan, ConvFwdPlan, FcBwdDataPlan, FcBwdWeightsPlan, FcFwdPlan, KernelPlan


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _blocks(layer: LayerSpec, plan: KernelPlan) -> tuple[LayerSpec, int, int]:
    layer = kernel_layer(layer, plan)
    v = plan.vector_floats
    return layer, blocks(layer.in_shape[0], v), blocks(layer.out_shape[0], v)


def conv_depthwise_loop(layer: LayerSpec, plan: KernelPlan) -> ParallelLoop:
    """templates/conv_depthwise.c.j2"""
    assert isinstance(plan, DepthwisePlan)
    layer, icb, ocb = _blocks(layer, plan)
    if plan.pass_name == "fwd":                         # (image, channel block, output row)
        return ParallelLoop(ocb * layer.out_shape[1], 1, 0)
    if plan.pass_name == "bwd_data":                    # (image, channel block)
        return ParallelLoop(icb, 1, 0)
    return ParallelLoop(0, 1, ocb)                      # channel blocks; images in sequence


def conv_direct_loop(layer: LayerSpec, plan: KernelPlan) -> ParallelLoop:
    """templates/conv_fwd.c.j2, conv_bwd_data.c.j2 (and its few-channel form), conv_bwd_weights.c.j2"""
    layer, icb, ocb = _blocks(layer, plan)
    ih, oh = layer.in_shape[1], layer.out_shape[1]
    tile = plan.tile
    assert tile is not None, f"{plan.kind} has no register tile"
    if isinstance(plan, ConvFwdPlan):                   # (image, oc group, row block)
        return ParallelLoop(ocb // tile.vectors * _ceil(oh, plan.rows), 1, 0)
    if isinstance(plan, ConvBwdDataPlan):
        if plan.few_channels:                           # (image, input row)
            return ParallelLoop(ih, 1, 0)
        return ParallelLoop(_ceil(icb, tile.vectors) * _ceil(ih, plan.rows), 1, 0)   # (image, ic group, row block)
    assert isinstance(plan, ConvBwdWeightsPlan)         # weight tiles; images and pixel blocks in sequence
    kh, kw = layer.kernel
    lanes_per_tile = tile.width // plan.kw_taps
    return ParallelLoop(0, 1, _ceil(ocb, tile.vectors) * icb * kh * _ceil(kw, plan.kw_taps)
                        * (plan.lanes // lanes_per_tile))


def fc_gemm_loop(layer: LayerSpec, plan: KernelPlan) -> ParallelLoop:
    """templates/fc_fwd.c.j2, fc_bwd_data.c.j2, fc_bwd_weights.c.j2"""
    layer, icb, ocb = _blocks(layer, plan)
    tile = plan.tile
    assert tile is not None, f"{plan.kind} has no register tile"
    if isinstance(plan, FcFwdPlan):                     # (output-vector group, row tile), per K chunk
        return ParallelLoop(_ceil(ocb, tile.vectors), tile.width, 0)
    k = icb * plan.vector_floats * layer.in_shape[1] * layer.in_shape[2]
    if isinstance(plan, FcBwdDataPlan):                 # K blocks, per output chunk
        return ParallelLoop(0, 1, _ceil(k, plan.k_block))
    assert isinstance(plan, FcBwdWeightsPlan)           # (output-vector group, K panel), per K chunk
    return ParallelLoop(0, 1, _ceil(ocb, tile.vectors) * _ceil(min(plan.k_chunk, k), tile.width))


# The fp32 compute families' loop models (families.FAMILIES names them; tests/test_families.py
# checks each such family has one): the scaling model plans fp32 kernels
LOOPS: dict[str, Callable[[LayerSpec, KernelPlan], ParallelLoop]] = {
    "conv_direct": conv_direct_loop, "conv_depthwise": conv_depthwise_loop, "fc_gemm": fc_gemm_loop}


def parallel_loop(layer: LayerSpec, plan: KernelPlan) -> ParallelLoop:
    """The work items of the kernel's parallel loop (its family's model)."""
    kind = families.kind_named(plan.kind)
    loop = LOOPS.get(families.family_of(kind).name) if kind is not None else None
    if loop is None:
        raise ValueError(f"no parallel loop model for {plan.kind}")
    return loop(layer, plan)
