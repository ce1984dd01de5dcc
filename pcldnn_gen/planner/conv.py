"""Convolution kernels: forward, backward-data (general and few-channel) and backward-weights."""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

from pcldnn_runtime.geometry import band_images, input_pixel_floats
from pcldnn_runtime.limits import blocks

from ..arch import Arch
from ..errors import PlanError
from ..netspec import LayerSpec
from . import explain
from .plans import BwdDataPhase, ConvBwdDataPlan, ConvBwdWeightsPlan, ConvFwdPlan, KernelPlan, PackedConvBf16Plan
from .tiles import EdgeTile, RegisterTile, Tap, candidates, cover_pieces, cover_row, divisors, pieces_efficiency, put_first

# In conv forward and backward-data tiles, each weight vector comes from another channel
# block (tens of KiB apart): a separate stream. More than 4 ran far below the model's
# prediction: OverFeat-FAST conv2 backward-data (AVX2, one thread) at 43% of peak with a
# 1 x 12 tile against 56% with 4 x 3, both predicted above 90%.
WEIGHT_STREAMS = 4

# A backward-weights tile loads and stores its accumulators once per pixel block: column
# blocks narrower than this spend over 6% of the tile on that (OverFeat-FAST conv1, 10-column
# blocks: 45% of peak).
MIN_BLOCK_COLUMNS = 32

# Backward-weights blocks of fewer pixels than this spend a measurable share of every tile on
# loading and storing its accumulators (_conv_bwd_weights_block); a tile of at most
# STREAMED_VECTORS oc vectors (dy streams) then reads a block bigger than L1 from L2. Measured on
# the Xeon VM (fp32 AVX-512, one thread, mb 16, `benchmarks/ab.py`, interleaved): VGG-A conv7 ran
# 1.66x faster with 14-row blocks than with 1-row ones, conv5 1.16x with 5 rows than 1, and no
# faster with 10; 8x3 tiles streaming 7-14 rows ran 1.03-1.07x the L1-sized blocks, 112-column
# rows 1.00x. Streaming lost up to 10% for 4-vector tiles (4x4 on 56 and 220 columns: they grow
# only within L1), up to 20% for tiles over a few-channel first layer's lanes and taps (VGG-A's
# 6x4, a 9x2), 7-19% for whole-plane blocks of 1x1 layers (their next block is prefetched into L2
# too) and 8-10% on 64x64 planes (8x2). The rule as a whole: VGG-A conv2-8 1.00-1.07x, OverFeat-FAST conv2-5
# 1.00-1.05x, resnet_plain 1.00-1.07x, alexnet_small 1.00-1.03x, VGG-A AVX2 0.99-1.01x.
STREAM_PIXELS = 128
STREAMED_VECTORS = 3

# A 1x1, stride-1, unpadded convolution maps each pixel to the same pixel, and the blocked
# layout (N, C/V, H, W, V) stores a channel block's plane contiguously: the plane can be planned
# and generated as one row of H x W pixels, the same bytes read and written. Where its rows are
# shorter than this, tiles within a row are cut short (7 pixels: 4 + 3, or one of 7) and one row
# holds few of them; as one row of 49 they run full. Measured (`ab.py`, minibatch 16, Ice Lake
# VM, 7-9 rounds), as one row against the plane: AVX-512 7x7 (the zoo's ResNet-50 layer4, MobileNet
# pw13, Inception 5b 1x1) forward 1.07-1.11x, backward-data 1.02-1.15x, two threads 1.05-1.14x;
# 4x4 (1024 -> 256, 256 -> 1024) 1.03-1.12x; AVX2 7x7 0.98-1.14x. A 7-pixel row that was one
# whole tile already (96 -> 40 channels: 7x3) loses a little, 0.89-1.02x on 0.03-0.14 ms kernels
# (benchmarks/ab.py, Ice Lake VM). Not at 8 pixels and wider: 8x8 planes
# 0.86-1.00x forward, 14x14 0.82-0.85x. Backward-weights keeps the plane: 0.97-1.01x (AVX-512),
# 0.72x (AVX2) on 7x7. Only planes of fewer than SMALL_PLANE pixels (what was measured): a tall
# narrow plane as one row would put hundreds of pixels in a row block that no longer fits L1.
PLANE_ROW_BELOW = 8
PLANE_ROW_PASSES = ("fwd", "bwd_data")


def plane_as_row(layer: LayerSpec, pass_name: str) -> LayerSpec | None:
    """The layer as its `pass_name` kernel is planned and generated where that reads its plane
    as one row (PLANE_ROW_BELOW), else None."""
    c, h, w = layer.in_shape
    if (layer.type != "conv" or pass_name not in PLANE_ROW_PASSES or layer.kernel != (1, 1) or layer.stride != (1, 1)
            or layer.pad != (0, 0) or h == 1 or w >= PLANE_ROW_BELOW or h * w >= SMALL_PLANE):
        return None
    return dataclasses.replace(layer, in_shape=(c, 1, h * w), out_shape=(layer.out_shape[0], 1, h * w))


def kernel_layer(layer: LayerSpec, plan: KernelPlan) -> LayerSpec:
    """The layer as `plan`'s kernel sees it: its plane as one row where the plan says so."""
    if isinstance(plan, (ConvFwdPlan, ConvBwdDataPlan)) and plan.plane_as_row:
        return plane_as_row(layer, plan.pass_name) or layer
    return layer


# Share of L2 the packed first layer's vdpbf16ps backward-weights gives its two bands' pair copies.
PACKED_BAND_SHARE = 0.5

# Share of L1 a conv forward block (weight slice, input rows, partial sums), or a backward-weights
# tile slice grown past half of L1, may fill; the rest absorbs conflict misses between its streams.
L1_BUDGET = 0.75
# Core cycles a 64-byte line read from beyond L2 costs a streaming kernel: one core of the Ice
# Lake VM read 26-32 GB/s from L3 and 11.4 GB/s from memory at a ~2.7 GHz clock (119 GB/s from
# L2), i.e. 6 and 15 cycles a line; weights of tens of MB sit in either.
BEYOND_L2_REFILL_CYCLES = 8.0


def _fwd_edge(layer: LayerSpec, start: int, width: int) -> EdgeTile:
    """Forward tile of output columns [start, start + width): per kernel column, the
    (pixel, input column) pairs that read inside the input."""
    iw, kw, sw, pw = layer.in_shape[2], layer.kernel[1], layer.stride[1], layer.pad[1]
    taps = []
    for k in range(kw):
        pixels = tuple((p, (start + p) * sw - pw + k) for p in range(width) if 0 <= (start + p) * sw - pw + k < iw)
        if pixels:
            taps.append(Tap(kw=k, pixels=pixels))
    return EdgeTile(start=start, width=width, taps=tuple(taps))


@dataclass(frozen=True)
class ConvFwdBlocking:
    chunk: int                  # input-channel blocks per reduction chunk
    rows: int                   # output rows per pass over a chunk
    weight_bytes: int           # the chunk's weight slice for one oc-vector group
    input_bytes: int            # the input rows those output rows read, chunk's channels
    partial_bytes: int          # the rows' partial sums
    l2_bytes_per_flop: float    # L2 -> L1 traffic of a row block, all chunks
    overhead: float             # instructions beyond the FMA stream: accumulators in and out per chunk
    refill_cycles_per_flop: float
    weights_streamed: bool = False  # the whole reduction per tile, its weights streamed from L2 (bf16 1x1)

    @property
    def working_set(self) -> int:
        return self.weight_bytes + self.input_bytes + self.partial_bytes


# L3's bandwidth to one core as a share of L2's (an estimate: Skylake-SP to Sapphire Rapids
# sustain ~10-16 B/cycle from L3 against 32-48 from L2; Zen 4/5 about 32 against 64).
L3_BANDWIDTH_SHARE = 0.5

# Planes of fewer output pixels (7x7, 6x6) change which loop order and which prefetch pay.
SMALL_PLANE = 64


def images_inner(weight_bytes: int, groups: int, image_bytes: int, plane_pixels: int, arch: Arch) -> bool:
    """Loop order of a conv kernel over (image, channel group). Images outermost reads every
    group's weight slice once per image, 4 bytes per 2 x plane_pixels FLOPs; groups outermost
    keeps one group's slice in L2 while every image passes and reads each image's streamed
    operand (input or output gradient) once per group instead. Worth it only where the weights
    are far beyond L2 and an image reuses them little: ResNet-18 layer4 (512 -> 512 at 7x7,
    9.4 MB of weights, minibatch 16, one thread) forward 1.17x / 1.12x and backward-data 1.16x /
    1.01x on AVX-512 / AVX2 (ab, 5 rounds). Where an image reuses them 169-196 times or they
    are 2-4x L2 (AlexNet conv3-5, ResNet-18 layer3, ResNet-50 and MobileNet 7x7 1x1 layers)
    the swap measured 0.80-1.05x, mostly below 1."""
    group = weight_bytes // groups
    return (weight_bytes > 4 * arch.l2_bytes and plane_pixels < SMALL_PLANE and group > image_bytes
            and group + image_bytes <= 3 * arch.l2_bytes // 4)


def streams_inputs(layer: LayerSpec, arch: Arch) -> bool:
    """A 1x1 forward kernel reads each input pixel once per oc-vector group, from beyond L2 when
    an image's input is large: the tile software-prefetches the next tile's input pixels into L2
    (inception3a 5x5_reduce, 192 -> 16 channels at 28x28, minibatch 16, AVX-512: its 9.6 MB of
    input comes from L3 and the hardware prefetchers did not keep up with the interleaved
    channel-block streams). A packed few-channel input shares cache lines between pixels and is
    small: left to the hardware."""
    return layer.kernel == (1, 1) and input_pixel_floats(layer.index, layer.type, layer.in_shape[0],
                                                         arch.vector_floats) == arch.vector_floats


# Kernel kind suffix by operand bytes: 2-byte operands are bf16 kernels (abi.SIGNATURES).
_BF16_KIND = {4: "", 2: "_bf16"}


def _conv_fwd_blocking(layer: LayerSpec, tile: RegisterTile, slice_bytes: int, lanes: int,
                       arch: Arch, value_bytes: int = 4) -> ConvFwdBlocking:
    """Reduction chunk and output-row block for conv forward: the pair whose working set fits
    L1_BUDGET of L1 and costs the fewest cycles per FLOP, counting an image's L2 -> L1 refills
    (the weight slice once per row block, at arch.slice_refill_cycles a line: one sequential
    stream; each input row once per row block and the partial sums in and out, at
    arch.l1_refill_cycles) and the accumulator loads and stores every chunk adds to every
    tile. value_bytes 2 (bf16 operands): inputs and weights take half the bytes, a dot-product
    instruction does two multiply-adds per lane, and the partial sums stay fp32."""
    v = arch.vector_floats
    pair = 4 // value_bytes
    ic, ih, iw = layer.in_shape
    _, oh, ow = layer.out_shape
    kh, kw = layer.kernel
    icb = blocks(ic, v)
    xv = input_pixel_floats(layer.index, layer.type, ic, v)
    row_flops = 2 * ow * tile.vectors * v * icb * lanes * kh * kw
    best = None
    for chunk in range(1, icb + 1):
        for rows in range(1, oh + 1):
            rows_in = min(ih, (rows - 1) * layer.stride[0] + kh)
            weights, inputs = chunk * slice_bytes, chunk * rows_in * iw * xv * value_bytes
            partials = rows * ow * tile.vectors * v * 4
            if weights + inputs + partials > L1_BUDGET * arch.l1d_bytes and (chunk, rows) != (1, 1):
                break  # more rows only grow the working set
            # an image's traffic over its row blocks, the last one shorter where rows does not divide oh
            row_blocks = -(-oh // rows)
            last_in = min(ih, (oh - (row_blocks - 1) * rows - 1) * layer.stride[0] + kh)
            weight_traffic = row_blocks * icb * slice_bytes
            traffic = (weight_traffic + icb * ((row_blocks - 1) * rows_in + last_in) * iw * xv * value_bytes
                       + 2 * oh * ow * tile.vectors * v * 4)
            bpf = traffic / (oh * row_flops)
            overhead = 1 + 2 * pair / (chunk * lanes * kh * kw)
            refill = ((traffic - weight_traffic) * arch.l1_refill_cycles + weight_traffic * arch.slice_refill_cycles
                      ) / (oh * row_flops * 64)
            cost = overhead / (2 * v * arch.fma_units * pair) + refill
            # ties (the same row-block count and rows read): the longer blocks
            if best is None or cost < best[0] - 1e-12 or (cost <= best[0] + 1e-12 and chunk == best[1].chunk):
                best = (cost, ConvFwdBlocking(chunk, rows, weights, inputs, partials, bpf, overhead, refill))
    if value_bytes == 2 and (kh, kw) == (1, 1) and layer.stride == (1, 1) and best is not None and best[1].chunk < icb:
        # bf16 1x1: the whole reduction in the registers, each tile streaming its weights from L2
        # (2 bytes per tile pixel and multiply-add pair) instead of a chunk that fits L1 and
        # reloads its partial sums every chunk: a dot product per input-channel pair leaves few
        # of them per chunk (at Zen 4's dot rate, emulated, the zoo's stride-1 1x1 layers: 1.00-1.25x,
        # resnet50_layer1_reduce 1.25x, 1024 input channels 1.00x). The stream overlaps the dot
        # products: its cost is L2's bandwidth,
        # not the serialized refills of the blockings above. Only where those could not take the
        # whole reduction, at stride 1 (ResNet-18's stride-2 projection, 4 blocks, took another
        # tile by this cost: 0.88x).
        weights, inputs = icb * slice_bytes, icb * min(ih, kh) * iw * xv * value_bytes
        partials = ow * tile.vectors * v * 4
        traffic = -(-ow // tile.width) * icb * slice_bytes + inputs + partials
        bpf = traffic / row_flops
        overhead = 1 + 2 * pair / (icb * lanes)
        cost = max(overhead / (2 * v * arch.fma_units * pair), bpf / arch.l2_bytes_per_cycle)
        if best is None or cost < best[0] - 1e-12:
            best = (cost, ConvFwdBlocking(icb, 1, weights, inputs, partials, bpf, overhead, 0.0, True))
    if best is None:
        raise PlanError(f"layer {layer.name}: no reduction chunk fits the caches")
    return best[1]


def plan_conv_fwd(layer: LayerSpec, arch: Arch, choice: tuple[int, int] | None = None,
                  value_bytes: int = 4) -> ConvFwdPlan:
    v = arch.vector_floats
    ic, ih, iw = layer.in_shape
    oc, oh, ow = layer.out_shape
    kh, kw = layer.kernel
    sw, pw = layer.stride[1], layer.pad[1]
    icb, ocb = blocks(ic, v), blocks(oc, v)
    # Columns whose whole window lies inside the input need no bounds: [ow_lo, ow_hi).
    ow_lo = min(ow, -(-pw // sw))
    ow_hi = max(ow_lo, min(ow, (iw + pw - kw) // sw + 1))

    # Weights of one input-channel block for one oc-vector group; with a single, partly filled
    # block (3-channel images) the kernel reads only the real lanes.
    lanes = ic if icb == 1 else v
    peak_flops_per_cycle = 2 * v * arch.fma_units * (4 // value_bytes)
    scored = []
    for tile in candidates(max(1, min(ow, arch.vector_registers)), divisors(ocb, WEIGHT_STREAMS), arch):
        cover = cover_row(ow, ow_lo, ow_hi, tile.width, functools.partial(_fwd_edge, layer))
        row_eff = pieces_efficiency(cover_pieces(cover, kw), tile.vectors, arch)
        slice_bytes = tile.vectors * v * lanes * kh * kw * value_bytes
        blocking = _conv_fwd_blocking(layer, tile, slice_bytes, lanes, arch, value_bytes)
        eff = row_eff / (blocking.overhead + row_eff * blocking.refill_cycles_per_flop * peak_flops_per_cycle)
        # Roofline: the rows cannot run faster than L2 delivers their bytes, or L3 where the
        # group's slices of every chunk, re-read each row block, do not stay in L2 (VGG-A at
        # 64x64, conv7: 512 -> 512 at 4x4, a 1.2 MB group for 4x4 tiles: one-row blocks at 0.5
        # B/FLOP ran 0.79-0.82x the 4x2 tiles' whole-image blocks on Ice Lake's 1.25 MiB L2).
        beyond_l2 = icb * slice_bytes > L1_BUDGET * arch.l2_bytes and blocking.rows < oh
        bandwidth = arch.l2_bytes_per_cycle * (L3_BANDWIDTH_SHARE if beyond_l2 else 1)
        eff = min(eff, bandwidth / (blocking.l2_bytes_per_flop * peak_flops_per_cycle))
        scored.append((eff, tile.width * tile.vectors, -tile.registers, tile, cover, blocking, row_eff, beyond_l2))
    scored.sort(key=lambda s: s[:3], reverse=True)
    scored = put_first(scored, choice, lambda s: s[3])
    eff, _, _, tile, cover, blocking, row_eff, beyond_l2 = scored[0]
    remainders = (cover.rem,) if cover.rem else ()
    reason = explain.conv_fwd(tile, arch, ow, cover, row_eff, icb, blocking.chunk, blocking.rows,
                              blocking.weight_bytes, blocking.input_bytes, blocking.partial_bytes,
                              blocking.working_set <= L1_BUDGET * arch.l1d_bytes, blocking.l2_bytes_per_flop, eff,
                              streams_inputs(layer, arch), blocking.weights_streamed, beyond_l2)
    # Border pixels without an edge tile are computed by 1-pixel tiles.
    widths = {tile.width, *remainders} | ({1} if cover.border else set())
    return ConvFwdPlan(layer=layer.name, pass_name="fwd", kind="conv_fwd" + _BF16_KIND[value_bytes],
                       template="conv_fwd.c.j2", isa=arch.isa,
                       vector_floats=v, reason=reason, tile=tile, tile_widths=tuple(sorted(widths, reverse=True)),
                       remainders=remainders, predicted_efficiency=eff, l1_working_set=blocking.working_set,
                       l2_bytes_per_flop=blocking.l2_bytes_per_flop, rejected=tuple(s[3] for s in scored[1:6]),
                       ifm_chunk=blocking.chunk, rows=blocking.rows, ow_lo=ow_lo, ow_hi=ow_hi, cover=cover,
                       prefetch_inputs=streams_inputs(layer, arch),
                       images_inner=images_inner(ocb * v * icb * lanes * kh * kw * value_bytes, ocb // tile.vectors,
                                                 icb * ih * iw * input_pixel_floats(layer.index, layer.type, ic, v)
                                                 * value_bytes, oh * ow, arch))


def plan_conv_fwd_packed_bf16(layer: LayerSpec, arch: Arch, choice: tuple[int, int] | None = None) -> PackedConvBf16Plan:
    """The net's first layer on a packed few-channel image (RGB), forward, vdpbf16ps: its pixels
    are not whole channel pairs, but a kernel row's window is KW x C contiguous values of an
    image row (the layer is a one-channel convolution of a KW x C wide window, stride SW x C,
    over rows of IW x C values). So the kernel pairs those values (ceil(KW x C / 2) pairs a row,
    an odd run's last value against a zero weight) and reads them in place from a padded bf16
    copy of the image it makes itself (no edge tiles: the padding is zeros in the copy). The
    register tile runs over pixels of one output row x output-channel vectors; a tile's output
    block group's weights (KH x pairs x vectors x 64 B) and the KH padded rows it reads stay in
    L1 where they fit, else the weights stream from L2 once per tile, bounded by L2's bandwidth."""
    v = arch.vector_floats
    c, _, iw = layer.in_shape
    ow = layer.out_shape[2]
    kh, kw = layer.kernel
    ocb = blocks(layer.out_shape[0], v)
    pairs = -(-kw * c // 2)
    useful = kw * c / (2 * pairs)
    row_bytes = kh * (iw + 2 * layer.pad[1]) * c * 2
    peak_flops_per_cycle = 2 * v * arch.fma_units * 2  # a dot-product lane is two multiply-adds
    scored = []
    for tile in candidates(max(1, min(ow, arch.vector_registers)), divisors(ocb, WEIGHT_STREAMS), arch):
        full, rem = divmod(ow, tile.width)
        rem_eff = RegisterTile.evaluate(rem, tile.vectors, arch).efficiency if rem else 1.0
        row_eff = ow / (full * tile.width / tile.efficiency + rem / rem_eff)
        weight_bytes = kh * pairs * tile.vectors * v * 4
        fits = weight_bytes + row_bytes <= L1_BUDGET * arch.l1d_bytes
        eff = row_eff * useful
        if not fits:  # a pair step reads `vectors` weight vectors (64 B) for 64 x width x vectors FLOPs
            eff = min(eff, arch.l2_bytes_per_cycle * tile.width / peak_flops_per_cycle)
        scored.append((eff, tile.width * tile.vectors, -tile.registers, tile, rem, weight_bytes, fits))
    scored.sort(key=lambda s: s[:3], reverse=True)
    scored = put_first(scored, choice, lambda s: s[3])
    eff, _, _, tile, rem, weight_bytes, fits = scored[0]
    reason = (f"vdpbf16ps, {c} input channel(s): a kernel row's {kw}x{c} window values are contiguous in a "
              f"padded bf16 copy of the image, read in place in {pairs} pairs ({useful:.0%} of the dot products "
              f"useful); {explain.tile_sentence(tile, arch, 'px of an output row', 'oc-vectors')}; row of {ow} px = "
              f"{ow // tile.width} full tile(s)" + (f" + 1 of {rem}" if rem else "")
              + f"; a group's {weight_bytes // 1024} KiB of weights + {row_bytes // 1024} KiB of input rows "
              + (f"within 3/4 of L1 ({arch.l1d_bytes // 1024} KiB)" if fits else
                 f"beyond 3/4 of L1 ({arch.l1d_bytes // 1024} KiB): the weights stream from L2")
              + f" -> {eff:.0%} of the bf16 peak predicted")
    return PackedConvBf16Plan(layer=layer.name, pass_name="fwd", kind="conv_fwd_packed_bf16",
                              template="conv_fwd_packed_bf16.c.j2", isa=arch.isa, vector_floats=v, reason=reason,
                              tile=tile, tile_widths=tuple(sorted({tile.width, rem} - {0}, reverse=True)),
                              remainders=(rem,) if rem else (), predicted_efficiency=eff,
                              l1_working_set=weight_bytes + row_bytes,
                              l2_bytes_per_flop=0.0 if fits else 1 / tile.width,
                              rejected=tuple(s[3] for s in scored[1:6]), pairs=pairs)


def plan_conv_bwd_weights_packed_bf16(layer: LayerSpec, arch: Arch,
                                      choice: tuple[int, int] | None = None) -> PackedConvBf16Plan:
    """The packed first layer's backward-weights, vdpbf16ps: dw[oc][kh][t] sums dy[oc] at an
    output pixel times value t of its kernel row kh's window (t < KW x C, contiguous in the
    padded image row), so pairs of neighbouring output pixels (2j, 2j + 1) pair dy (a vector of
    16 output channels) with the words (x[p], x[p + SW C]) at p = 2j SW C + t of a pair copy of
    each padded row: a register tile of consecutive values t x output-channel vectors reads a
    word per value and a dy vector per output block each pixel pair. Bands of an image's output
    rows: their pair copies (two bands' in turn, so one barrier a band) within PACKED_BAND_SHARE of L2,
    the accumulators loaded and stored once a band."""
    v = arch.vector_floats
    c, _, _ = layer.in_shape
    oh, ow = layer.out_shape[1], layer.out_shape[2]
    kh, kw = layer.kernel
    sh, sw = layer.stride
    ocb = blocks(layer.out_shape[0], v)
    run, owp = kw * c, -(-ow // 2)
    useful = ow / (2 * owp)
    x_row = -(-(2 * (owp - 1) * sw * c + run) // 16) * 16 * 4  # bytes of a padded row's pair copy
    dy_row = ocb * owp * v * 4                                     # bytes of an output row's dy pairs
    rows = next((r for r in range(oh, 0, -1)
                 if 2 * (r * dy_row + ((r - 1) * sh + kh) * x_row) <= PACKED_BAND_SHARE * arch.l2_bytes), 1)
    scored = []
    for tile in candidates(max(1, min(run, arch.vector_registers)), divisors(ocb, WEIGHT_STREAMS), arch):
        full, rem = divmod(run, tile.width)
        rem_eff = RegisterTile.evaluate(rem, tile.vectors, arch).efficiency if rem else 1.0
        eff = useful * run / (full * tile.width / tile.efficiency + rem / rem_eff)
        scored.append((eff, tile.width * tile.vectors, -tile.registers, tile, rem))
    scored.sort(key=lambda s: s[:3], reverse=True)
    scored = put_first(scored, choice, lambda s: s[3])
    eff, _, _, tile, rem = scored[0]
    slot = rows * dy_row + ((rows - 1) * sh + kh) * x_row
    reason = (f"vdpbf16ps, {c} input channel(s): pairs of neighbouring output pixels ({useful:.0%} of the pairs "
              f"whole), x as words (x[p], x[p + {sw * c}]) of a pair copy of each padded row; "
              f"{explain.tile_sentence(tile, arch, 'window values', 'oc-vectors')}; a kernel row's {run} values = "
              f"{run // tile.width} full tile(s)" + (f" + 1 of {rem}" if rem else "")
              + f"; bands of {rows} output row(s): {slot // 1024} KiB of pair copies a band, two bands' within "
              f"{PACKED_BAND_SHARE:.0%} of L2 ({arch.l2_bytes // 1024} KiB) -> {eff:.0%} of the bf16 peak predicted")
    return PackedConvBf16Plan(layer=layer.name, pass_name="bwd_weights", kind="conv_bwd_weights_packed_bf16",
                              template="conv_bwd_weights_packed_bf16.c.j2", isa=arch.isa, vector_floats=v,
                              reason=reason, tile=tile, tile_widths=tuple(sorted({tile.width, rem} - {0}, reverse=True)),
                              remainders=(rem,) if rem else (), predicted_efficiency=eff, l1_working_set=0,
                              l2_bytes_per_flop=1 / tile.width, rejected=tuple(s[3] for s in scored[1:6]),
                              band_rows=rows)


def _bwd_data_phases(layer: LayerSpec) -> list[BwdDataPhase]:
    """The stride phases of a row of input columns (see BwdDataPhase), without their cover."""
    iw, ow = layer.in_shape[2], layer.out_shape[2]
    kw, sw, pw = layer.kernel[1], layer.stride[1], layer.pad[1]
    phases = []
    for r in range(min(sw, iw)):
        q_count = -(-(iw - r) // sw)
        kw_first = (r + pw) % sw
        if kw_first >= kw:  # no kernel column lands on these input columns: their gradient is zero
            phases.append(BwdDataPhase(r=r, q_count=q_count, kw_first=kw_first, d_first=0, q_lo=0, q_hi=q_count))
            continue
        kw_last = kw_first + (kw - 1 - kw_first) // sw * sw
        d_first, d_last = (r + pw - kw_first) // sw, (r + pw - kw_last) // sw
        q_lo = min(q_count, max(0, -d_last))
        q_hi = max(q_lo, min(q_count, ow - d_first))
        phases.append(BwdDataPhase(r=r, q_count=q_count, kw_first=kw_first, d_first=d_first, q_lo=q_lo, q_hi=q_hi))
    return phases


def _bwd_data_edge(layer: LayerSpec, phase: BwdDataPhase, start: int, width: int) -> EdgeTile:
    """Backward-data tile of phase columns [start, start + width): per kernel column kw (output
    column q + d), the pixels whose output column exists."""
    ow, kw_all, sw = layer.out_shape[2], layer.kernel[1], layer.stride[1]
    taps = []
    for i, kw in enumerate(range(phase.kw_first, kw_all, sw)):
        d = phase.d_first - i
        pixels = tuple((p, start + p + d) for p in range(width) if 0 <= start + p + d < ow)
        if pixels:
            taps.append(Tap(kw=kw, pixels=pixels))
    return EdgeTile(start=start, width=width, taps=tuple(taps))


def _covered(layer: LayerSpec, phase: BwdDataPhase, width: int) -> BwdDataPhase:
    cover = cover_row(phase.q_count, phase.q_lo, phase.q_hi, width, functools.partial(_bwd_data_edge, layer, phase))
    return BwdDataPhase(r=phase.r, q_count=phase.q_count, kw_first=phase.kw_first, d_first=phase.d_first,
                        q_lo=phase.q_lo, q_hi=phase.q_hi, cover=cover)


def plan_conv_bwd_data(layer: LayerSpec, arch: Arch, choice: tuple[int, int] | None = None,
                       value_bytes: int = 4) -> ConvBwdDataPlan:
    v = arch.vector_floats
    icb, ocb = blocks(layer.in_shape[0], v), blocks(layer.out_shape[0], v)
    kh, kw = layer.kernel
    sw = layer.stride[1]
    phases = _bwd_data_phases(layer)
    if icb == 1 and layer.in_shape[0] < v:
        return _plan_conv_bwd_data_few_channels(layer, arch, phases, choice)
    # Widths up to a whole phase row: one no wider than the tile is a single edge tile (cover_row).
    # The vector count need not divide the ic blocks: the last group is narrower, its tiles as
    # wide (13 blocks, 208 channels, allowed only 1-vector tiles: cifar_conv6_500 at 38% of peak).
    widest = max(p.q_count for p in phases)
    scored = []
    for tile in candidates(max(1, min(widest, arch.vector_registers)), range(1, min(icb, WEIGHT_STREAMS) + 1), arch):
        covered = [_covered(layer, p, tile.width) for p in phases]
        pieces = [piece for p in covered if p.cover for piece in cover_pieces(p.cover, len(range(p.kw_first, kw, sw)))]
        rem = icb % tile.vectors
        # work-weighted over the groups: icb // vectors full ones, and the last at its own efficiency
        eff = icb / ((icb - rem) / pieces_efficiency(pieces, tile.vectors, arch)
                     + (rem / pieces_efficiency(pieces, rem, arch) if rem else 0.0))
        # ties: whole groups (a tile as good whose vectors leave a narrower group measured 0.88-0.96x
        # on VGG-A conv7-8: 7x3 and a group of 2 against 5x4, Ice Lake, one thread), more chains,
        # then fewer loads per FMA
        scored.append((eff, rem == 0, tile.width * tile.vectors, -tile.loads_per_fma, tile, covered))
    scored.sort(key=lambda s: s[:4], reverse=True)
    scored = put_first(scored, choice, lambda s: s[4])
    row_eff, _, _, _, tile, covered = scored[0]
    blocking = _conv_bwd_data_blocking(layer, tile, arch, value_bytes)
    eff = row_eff / (blocking.overhead + row_eff * blocking.refill_cycles_per_flop * 2 * v * arch.fma_units
                     * (4 // value_bytes))
    remainders = tuple(sorted({p.cover.rem for p in covered if p.cover and p.cover.rem}, reverse=True))
    return ConvBwdDataPlan(
        layer=layer.name, pass_name="bwd_data", kind="conv_bwd_data" + _BF16_KIND[value_bytes],
        template="conv_bwd_data.c.j2", isa=arch.isa,
        vector_floats=v, reason=explain.conv_bwd_data(tile, arch, sw, len(phases), row_eff, eff, ocb, blocking,
                                                            icb % tile.vectors),
        tile=tile, tile_widths=tuple(sorted({tile.width, *remainders}, reverse=True)), remainders=remainders,
        predicted_efficiency=eff, l1_working_set=blocking.weight_bytes + blocking.partial_bytes,
        l2_bytes_per_flop=blocking.l2_bytes_per_flop,
        scratch_floats=icb * ocb * kh * kw * v * v, rejected=tuple(s[4] for s in scored[1:6]),
        ofm_chunk=blocking.chunk, rows=blocking.rows, few_channels=False, phases=tuple(covered),
        rem_vectors=icb % tile.vectors,
        images_inner=images_inner(icb * ocb * kh * kw * v * v * value_bytes, -(-icb // tile.vectors),
                                  ocb * v * layer.out_shape[1] * layer.out_shape[2] * value_bytes,
                                  layer.out_shape[1] * layer.out_shape[2], arch))


@dataclass(frozen=True)
class ConvBwdDataBlocking:
    chunk: int                  # output-channel blocks per reduction chunk
    rows: int                   # input rows per pass over a chunk
    weight_bytes: int           # the chunk's transposed weight slice for one ic-vector group
    partial_bytes: int          # the rows' partial sums (dx)
    partials_stay: bool         # slice and partial sums fit L1 together: the sums never leave it
    slice_kept: bool            # the slice stays in L1 over the rows (else read from L2 once per row)
    beyond_l2_bytes: int        # an ic-vector group's weights where they exceed half of L2 (read from L3 once
                                # per row block), else 0
    l2_bytes_per_flop: float
    overhead: float             # accumulator loads and stores per chunk, relative to the FMAs
    refill_cycles_per_flop: float


def _conv_bwd_data_blocking(layer: LayerSpec, tile: RegisterTile, arch: Arch, value_bytes: int = 4) -> ConvBwdDataBlocking:
    """Reduction chunk and input-row block for conv backward-data. The chunk is as many
    output-channel blocks as keep the weight slice within half of L1; the row block is the
    one that costs the fewest cycles per FLOP, counting the L2 -> L1 refills per row block
    (every chunk's weight slice once, the output gradients once, and the rows' partial sums
    once per chunk unless they fit L1 beside the slice). One row per block read the whole
    weight tensor from L2 once per input row: on 14x14 and 7x7 layers that is 0.5 B/FLOP
    (ResNet-18 layer4 stride-2 conv, AVX2: 49% of peak, 0.77x oneDNN). Choosing the chunk by
    the same cost as well picked 1-2 blocks on 1x1 layers (partial sums kept in L1) and ran
    0.80-0.94x the widest chunk (AVX-512, ab.py): the model undercounts what a chunk's
    accumulator reloads cost. value_bytes 2: bf16 weights and dy, as in _conv_fwd_blocking.

    An ic-vector group's whole transposed weights (every chunk's slice) are read once per row
    block; where they do not fit half of L2 they come from L3 or memory, priced at
    BEYOND_L2_REFILL_CYCLES a line, and row blocks grow past the point where the slice stays in
    L1 (it is then read from L2 once per row): OverFeat-FAST conv4-5 (12x12, 512/1024 -> 1024
    channels, a 36 KiB slice, 2.3 MB per group) read every group's weights from beyond L2 once
    per input row, 0.72x oneDNN; 12-row blocks 1.38x / 1.49x that (Ice Lake, AVX-512, ab.py)."""
    v = arch.vector_floats
    pair = 4 // value_bytes
    _, ih, iw = layer.in_shape
    ocb = blocks(layer.out_shape[0], v)
    ow = layer.out_shape[2]
    kh, kw = layer.kernel
    sh, sw = layer.stride
    taps = kh * kw / (sh * sw)  # kernel taps per input pixel, on average
    slice_bytes = tile.vectors * v * v * kh * kw * value_bytes  # transposed weights of one output-channel block
    row_flops = 2 * iw * tile.vectors * v * ocb * v * taps
    best = None
    chunk = max(1, min(ocb, (arch.l1d_bytes // 2) // slice_bytes))
    weights, chunks = chunk * slice_bytes, -(-ocb // chunk)
    group_bytes = ocb * slice_bytes  # every chunk's slice: read once per row block
    beyond_l2 = group_bytes > arch.l2_bytes // 2
    for rows in range(1, ih + 1):
        partials = rows * iw * tile.vectors * v * 4
        # the output-gradient rows the block reads stream through L1 past the slice
        dy_rows = min(layer.out_shape[1], -(-rows // sh) + kh // sh)
        streamed = chunk * dy_rows * ow * v * value_bytes
        kept = weights + streamed <= L1_BUDGET * arch.l1d_bytes  # the slice stays in L1 from row to row
        if rows > 1 and (partials > arch.l2_bytes // 4 or not (kept or beyond_l2)):
            break
        stay = weights + streamed + partials <= L1_BUDGET * arch.l1d_bytes
        traffic = ((1 if kept else rows) * group_bytes + ocb * dy_rows * ow * v * value_bytes
                   + (0 if stay else 2 * partials * chunks))
        bpf = traffic / (rows * row_flops)
        overhead = 1 + 2 * pair / (chunk * v * taps)
        refill = bpf / 64 * arch.l1_refill_cycles
        if beyond_l2:
            refill += group_bytes / (rows * row_flops) / 64 * BEYOND_L2_REFILL_CYCLES
        cost = overhead / (2 * v * arch.fma_units * pair) + refill
        if best is None or cost < best[0] - 1e-12:
            best = (cost, ConvBwdDataBlocking(chunk, rows, weights, partials, stay, kept,
                                              group_bytes if beyond_l2 else 0, bpf, overhead, refill))
    assert best is not None
    rows = -(-ih // -(-ih // best[1].rows))  # equal blocks: 14 rows as 7 + 7, not 8 + 6 (no bigger, so still fits)
    return dataclasses.replace(best[1], rows=rows, partial_bytes=rows * iw * tile.vectors * v * 4)


def _plan_conv_bwd_data_few_channels(layer: LayerSpec, arch: Arch, phases: list[BwdDataPhase],
                                     choice: tuple[int, int] | None) -> ConvBwdDataPlan:
    """Fewer input channels than a vector (an RGB first layer): the general kernel's ic vectors
    would be mostly padding (3 of 8 lanes: kernel_profile counted 2.65x the ideal FMAs on VGG-A
    conv1), so this variant vectorises over the output channels, one accumulator per (input
    pixel, input channel), and sums each across lanes at the end. The tile holds the weights of
    all input channels for one tap and streams one dy vector per pixel."""
    v = arch.vector_floats
    lanes = layer.in_shape[0]
    widest = max(1, max(p.q_hi - p.q_lo for p in phases))
    width = max(1, min(widest, (arch.vector_registers - lanes - 1) // lanes))
    tile = put_first([RegisterTile.evaluate(width, lanes, arch)], choice)[0]  # one candidate
    ocb = blocks(layer.out_shape[0], v)
    kh, kw = layer.kernel
    # Per input row: the kh/SH dy rows it reads, once from L2 (neighbouring pixels share them in L1).
    flops_row = 2 * layer.in_shape[2] * lanes * ocb * v * kh * kw / (layer.stride[0] * layer.stride[1])
    l2_bpf = (kh / layer.stride[0]) * layer.out_shape[2] * ocb * v * 4 / flops_row
    # The one narrower tile each phase ends with (its column count modulo the width): only those
    # are emitted.
    remainders = tuple(sorted({max(0, p.q_hi - p.q_lo) % width for p in phases} - {0}, reverse=True))
    return ConvBwdDataPlan(
        layer=layer.name, pass_name="bwd_data", kind="conv_bwd_data", template="conv_bwd_data_few.c.j2",
        isa=arch.isa, vector_floats=v,
        reason=explain.conv_bwd_data_few(tile, arch, lanes, layer.stride[1], len(phases)),
        tile=tile, tile_widths=(width, *remainders), remainders=remainders, predicted_efficiency=tile.efficiency,
        l1_working_set=ocb * lanes * kh * kw * v * 4, l2_bytes_per_flop=l2_bpf,
        ofm_chunk=ocb, rows=1, few_channels=True, phases=tuple(phases), images_inner=False)


def _valid_range(out_size: int, in_size: int, k: int, stride: int, pad: int) -> tuple[int, int]:
    """Outputs [lo, hi) whose tap `k` reads an input inside [0, in_size) (not padding)."""
    lo = 0
    while lo < out_size and lo * stride - pad + k < 0:
        lo += 1
    hi = out_size
    while hi > lo and (hi - 1) * stride - pad + k >= in_size:
        hi -= 1
    return lo, hi


@dataclass(frozen=True)
class ConvBwdWeightsBlock:
    rows: int                   # output rows per pixel block
    cols: int                   # output columns per pixel block (< OW: a wide row cut into column blocks)
    streams: bool               # the slice a tile reads (its dy vectors, input rows) streams from L2


def _conv_bwd_weights_block(layer: LayerSpec, tile: RegisterTile, lanes: int, arch: Arch, per_row: int,
                            per_row_tile: int, per_col: int) -> ConvBwdWeightsBlock:
    """Output pixels per block for backward-weights. The block's gradients and inputs stay in
    half of L2 while every tile reduces over them, and the slice one tile reads (its dy vectors,
    the input rows) in half of L1, where the next tiles (other taps and lanes of the same oc
    vectors) find it again; a single row too big for that is cut into column blocks (the tile
    then reads the input rows of all its kernel taps from L1 as well). Every tile loads its
    accumulators, runs a chain of FMAs per pixel of the block and stores them, so a block of
    fewer than STREAM_PIXELS pixels grows: a tile of at most STREAMED_VECTORS oc vectors over
    whole channel blocks to STREAM_PIXELS, its slice streaming from L2 (the block still within
    half of L2), other tiles as far as their slice stays within L1_BUDGET of L1. Not 1x1
    layers, whose next block is prefetched into L2 as well."""
    oh, ow = layer.out_shape[1:]
    half_l1 = arch.l1d_bytes // 2
    rows, cols = max(1, min(oh, (arch.l2_bytes // 2) // per_row, half_l1 // per_row_tile)), ow
    if per_row_tile > half_l1:
        # equal blocks within half of L1, none narrower than MIN_BLOCK_COLUMNS
        cols = -(-ow // max(1, ow // max(MIN_BLOCK_COLUMNS, min(ow, half_l1 // per_col))))
    budget = int(L1_BUDGET * arch.l1d_bytes)
    streams = tile.vectors <= STREAMED_VECTORS and lanes == arch.vector_floats
    grows = cols == ow and rows * ow < STREAM_PIXELS and layer.kernel != (1, 1)
    if grows:
        need = -(-STREAM_PIXELS // ow)
        if streams:  # blocks of at least `need` rows (12 rows as one block of 12, not 6 + 6)
            rows = max(rows, min(-(-oh // max(1, oh // need)), max(1, (arch.l2_bytes // 2) // per_row)))
        else:
            rows = max(rows, min(oh, need, budget // per_row_tile))
    rows = -(-oh // -(-oh // rows))  # equal blocks: 28 rows as 10 + 9 + 9, not 11 + 11 + 6
    return ConvBwdWeightsBlock(rows, cols, grows and streams and rows * per_row_tile > budget)


def plan_conv_bwd_weights(layer: LayerSpec, arch: Arch, choice: tuple[int, int] | None = None,
                          value_bytes: int = 4) -> ConvBwdWeightsPlan:
    v = arch.vector_floats
    ic, ih, iw = layer.in_shape
    oc, oh, ow = layer.out_shape
    icb, ocb = blocks(ic, v), blocks(oc, v)
    kh, kw = layer.kernel
    sh, sw = layer.stride
    ph, pw = layer.pad
    # Input-channel lanes that carry data: with fewer channels than a vector (a first layer on
    # RGB images) the tiles cover only the real lanes and the padded ones are written as zeros.
    lanes = ic if icb == 1 else v
    # Output vectors need not divide OCB: the last group gets a narrower tile, so 4 lanes x 3
    # vectors (12 chains) is open to power-of-two channel counts. Score = work-weighted
    # efficiency of the full and the remainder groups; among equals, fewer loads per FMA (each
    # oc vector is a dy stream OUT_CB apart): on VGG-A conv2-8 (AMD EPYC VM, one thread,
    # benchmarks/ab.py) 4x3 instead of 2x6 ran 1.02-1.09x on AVX2, and 8x3 / 4x5 instead of
    # 2x13 / 8x3 1.01-1.44x on AVX-512, against the bigger tile the old tie-break preferred.
    # With fewer input channels than a vector, a tile also spans several kernel columns
    # (width = lanes x taps): 3 lanes x 2 oc vectors alone are 6 accumulator chains, too few to
    # hide the FMA latency (MobileNet conv1 at 29% of peak, AVX-512).
    # At most WEIGHT_STREAMS dy streams, as in forward and backward-data: the AVX-512 zoo
    # tuning run found <= 4 oc vectors fastest on 23 of the 27 kernels the model gave 5 or 6.
    widths = divisors(lanes, arch.vector_registers)
    if lanes < v:
        widths += [lanes * t for t in range(2, kw + 1)]
    scored = []
    for t in candidates(widths, range(1, min(ocb, WEIGHT_STREAMS) + 1), arch):
        taps = t.width // lanes if t.width > lanes else 1
        tap_groups = [(taps, kw // taps)] + ([(kw % taps, 1)] if kw % taps else [])
        vector_groups = [(t.vectors, ocb // t.vectors)] + ([(ocb % t.vectors, 1)] if ocb % t.vectors else [])
        fmas = cycles = 0.0
        for (kt, tap_count), (nv, vector_count) in itertools.product(tap_groups, vector_groups):
            width = t.width // taps * kt
            work = width * nv * tap_count * vector_count
            fmas += work
            cycles += work / RegisterTile.evaluate(width, nv, arch).efficiency
        scored.append((fmas / cycles, -t.loads_per_fma, t.width * t.vectors, t, taps))
    scored.sort(key=lambda s: s[:3], reverse=True)
    scored = put_first(scored, choice, lambda s: s[3])
    eff, _, _, tile, taps = scored[0]
    rem_n = ocb % tile.vectors
    xv = input_pixel_floats(layer.index, layer.type, ic, v)
    if value_bytes == 4:
        per_row = (ocb * ow * v + icb * sh * iw * xv) * 4
        per_row_tile = (tile.vectors * ow * v + sh * iw * xv) * 4
    else:  # bf16 pair copies (conv_bwd_weights_bf16.c.j2): dy in pixel pairs, x rows of column pairs
        # stored in 2 SW phases, of which a tile reads one per kernel column
        pairs = -(-ow // 2)
        phase = -(-((2 * pairs - 2) * sw + kw) // (2 * sw)) * v * 2 * value_bytes
        dy_row = 2 * pairs * v * value_bytes
        per_row = ocb * dy_row + icb * sh * 2 * sw * phase
        per_row_tile = tile.vectors * dy_row + sh * min(taps, 2 * sw) * phase
    per_col = (tile.vectors * v + kh * sw * xv) * 4  # a column block's slice, counted as fp32
    block = _conv_bwd_weights_block(layer, tile, lanes, arch, per_row, per_row_tile, per_col)
    rows, cols = block.rows, block.cols
    # On a small plane a block of one whole image is a few pixels per accumulator load and store
    # (VGG-A at 64x64, conv7: 16 pixels, 8 bf16 pairs at 4x4); it spans several images instead
    # (geometry.band_images), all within half of L2.
    images = 1
    if (rows, cols) == (oh, ow):
        images = max(1, min(band_images(layer.out_shape), (arch.l2_bytes // 2) // (oh * per_row)))
    flops_px = 2 * tile.width * tile.vectors * v
    return ConvBwdWeightsPlan(
        # bf16 pairs neighbouring pixels, not channels: loops of their own
        layer=layer.name, pass_name="bwd_weights", kind="conv_bwd_weights" + _BF16_KIND[value_bytes],
        template="conv_bwd_weights_bf16.c.j2" if value_bytes == 2 else "conv_bwd_weights.c.j2",
        isa=arch.isa, vector_floats=v,
        reason=explain.conv_bwd_weights(tile, arch, eff, lanes, rem_n, taps, kw, oh, ow, per_row, per_row_tile, rows, cols,
                                        block.streams, images),
        tile=tile, tile_widths=tuple(sorted({tile.width, tile.width // taps * (kw % taps or taps)}, reverse=True)),
        predicted_efficiency=eff, l1_working_set=rows * per_row,
        l2_bytes_per_flop=(tile.vectors * v + tile.width) * 4 / flops_px, rejected=tuple(s[3] for s in scored[1:6]),
        block_rows=rows, block_cols=cols, lanes=lanes, rem_vectors=rem_n, kw_taps=taps, rem_taps=kw % taps,
        oh_range=tuple(_valid_range(oh, ih, k, sh, ph) for k in range(kh)),
        ow_range=tuple(_valid_range(ow, iw, k, sw, pw) for k in range(kw)),
        # A 1x1 kernel does one FMA per weight and pixel of a block: too little work to hide the
        # block's stream from L3 / memory (ResNet-18 layer2 projection, AVX2: 84% of peak at
        # minibatch 2, 46% at 16): the next block is prefetched. On 7x7 planes a block is a
        # whole image and the prefetch measured 0.96-0.98x (ab, AVX2): not there.
        prefetch_block=(kh, kw) == (1, 1) and oh * ow >= SMALL_PLANE, band_images=images)
