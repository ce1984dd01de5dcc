"""The AMX conv plans: the tile shape is fixed by the hardware, so what the model chooses is the
reduction chunk that keeps a work item's operands in L1 (forward, backward-data) and the group
of pixel blocks whose copies a work item's accumulators reduce from L2 (backward-weights)."""
from __future__ import annotations

from pcldnn_runtime.geometry import (
    AMX_PIXEL_BLOCK,
    AMX_ROWS,
    AmxConvGeometry,
    amx_conv_geometry,
    amx_packed_reduction,
    amx_packed_row_steps,
    fc_tile_geometry,
)
from pcldnn_runtime.limits import blocks

from ..arch import Arch
from ..netspec import LayerSpec
from . import explain
from .plans import AmxConvBwdWeightsPlan, AmxConvPlan, AmxPackedConvPlan, FcTileBwdWeightsPlan, FcTilePlan

# tdpbf16ps of full tiles: 16 x 16 x 32 multiply-adds in 16 cycles (SPR; measured 3.4-3.6
# TFLOP/s on one core of the project's Xeon VM, operands in L1).
AMX_FLOPS_PER_CYCLE = 1024
TILE_BYTES = AMX_ROWS * 64
# Share of L1 a work item's A rows and B tiles may take: measured on VGG-A conv3 and conv7
# (minibatch 16, one thread), chunks of 1-4 blocks: 2 blocks were best (31 KB and 26 KB of
# 48 KB by plan_conv_amx's count); 4 blocks (62 KB, 53 KB) ran 8-15% slower.
L1_SHARE = 0.8
# Pixel blocks per band: the chunk's input rows of a band are read once per 16-channel output
# block, from L2. Measured 1-32 on VGG-A conv3: 8 was best (16 within noise, 32 +10%, 2 +15%).
BAND = 8
# Steps of the next work item issued before the previous item's accumulators are stored: a
# tile store waits for the accumulating tdpbf16ps to retire and holds up the tile unit behind
# it; issued a few steps into the next item, whose accumulators are the other pair, it is
# hidden (36-step items from L1: 2.2-2.4 TFLOP/s storing at the item's end, 3.2-3.4 delayed).
STORE_DELAY = 4
# Share of L2 a backward-weights item's group of pixel blocks may take (dy rows of two output
# blocks, x pairs of two input blocks): the group is re-read from L2 for every tap.
L2_SHARE = 0.5
# Backward-weights copy spans (plan_conv_bwd_weights_amx), measured (VGG-A conv2-8, OverFeat-FAST
# conv2-5, zoo 1x1 layers, mb 16, Xeon VM): spans of 5 units (OverFeat conv5, 1024 channels) lost
# 7% to the whole minibatch's copies, 8-16 gained 9-19% on 12x12-28x28 images; within 56x56
# images (over IMAGE_SPAN units) spans of 16-32 units lost (0.98-1.03x) where 64 gained 10-15%,
# while on 28x28 ones (27 units) a whole image's span lost to half of L2's (VGG-A conv6 0.81x).
MIN_COPY_SPAN = 8
IMAGE_SPAN = 64
# Share of L1 an item's dy rows may take across a group (two output blocks x the group's units):
# they stay in L1 across the item's taps and consecutive input pairs, the x pairs coming from
# L2. Groups sized for L2 alone (56-64 units) streamed both from L2 or L3: ResNet-50's
# backward-weights at 16 units a group (2/3 of 48 KiB) against that, mb 16, one thread, Xeon VM
# (benchmarks/ab.py): 0.95-1.08x on 56x56 and 28x28 layers, 1.03-1.19x on 14x14, 1.00-1.57x on
# 7x7 (the stride-2 projection into 2048 channels 9.4 -> 6.0 ms); 8 units: 0.87-1.61x, 4: 0.69-1.36x.
L1_GROUP_SHARE = 2 / 3
# 1x1 layers reading their bf16 source in place (reads_source_in_place), measured against the
# copy (mb 16, one thread, Xeon VM): 16-128 result channels 1.14-1.75x (resnet50_layer1_reduce
# forward 2.44 -> 1.54 ms), 192-2048 0.70-0.96x (resnet50_layer4_reduce forward, 2048 -> 512
# channels on 7x7: 1.83 -> 2.61 ms, the halved tile rate).
IN_PLACE_RESULT_CHANNELS = 128
# C tiles the packed first layer's backward-data accumulates at once (pieces of 16 dy pixels x
# 16-value blocks of their runs; the other 3 tile registers: A tiles in turn, and 1 B): four
# against six with one A register, 1.00-1.18x on five zoo first layers (mb 16, one thread, Xeon
# VM: the A tile loads need not wait for the previous tdpbf16ps to release their register).
PACKED_DATA_C_TILES = 4
# 1x1 layers whose source is copied: a pixel block's A rows (a tap's only rows) are read once per
# result block, so each block runs every result block in turn with its rows in L1 (the B tiles
# then come from L2), up to this many result channels. Measured (mb 16, one thread, Xeon VM):
# 1.11-1.27x on the zoo's 1x1 layers of 192-1024 result channels, 0.88x at 2048
# (resnet50_layer4_reduce backward-data); on 3x3 layers, whose taps reuse the A rows in L1
# anyway, 0.81-1.00x (VGG-A, OverFeat-FAST).
RESULT_BLOCKS_INNER_CHANNELS = 1024
# The minibatch the fc plan's reason quotes a chunk for (the largest the paper's and the issues'
# fc figures use); the kernels size their chunks for the call's minibatch.
FC_ROWS = 256
# Share of L2 an fc forward / backward-data reduction chunk's bf16 source rows may take. Larger
# chunks mean fewer round trips of the partial sums through the result; measured on VGG-A fc6
# and fc7 at minibatch 256, one thread (ms fc6 fwd): 1/8 81, 1/4 69, 1/2 59, 1 73, 2 81.
FC_SOURCE_SHARE = 0.5
# 16-column result blocks a vdpbf16ps fc register tile spans (8 images x this many vectors:
# 8 broadcasts and this many weight loads per 8 x this many dot products).
FC_DOT_BLOCKS = 3
# Share of L2 a vdpbf16ps column group's weights of a reduction chunk may take: every 8-image
# register tile of the minibatch reads them again.
FC_PANEL_SHARE = 0.25


def reads_source_in_place(layer: LayerSpec, pass_name: str, source_bf16: bool) -> bool:
    """Whether the AMX forward / backward-data kernel reads its A tiles straight from the source
    (x, or dy) instead of a padded copy in 32-channel pixels: a 1x1 window without padding, whose
    result pixel is its source pixel (at stride 1) or every SH-th row's every SW-th pixel (a
    forward at a stride: a strided A tile per result row), on a bf16 source of whole 16-channel
    blocks that needs no ReLU mask (backward-data with a fused ReLU masks dy as it copies it). A
    tile row is then one pixel's 16 channels (the layout's 32-byte pixel), so a tdpbf16ps does half
    a full tile's reduction; the copy it saves was half the time of such a layer
    (resnet50_layer1_reduce forward, 16x256x56x56 -> 64: copy 1.17 of 2.4 ms). The copy costs
    per source value, the halved rate per product: up to IN_PLACE_RESULT_CHANNELS result
    channels."""
    source_channels, result_channels = (layer.in_shape[0], layer.out_shape[0]) if pass_name == "fwd" else \
        (layer.out_shape[0], layer.in_shape[0])
    return (layer.kernel == (1, 1) and (layer.stride == (1, 1) or pass_name == "fwd") and layer.pad == (0, 0)
            and source_bf16 and source_channels % 16 == 0 and result_channels <= IN_PLACE_RESULT_CHANNELS
            and (pass_name == "fwd" or not layer.activation))


def plan_conv_amx(layer: LayerSpec, pass_name: str, arch: Arch, activations: tuple[bool, bool] = (False, False),
                  gradients: tuple[bool, bool] = (False, False)) -> AmxConvPlan:
    """Work item: 32 flat result pixels x 16 result channels, two C tiles (two A tiles of 16
    pixels share each B tile) accumulated over a chunk of source-channel blocks and all taps;
    the two other C tiles hold the previous item, stored while this one starts. `activations`:
    whether the layer's input and output are stored as bf16 (families.bf16_outputs), `gradients`
    its (input, output) gradients (families.bf16_gradients); a 1x1 layer's bf16 source may be
    read in place (reads_source_in_place)."""
    kh, kw = layer.kernel
    geo = amx_conv_geometry(pass_name, layer.in_shape, layer.out_shape, layer.kernel, layer.pad, layer.stride)
    if reads_source_in_place(layer, pass_name, activations[0] if pass_name == "fwd" else gradients[1]):
        return _plan_conv_amx_in_place(layer, pass_name, arch, geo, activations)
    if geo.phases:  # backward-data per phase of dx: a phase's steps are its taps
        kh, kw = max(q.taps_h for q in geo.phases), max(q.taps_w for q in geo.phases)
    # one 32-channel block's A rows: a run of 32 + KW - 1 pixels in each of KH rows (one span
    # where the rows overlap)
    a_bytes = min(kh * (AMX_PIXEL_BLOCK + kw - 1), (kh - 1) * geo.wp + AMX_PIXEL_BLOCK + kw - 1) * 64 \
        if layer.stride == (1, 1) or pass_name != "fwd" else kh * (AMX_PIXEL_BLOCK + kw - 1) * 64
    b_bytes = kh * kw * TILE_BYTES
    per_block = a_bytes + b_bytes
    chunk = max(1, min(geo.icb, int(L1_SHARE * arch.l1d_bytes) // per_block))
    chunks = -(-geo.icb // chunk)
    chunk = -(-geo.icb // chunks)  # balanced: the last chunk is not a sliver
    (sc, _, _), (rc, rh, rw) = geo.source, geo.result
    row = max(q.cols for q in geo.phases) if geo.phases else rw  # results of a flat row
    # (no pixel blocks: a backward-data whose window never reaches the input, dx zero)
    useful = (rh * rw) / (geo.pixel_blocks * AMX_PIXEL_BLOCK) * sc / (geo.icb * 32) if geo.pixel_blocks else 0.0
    band_rows = geo.band_rows(BAND, layer.kernel)
    inner = layer.kernel == (1, 1) and rc <= RESULT_BLOCKS_INNER_CHANNELS
    phases = "" if geo.stride == (1, 1) else f"stride {geo.stride[0]}x{geo.stride[1]} on phase planes, "
    if geo.phases:
        count, (sh, sw) = len(geo.phases), geo.result_stride
        empty = f", {len(geo.empty_phases)} without taps: zero" if geo.empty_phases else ""
        phases = f"dx in {count} phase{'s' if count > 1 else ''} of stride {sh}x{sw} (at most {kh}x{kw} taps each{empty}), "
    reason = (f"tdpbf16ps: {AMX_FLOPS_PER_CYCLE} FLOP/cycle at full tiles; {phases}flat rows of {geo.wq} columns for {row} "
              f"results and {geo.icb * 32} padded source channels for {sc}: {useful:.0%} of tile work useful. "
              f"Reduction chunk {chunk} of {geo.icb} 32-channel blocks: its A rows and B tiles, "
              f"{chunk * per_block // 1024} KiB, fit {L1_SHARE:.0%} of L1 ({arch.l1d_bytes // 1024} KiB). Bands of "
              f"{BAND} pixel blocks and the previous item's accumulators stored {STORE_DELAY} steps into the next "
              f"(a tile store waits for its last tdpbf16ps): measured choices"
              + (f"; each band first copies the {band_rows} padded source rows it reads into its thread's buffer "
                 f"({geo.icb * band_rows * geo.wp * 64 // 1024} KiB, in L2 for the band's tiles)" if geo.banded else "")
              + (f"; a pixel block runs its {-(-rc // 16)} result blocks in turn, its A rows in L1 (a 1x1 window "
                 f"reads them once per result block)" if inner else "")
              + explain.bf16_activations(pass_name, activations))
    return AmxConvPlan(layer=layer.name, pass_name=pass_name, kind=f"conv_{pass_name}_amx", template="conv_amx.c.j2",
                       isa=arch.isa, vector_floats=arch.vector_floats, reason=reason, result_blocks_inner=inner,
                       predicted_efficiency=useful, l1_working_set=chunk * per_block,
                       l2_bytes_per_flop=b_bytes / (2 * AMX_PIXEL_BLOCK * 16 * 32 * kh * kw),
                       chunk=chunk, band=BAND, store_delay=STORE_DELAY, activations=activations)


def _plan_conv_amx_in_place(layer: LayerSpec, pass_name: str, arch: Arch, geo: AmxConvGeometry,
                            activations: tuple[bool, bool]) -> AmxConvPlan:
    """reads_source_in_place: a work unit is 32 pixels; its items, one per 16-channel result
    block, reduce over every source block in turn (the unit's A rows, SC x 64 bytes, stay in L1
    across them), while the next unit's rows are prefetched."""
    (sc, _, _), (rc, rh, rw) = geo.source, geo.result
    a_bytes, b_bytes = sc // 16 * 2 * TILE_BYTES // 2, -(-rc // 16) * sc // 16 * TILE_BYTES // 2
    sh, sw = layer.stride
    if (sh, sw) == (1, 1):  # units of 32 flat pixels
        useful, unit, where = (rh * rw) / (geo.pixel_blocks * AMX_PIXEL_BLOCK), "pixels", "1x1 at stride 1"
    else:  # units of 32 results of one result row, A tile rows sw pixels apart
        useful = rw / (-(-rw // AMX_PIXEL_BLOCK) * AMX_PIXEL_BLOCK)
        unit, where = "results of a result row", f"1x1 at stride {sh}x{sw} (A tile rows {sw} pixels apart)"
    reason = (f"tdpbf16ps: {AMX_FLOPS_PER_CYCLE} FLOP/cycle at full tiles; {where} on a bf16 source of "
              f"{sc} channels: A tiles read in place, 16 pixels x 16 channels (half a tile's reduction a "
              f"tdpbf16ps, {AMX_FLOPS_PER_CYCLE // 2} FLOP/cycle), instead of a copy in 32-channel pixels (half the "
              f"time of such a layer: measured); {useful:.0%} of the units' rows are results. A unit of 32 "
              f"{unit}: its A rows ({a_bytes // 1024} KiB) stay in L1 across its {-(-rc // 16)} result blocks, the "
              f"next unit's are prefetched while they run; the previous item's accumulators stored {STORE_DELAY} "
              f"steps into the next")
    return AmxConvPlan(layer=layer.name, pass_name=pass_name, kind=f"conv_{pass_name}_amx", template="conv_amx.c.j2",
                       isa=arch.isa, vector_floats=arch.vector_floats, reason=reason,
                       predicted_efficiency=useful / 2, l1_working_set=a_bytes + b_bytes,
                       l2_bytes_per_flop=b_bytes / (2 * AMX_PIXEL_BLOCK * rc * sc),
                       chunk=geo.icb, band=1, store_delay=STORE_DELAY, activations=activations, direct=True)


def plan_conv_packed_amx(layer: LayerSpec, pass_name: str, arch: Arch) -> AmxPackedConvPlan:
    """The first layer's packed few-channel input (an RGB image: its pixels are not whole
    channel pairs, so the flat-pixel scheme does not apply). Forward: a kernel row's KW x C
    window values are contiguous in the image, so A tiles of 16 pixels of an output row are read
    in place from a padded bf16 copy of the image, 32 values a step per kernel row (values past
    the window against zero weights); building im2col rows instead took 70% of ResNet's 7x7
    stride-2 layer (Xeon VM, minibatch 16), its tile work 14%. But that is a B tile per output
    block, kernel row and step: where they do not stay in L1 (AlexNet's 11x11 window, 96
    channels: 132 KiB; 256 channels of a 3x3 window on one) every work item reads them from L2
    and the im2col rows (fewer, denser B tiles) are faster. Backward-weights: each output
    pixel's window as one im2col row of KH x KW x C values padded to 32, dy channel-major times
    the rows in pixel pairs, over groups of (image, pixel block) units whose copies fit L2_SHARE
    of L2, the accumulators reloaded between groups (as plan_conv_bwd_weights_amx)."""
    c = layer.in_shape[0]
    if pass_name == "bwd_data":
        return _plan_conv_bwd_data_packed_amx(layer, arch)
    kp = amx_packed_reduction(layer.in_shape, layer.kernel)
    k = layer.kernel[0] * layer.kernel[1] * c
    run, steps = layer.kernel[1] * c, amx_packed_row_steps(layer.in_shape, layer.kernel)
    row_tiles = blocks(layer.out_shape[0], 16) * layer.kernel[0] * steps * TILE_BYTES
    if pass_name == "fwd" and row_tiles <= L1_SHARE * arch.l1d_bytes:
        reason = (f"tdpbf16ps: {AMX_FLOPS_PER_CYCLE} FLOP/cycle at full tiles; {c} input channels: a kernel row's "
                  f"{layer.kernel[1]}x{c} window values are contiguous in a padded bf16 copy of the image, read in "
                  f"place as A tiles of 16 pixels of an output row x 32 values ({steps} step(s) a kernel row, "
                  f"{run / (32 * steps):.0%} of tile work useful), no im2col rows; the {row_tiles // 1024} KiB of "
                  f"B tiles (one per output block, kernel row and step) stay in L1; {layer.kernel[0] * steps} tile "
                  f"steps a work item")
        return AmxPackedConvPlan(layer=layer.name, pass_name=pass_name, kind="conv_fwd_packed_amx",
                                 template="conv_packed_amx.c.j2", isa=arch.isa, vector_floats=arch.vector_floats,
                                 reason=reason, predicted_efficiency=run / (32 * steps), l1_working_set=4 * TILE_BYTES,
                                 reduction=layer.kernel[0] * steps * 32, pixel_blocks=1, in_place=True)
    # backward-weights, per unit: its dy as OC/16 A tiles and its rows' pixel pairs as KP/16 B
    # tiles (1 KiB each), all read by a thread's items
    per_unit = (-(-layer.out_shape[0] // 16) + kp // 16) * TILE_BYTES
    units = max(1, int(L2_SHARE * arch.l2_bytes) // per_unit)
    how = (f"{kp // 32} tile step(s) a work item; B tiles one per kernel row ({row_tiles // 1024} KiB) would "
           f"not stay in L1, so im2col rows" if pass_name == "fwd" else
           f"groups of {units} (image, 32-pixel block) units, {per_unit // 1024} KiB a unit, within "
           f"{L2_SHARE:.0%} of L2 ({arch.l2_bytes // 1024} KiB)")
    reason = (f"tdpbf16ps: {AMX_FLOPS_PER_CYCLE} FLOP/cycle at full tiles; {c} input channels: a pixel's "
              f"{layer.kernel[0]}x{layer.kernel[1]} window is one im2col row of {k} values padded to {kp} "
              f"({k / kp:.0%} of tile work useful); {how}")
    return AmxPackedConvPlan(layer=layer.name, pass_name=pass_name, kind=f"conv_{pass_name}_packed_amx",
                             template="conv_packed_amx.c.j2", isa=arch.isa, vector_floats=arch.vector_floats,
                             reason=reason, predicted_efficiency=k / kp, l1_working_set=4 * TILE_BYTES, reduction=kp,
                             pixel_blocks=units)


def _plan_conv_bwd_data_packed_amx(layer: LayerSpec, arch: Arch) -> AmxPackedConvPlan:
    """dx of the packed first layer, by dx row: a pixel and kernel row reach a run of KW x C
    contiguous dx values, so C tiles of 16 dy pixels x 16 values of their runs (A: the pixels'
    dy read in place from a bf16 copy of its row; B: the weights transposed, per kernel row,
    16-value block and 32-channel step) accumulate over every kernel row reaching the dx row and
    are then added into it at each pixel's column (shifted in registers). The fp32 few-channel
    kernel it replaces ran ResNet's and GoogLeNet's 7x7 stride-2 conv1 at 0.44-0.72x oneDNN's
    AMX kernels (Xeon VM, minibatch 16)."""
    c, oc = layer.in_shape[0], layer.out_shape[0]
    (kh, kw), (sh, sw) = layer.kernel, layer.stride
    run, steps = kw * c, -(-oc // 32)
    column_blocks = -(-run // 16)
    taps = -(-kh // sh)
    tile_bytes = taps * column_blocks * steps * TILE_BYTES  # the B tiles one dx row reads
    useful = run / (16 * column_blocks) * oc / (32 * steps)
    group = min(column_blocks, PACKED_DATA_C_TILES)
    pieces = min(max(PACKED_DATA_C_TILES // group, 1), -(-layer.out_shape[2] // 16))
    reason = (f"tdpbf16ps: {AMX_FLOPS_PER_CYCLE} FLOP/cycle at full tiles; {c} input channels: an output pixel and "
              f"kernel row reach {kw}x{c} contiguous dx values, {column_blocks} C tile(s) of 16 pixels x 16 of them, "
              f"reduced over {oc} channels of dy ({steps} step(s) of 32) and the up to {taps} kernel row(s) reaching "
              f"a dx row ({useful:.0%} of tile work useful); each pixel's run then added into the dx row "
              f"{sw * c} values after the previous one (register shifts); the {tile_bytes // 1024} KiB of B tiles a "
              f"dx row reads {'stay in L1' if tile_bytes <= L1_SHARE * arch.l1d_bytes else 'come from L2'}. "
              f"{pieces} piece(s) x {group} block(s) of C tiles at once, the pieces' A tiles in the other tile "
              f"registers in turn (at most {PACKED_DATA_C_TILES} C tiles: measured)")
    return AmxPackedConvPlan(layer=layer.name, pass_name="bwd_data", kind="conv_bwd_data_packed_amx",
                             template="conv_bwd_data_packed_amx.c.j2", isa=arch.isa, vector_floats=arch.vector_floats,
                             reason=reason, predicted_efficiency=useful, l1_working_set=tile_bytes,
                             reduction=steps * 32, pixel_blocks=1, pieces=pieces, column_group=group)


def plan_conv_bwd_weights_amx(layer: LayerSpec, arch: Arch,
                              activations: tuple[bool, bool] = (False, False)) -> AmxConvBwdWeightsPlan:
    """Work item: the four C tiles of two output x two input channel blocks for one tap; the
    reduction runs over a group of (image, 32-pixel block) units with the accumulators in the
    tiles, which are reloaded from an fp32 buffer between groups (a reload costs a tile store's
    wait per item, tap and group). The dy and x copies are made per span of units, the span
    being the group, as many units as keep every channel block's copies in L2_SHARE of L2 (no
    fewer than IMAGE_SPAN in images of more units): a span's copies are written and read in L2, not
    sent to L3 and read back. Where fewer than MIN_COPY_SPAN units fit, the copies of the
    whole minibatch are made first and a group is as many units as keep one item's dy rows
    and x pairs in L2_SHARE of L2 across its taps. Either way no more units than keep an item's
    dy rows in L1_GROUP_SHARE of L1."""
    kh, kw = layer.kernel
    geo = amx_conv_geometry("bwd_weights", layer.in_shape, layer.out_shape, layer.kernel, layer.pad, layer.stride)
    phases = layer.stride[0] * layer.stride[1]
    # per unit, every channel block: dy (OCB tiles of 16 channels x 32 pixels) and x pairs (ICB x
    # phase tiles of 16 pairs, from even pixels and, where a tap reads them, odd ones)
    copy_per_unit = (-(-layer.out_shape[0] // 16) + (1 + geo.odd_gradient_pairs(layer.kernel))
                     * -(-layer.in_shape[0] // 16) * phases) * TILE_BYTES
    fit = int(L2_SHARE * arch.l2_bytes) // copy_per_unit
    copy_units = 0 if fit < MIN_COPY_SPAN else max(fit, IMAGE_SPAN) if geo.pixel_blocks > IMAGE_SPAN else fit
    if copy_units:
        units = copy_units
        how = (f"copies made per span of {units} units (every channel block's dy and x pairs, "
               f"{copy_per_unit // 1024} KiB a unit: {fit} fit {L2_SHARE:.0%} of L2 ({arch.l2_bytes // 1024} KiB); "
               f"no fewer than {IMAGE_SPAN} in images of more), "
               f"each span reduced while its copies are in L2")
    else:
        # per unit: dy of two output blocks (16 channels x 32 pixels, bf16), x pairs of two input
        # blocks from even and odd pixels (16 pairs x 64 bytes) of every phase plane
        per_unit = 2 * 16 * AMX_PIXEL_BLOCK * 2 + 2 * 2 * phases * 16 * 64
        units = max(1, int(L2_SHARE * arch.l2_bytes) // per_unit)
        how = (f"the minibatch's copies made first (a span of every channel block's copies, "
               f"{copy_per_unit // 1024} KiB a unit, would hold {fit} units in {L2_SHARE:.0%} of L2, under "
               f"{MIN_COPY_SPAN}); groups of {units} units: an item's dy rows and x pairs, {per_unit // 1024} KiB a "
               f"unit, fit {L2_SHARE:.0%} of L2 across its {kh * kw} taps")
    in_l1 = max(1, int(L1_GROUP_SHARE * arch.l1d_bytes) // (2 * TILE_BYTES))
    if units > in_l1:
        units = in_l1
        how += f"; groups of {units} units, an item's dy rows ({2 * units} KiB) in {L1_GROUP_SHARE:.0%} of L1"
    _, oh, ow = layer.out_shape
    useful = (oh * ow) / (geo.pixel_blocks * AMX_PIXEL_BLOCK)
    reason = (f"tdpbf16ps: {AMX_FLOPS_PER_CYCLE} FLOP/cycle at full tiles, the reduction over flat pixels "
              f"({'' if phases == 1 else f'stride {geo.stride[0]}x{geo.stride[1]} on phase planes, '}rows of "
              f"{geo.wq} for {ow} outputs: {useful:.0%} of tile work useful); (image, 32-pixel block) units "
              f"({geo.pixel_blocks} an image): {how}{explain.bf16_activations('bwd_weights', activations)}")
    return AmxConvBwdWeightsPlan(layer=layer.name, pass_name="bwd_weights", kind="conv_bwd_weights_amx",
                                 template="conv_bwd_weights_amx.c.j2", isa=arch.isa,
                                 vector_floats=arch.vector_floats, reason=reason, predicted_efficiency=useful,
                                 l1_working_set=4 * TILE_BYTES, pixel_blocks=units, activations=activations,
                                 copy_units=copy_units)


def plan_fc_tiles(layer: LayerSpec, pass_name: str, arch: Arch, amx: bool) -> FcTilePlan:
    """Forward (result: images x features, reduced over the inputs) and backward-data (images x
    inputs, reduced over the output features) over reduction chunks, reading the layer's bf16
    tile copy of the weights (made once after each change of the weights, not per call). AMX:
    a work item is 32 images x 32 result columns (4 C tiles); vdpbf16ps: 8 images x
    FC_DOT_BLOCKS vectors of 16 columns (a register tile), for the minibatch's images only. The
    chunk, sized by the kernel for the call's minibatch: the bf16 source rows stay in
    FC_SOURCE_SHARE of L2 while every column group of the chunk reads them, and (vdpbf16ps) a
    group's weights of the chunk in FC_PANEL_SHARE; each group's weight tiles of the chunk are
    read from memory once and reused by every row of images from L2."""
    geo = fc_tile_geometry(layer.in_shape, layer.out_shape[0], arch.vector_floats)
    rp = geo.kp if pass_name == "fwd" else geo.fp
    source_bytes = int(FC_SOURCE_SHARE * arch.l2_bytes)
    reduced = "inputs" if pass_name == "fwd" else "output features"
    source = "input" if pass_name == "fwd" else "output gradient (masked by the ReLU)"
    panel_bytes = int(FC_PANEL_SHARE * arch.l2_bytes)
    max_chunk = 0 if amx else max(32, panel_bytes // (FC_DOT_BLOCKS * 32) // 32 * 32)  # 32 bytes a value and block
    rate = (f"tdpbf16ps: {AMX_FLOPS_PER_CYCLE} FLOP/cycle at full tiles; 32 images x 32 columns a work item "
            "(partial where the minibatch is not a multiple of 32)" if amx else
            f"vdpbf16ps: 8 images x {FC_DOT_BLOCKS} vectors of 16 columns a register tile ({8 * FC_DOT_BLOCKS} "
            f"accumulators, {FC_DOT_BLOCKS} weight vectors and a broadcast pair a step; 8 broadcasts per "
            f"{8 * FC_DOT_BLOCKS} dot products), the minibatch's images only")
    panel = "" if amx else (f", and a column group's bf16 weights of the chunk within {FC_PANEL_SHARE:.0%} of L2 "
                            f"({panel_bytes // 1024} KiB: at most {max_chunk} "
                            f"{reduced}), read again by every 8 images")
    reason = (f"{rate}. Reduction chunks of the {rp} {reduced} sized at run time so the bf16 {source} rows of the "
              f"minibatch stay within {FC_SOURCE_SHARE:.0%} of L2 ({source_bytes // 1024} KiB; {FC_ROWS} images: "
              f"{max(32, source_bytes // (FC_ROWS * 2) // 32 * 32)} {reduced}) across the column groups{panel}: the "
              f"fewer chunks, the fewer reloads of the partial sums. Each group's weight tiles of a chunk are read "
              f"once from the layer's bf16 weight copy")
    return FcTilePlan(layer=layer.name, pass_name=pass_name, kind=f"fc_{pass_name}_{'amx' if amx else 'bf16'}",
                      template="fc_tiles.c.j2", isa=arch.isa, vector_floats=arch.vector_floats, reason=reason,
                      predicted_efficiency=1.0, l1_working_set=4 * TILE_BYTES, source_bytes=source_bytes,
                      column_blocks=2 if amx else FC_DOT_BLOCKS, max_chunk=max_chunk)


def plan_fc_tiles_bwd_weights(layer: LayerSpec, arch: Arch, amx: bool) -> FcTileBwdWeightsPlan:
    """Work item: 32 inputs x 32 features of dW (AMX: 4 C tiles; vdpbf16ps: 32 inputs x
    FC_DOT_BLOCKS blocks of 16 features, 4 register tiles of 8 inputs, over the minibatch's image
    pairs only), reduced over the minibatch: A = x transposed (16 inputs x 32 images),
    B = dy in image pairs (32 images x 16 features). Items run over the output blocks inside the
    input groups, so an item's rows of x stay in L1 and the dy pairs of a chunk of output blocks
    in L2; the chunk: as many blocks as fit L2_SHARE of L2 at the call's minibatch."""
    dy_bytes = int(L2_SHARE * arch.l2_bytes)
    rate = (f"tdpbf16ps: {AMX_FLOPS_PER_CYCLE} FLOP/cycle at full tiles; the reduction runs over the minibatch "
            "rounded up to 32 images" if amx else
            f"vdpbf16ps on image pairs, 8 inputs x {FC_DOT_BLOCKS} vectors of 16 features a register tile; the reduction "
            "runs over the minibatch's pairs")
    reason = (f"{rate}. dW, the fp32 result, is "
              f"streamed out once, 1 KiB per 16 inputs x 16 features; dy pairs of a chunk of output blocks within "
              f"{L2_SHARE:.0%} of L2 ({arch.l2_bytes // 1024} KiB), x transposed read once a chunk")
    return FcTileBwdWeightsPlan(layer=layer.name, pass_name="bwd_weights",
                                kind=f"fc_bwd_weights_{'amx' if amx else 'bf16'}",
                                template="fc_tiles_bwd_weights.c.j2", isa=arch.isa, vector_floats=arch.vector_floats,
                                reason=reason, predicted_efficiency=1.0, l1_working_set=4 * TILE_BYTES,
                                dy_bytes=dy_bytes, column_blocks=2 if amx else FC_DOT_BLOCKS)
