"""Kernel geometry shared by generator and runtime: the packed first layer's input layout, the
AMX tile families' work units and buffer sizes (AmxConvGeometry, the packed layer's weight and
gradient copies), the fc tile families' (FcTileGeometry), and the vdpbf16ps families' bands
and weight rings. The planner plans with these figures and the runtime allocates by them, so a
kernel and its caller agree on every size (limits.py holds the ranges and the memory bound)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .limits import blocks


def input_pixel_floats(index: int, layer_type: str, channels: int, v: int, groups: int = 1) -> int:
    """Floats per pixel of a layer's blocked input: V, one lane per channel of a block, except
    for the net's first layer when it is a convolution of fewer channels than a vector (RGB
    images): its input is packed, (N, H, W, C), `channels` floats per pixel. Padded to V lanes, a
    3-channel image took 5.3x its size and the first layer's kernels were bound by moving
    padding (MobileNet conv1 backward-weights at minibatch 16, AVX-512: 37% of peak; AlexNet-like
    conv1 forward 34%). Only the net's input is packed: no kernel writes that layout but the
    first layer's backward-data. (A depthwise convolution reads its input blocked: its channels
    are its lanes.)"""
    return channels if index == 0 and layer_type == "conv" and groups == 1 and channels < v else v


AMX_ROWS = 16        # tile rows: output pixels per A and C tile
AMX_PAIRS = 16       # tile rows of B: input-channel pairs (a 64-byte row is 32 bf16 channels)
AMX_PIXEL_BLOCK = 2 * AMX_ROWS  # output pixels per work item: two A tiles share each B tile


@dataclass(frozen=True)
class AmxResultPhase:
    """One phase (a, b) of a backward-data pass computed per phase of dx (AmxConvGeometry.phases):
    dx pixels (SH i + a, SW j + b), i < rows, j < cols. Along rows, dx[SH i + a] sums
    dy[i + c - t] w[r + SH t] over taps t < taps_h, with r = (a + PH) % SH and c = (a + PH) // SH:
    a stride-1 convolution of dy with every SH-th row of the flipped window, reading padded dy
    rows i + row_offset + t' (t' = taps_h - 1 - t); the same along columns. A phase without
    taps (the window skips it: a 1x1 stride-2 layer's odd pixels) has zero gradient."""
    a: int
    b: int
    first_tap_h: int   # r: the window row of the phase's last step (t' = taps_h - 1)
    first_tap_w: int
    taps_h: int
    taps_w: int
    rows: int          # dx rows of the phase: ceil((IH - a) / SH)
    cols: int
    row_offset: int    # padded dy row of result row 0 at t' = 0
    col_offset: int
    pixel_blocks: int  # 32-pixel blocks of its rows x WP flat results (0 without taps)
    first_unit: int    # its first (pixel block) unit among an image's


def _axis_phases(size: int, kernel: int, pad: int, stride: int) -> list[tuple[int, int, int, int]]:
    """(first tap r, taps, result rows, c) of each phase a < stride along one axis (AmxResultPhase)."""
    out = []
    for a in range(stride):
        r, c = (a + pad) % stride, (a + pad) // stride
        out.append((r, max(0, -(-(kernel - r) // stride)), max(0, -(-(size - a) // stride)), c))
    return out


@dataclass(frozen=True)
class AmxConvGeometry:
    """The buffers of an AMX conv kernel (templates/conv_amx.c.j2), one rule for the template and
    the runtime's scratch. The kernel computes a convolution of `source` into `result` with
    padding `pad` and `stride`: the layer's forward pass, or its backward-data pass (dy into dx,
    stride 1, the window flipped and the weights transposed, padding KH - 1 - PH). Its source is
    copied to bf16 with the padding written out, 32 channels per 64-byte pixel, split into
    SH x SW phase planes (padded row hp, column wp in plane (hp % SH, wp % SW) at (hp / SH,
    wp / SW); stride 1: one plane, the padded source itself), each HQ x WQ. Result pixel
    (oh, ow) at tap (kh, kw) then reads plane (kh % SH, kw % SW) at flat pixel
    q + (kh / SH)*WQ + kw / SW with q = oh*WQ + ow: 16 consecutive flat results are one tile of
    16 rows 64 bytes apart, across row ends (flat columns past the row are computed and dropped)."""
    source: tuple[int, int, int]   # (C, H, W) read: the layer's input, or its output gradient
    result: tuple[int, int, int]   # (C, H, W) written: the layer's output, or its input gradient
    pad: tuple[int, int]
    icb: int             # 32-channel blocks of the source (a tile row's 16 channel pairs)
    hp: int              # padded source rows
    wp: int              # padded source columns
    pixel_blocks: int    # AMX_PIXEL_BLOCK-pixel blocks covering the result's rows of WQ flat pixels
    plane: int           # pixels of one (image, icb) copy: its phase planes, each all its taps may read
    weight_values: int   # bf16 values of the B tiles (result C/16, source C/32, KH, KW, 16 pairs, 16, 2)
    gradient_pairs: int  # backward-weights: pixel pairs of an x pair copy of a phase plane (all a tap reads)
    stride: tuple[int, int] = (1, 1)
    hq: int = 0          # rows of a phase plane: ceil(HP / SH)
    wq: int = 0          # columns of a phase plane: the flat row length of the results
    phase_plane: int = 0  # pixels of one phase plane, with the zero tail its taps may read
    # backward-data of a strided convolution, or one padded by the window side or more: dx per
    # phase (AmxResultPhase, those with taps and pixels), over one stride-1 padded copy of dy
    phases: tuple[AmxResultPhase, ...] = ()
    result_stride: tuple[int, int] = (1, 1)
    empty_phases: tuple[tuple[int, int], ...] = ()  # (a, b) of phases with pixels and no taps: dx zero

    @property
    def banded(self) -> bool:
        """Stride 1, one phase: the kernel copies each band's source rows into a buffer of its
        own thread's (templates/conv_amx.c.j2), not the whole padded source into the scratch."""
        return self.stride == (1, 1) and not self.phases

    def band_rows(self, band: int, kernel: tuple[int, int]) -> int:
        """Padded source rows a banded kernel's band of `band` pixel blocks reads: from the row of
        its first result (anywhere in that row) to the row of its last tap's pixel; at most the
        plane's (rows past HP are zero)."""
        span = band * AMX_PIXEL_BLOCK - 1 + (kernel[0] - 1) * self.wp + kernel[1] - 1 + self.wp
        return min(-(-span // self.wp), -(-self.plane // self.wp))

    def phases_read(self, kernel: tuple[int, int]) -> frozenset[tuple[int, int]]:
        """The phase planes (a, b) some tap reads: tap (kh, kw) reads plane (kh % SH, kw % SW)
        (a 1x1 window at stride 2 reads one of four)."""
        sh, sw = self.stride
        return frozenset((kh % sh, kw % sw) for kh in range(kernel[0]) for kw in range(kernel[1]))

    def odd_gradient_pairs(self, kernel: tuple[int, int]) -> bool:
        """Backward-weights: whether some tap's pixel pairs start on an odd flat pixel of its
        phase plane (flat offset (kh / SH) WQ + kw / SW odd), so the x copy from odd pixels is
        made; a 1x1 window, or every offset even, reads the even copy only."""
        sh, sw = self.stride
        return any((kh // sh * self.wq + kw // sw) % 2 for kh in range(kernel[0]) for kw in range(kernel[1]))

    def scratch_values(self, batch: int) -> int:
        """bf16 values of the kernel's scratch: the padded source copy, where the kernel is not
        banded (its weight tiles, `weight_values`, are the layer's own buffer)."""
        return 0 if self.banded else batch * self.icb * self.plane * 32

    def gradient_scratch_values(self, batch: int, taps: int) -> int:
        """bf16 values of the backward-weights kernel's scratch (templates/conv_bwd_weights_amx.c.j2,
        on the forward pass's geometry): dy channel-major over the flat rows, x in pixel pairs of
        each phase plane from even and from odd pixels, then fp32 accumulators of every (oc, ic)
        block and tap, and the images' partial bias sums."""
        icb, ocb = blocks(self.source[0], 16), blocks(self.result[0], 16)
        dy = ocb * 16 * self.pixel_blocks * AMX_PIXEL_BLOCK
        x = 2 * icb * self.stride[0] * self.stride[1] * self.gradient_pairs * 32
        return batch * (dy + x) + 2 * (ocb * icb * taps * 256 + batch * ocb * 16)


@functools.lru_cache(maxsize=512)  # a pure function of shapes: the runtime sizes scratch by it per call
def amx_conv_geometry(pass_name: str, in_shape: tuple[int, int, int], out_shape: tuple[int, int, int],
                      kernel: tuple[int, int], pad: tuple[int, int],
                      stride: tuple[int, int] = (1, 1)) -> AmxConvGeometry:
    """The geometry of a conv layer's `pass_name` AMX kernel (backward-weights: the forward's;
    backward-data: the flipped window over dy, per phase of dx where strided or padded by the
    window side or more)."""
    if pass_name == "bwd_data" and (stride != (1, 1) or pad[0] >= kernel[0] or pad[1] >= kernel[1]):
        return _phased_geometry(in_shape, out_shape, kernel, pad, stride)
    if pass_name != "bwd_data":
        source, result = in_shape, out_shape
    else:
        source, result, pad = out_shape, in_shape, (kernel[0] - 1 - pad[0], kernel[1] - 1 - pad[1])
    c, h, w = source
    sh, sw = stride
    hp, wp = h + 2 * pad[0], w + 2 * pad[1]
    hq, wq = -(-hp // sh), -(-wp // sw)
    pixel_blocks = -(-result[1] * wq // AMX_PIXEL_BLOCK)
    reach = pixel_blocks * AMX_PIXEL_BLOCK + (kernel[0] - 1) // sh * wq + (kernel[1] - 1) // sw
    phase_plane = max(hq * wq, reach)
    icb = blocks(c, 2 * AMX_PAIRS)
    weight_values = blocks(result[0], 16) * icb * kernel[0] * kernel[1] * AMX_PAIRS * 16 * 2
    gradient_pairs = pixel_blocks * AMX_PIXEL_BLOCK // 2 + ((kernel[0] - 1) // sh * wq + (kernel[1] - 1) // sw) // 2 + 1
    return AmxConvGeometry(source, result, pad, icb, hp, wp, pixel_blocks, sh * sw * phase_plane, weight_values,
                           gradient_pairs, stride, hq, wq, phase_plane)


def _phased_geometry(in_shape: tuple[int, int, int], out_shape: tuple[int, int, int], kernel: tuple[int, int],
                     pad: tuple[int, int], stride: tuple[int, int]) -> AmxConvGeometry:
    """Backward-data per phase of dx (AmxResultPhase): dy copied once, padded by PT rows and PL
    columns (the most any phase reads before dy's first pixel) and as far past its end as the
    phases read; every phase's flat result rows are WP long."""
    rows = _axis_phases(in_shape[1], kernel[0], pad[0], stride[0])
    cols = _axis_phases(in_shape[2], kernel[1], pad[1], stride[1])
    pt = max([t - 1 - c for _, t, n, c in rows if t and n] + [0])
    pl = max([t - 1 - c for _, t, n, c in cols if t and n] + [0])
    hp = max([pt + out_shape[1]] + [n + c - t + 1 + pt + t - 1 for _, t, n, c in rows if t and n])
    wp = max([pl + out_shape[2]] + [n + c - t + 1 + pl + t - 1 for _, t, n, c in cols if t and n])
    phases, units, reach, empty = [], 0, hp * wp, []
    for a, (rh, th, nh, ch) in enumerate(rows):
        for b, (rw, tw, nw, cw) in enumerate(cols):
            if not (th and tw and nh and nw):
                if nh and nw:
                    empty.append((a, b))
                continue
            blocks_ = -(-nh * wp // AMX_PIXEL_BLOCK)
            phase = AmxResultPhase(a, b, rh, rw, th, tw, nh, nw, ch - th + 1 + pt, cw - tw + 1 + pl, blocks_, units)
            phases.append(phase)
            units += blocks_
            reach = max(reach, blocks_ * AMX_PIXEL_BLOCK + (phase.row_offset + th - 1) * wp + phase.col_offset + tw - 1)
    icb = blocks(out_shape[0], 2 * AMX_PAIRS)
    weight_values = blocks(in_shape[0], 16) * icb * kernel[0] * kernel[1] * AMX_PAIRS * 16 * 2
    return AmxConvGeometry(out_shape, in_shape, (pt, pl), icb, hp, wp, units, reach, weight_values, 0, (1, 1), hp, wp,
                           reach, tuple(phases), stride, tuple(empty))


def amx_packed_reduction(in_shape: tuple[int, int, int], kernel: tuple[int, int]) -> int:
    """The reduction of the packed few-channel first layer's AMX backward-weights pass: one
    im2col row of KH x KW x C values per output pixel, rounded up to a tile row of 32
    (templates/conv_packed_amx.c.j2)."""
    return -(-kernel[0] * kernel[1] * in_shape[0] // 32) * 32


def amx_packed_row_steps(in_shape: tuple[int, int, int], kernel: tuple[int, int]) -> int:
    """Tile steps a kernel row takes in the packed first layer's AMX forward pass: its KW x C
    window values are contiguous in the image, read in place 32 at a time
    (templates/conv_packed_amx.c.j2)."""
    return -(-kernel[1] * in_shape[0] // 32)


def amx_packed_weight_values(in_shape: tuple[int, int, int], out_channels: int, kernel: tuple[int, int]) -> int:
    """bf16 values of that forward pass's weights as B tiles of 512: OC/16 x KH x row steps where
    it reads kernel rows in place, OC/16 x KP/32 over im2col rows (the planner's choice: room
    for either)."""
    steps = max(kernel[0] * amx_packed_row_steps(in_shape, kernel), amx_packed_reduction(in_shape, kernel) // 32)
    return blocks(out_channels, 16) * steps * 512


def packed_bf16_weight_values(channels: int, out_channels: int, kernel: tuple[int, int], v: int) -> int:
    """bf16 values of the packed first layer's vdpbf16ps forward weights (templates/
    conv_fwd_packed_bf16.c.j2): per output block and kernel row, ceil(KW x C / 2) pairs of the
    row's window values x V output channels."""
    return blocks(out_channels, v) * kernel[0] * -(-kernel[1] * channels // 2) * v * 2


def amx_packed_data_weight_values(out_channels: int, kernel: tuple[int, int], channels: int) -> int:
    """bf16 values of the packed first layer's AMX backward-data weights as B tiles of 512: per
    kernel row, 16-value block of its KW x C run and 32-channel step of dy
    (templates/conv_bwd_data_packed_amx.c.j2)."""
    return kernel[0] * -(-kernel[1] * channels // 16) * -(-out_channels // 32) * 512


def amx_packed_gradient_values(in_shape: tuple[int, int, int], out_shape: tuple[int, int, int],
                               kernel: tuple[int, int], batch: int) -> int:
    """bf16 values of the packed first layer's AMX backward-weights scratch: fp32 accumulators
    (OC/16 x KP/16 tiles of 256) and the units' partial bias sums (images x 32-pixel blocks x
    OC/16 x 16); the kernel's group copies are its own (their size is the planner's choice)."""
    ocb, kb = blocks(out_shape[0], 16), amx_packed_reduction(in_shape, kernel) // 16
    units = batch * -(-out_shape[1] * out_shape[2] // 32)
    return 2 * (ocb * kb * 256 + units * ocb * 16)


@dataclass(frozen=True)
class FcTileGeometry:
    """The bf16 operands of an fc layer's AMX kernels (templates/fc_amx.c.j2,
    fc_bwd_weights_amx.c.j2), one rule for the templates and the runtime's buffers. The layer's
    weights W (F features x K inputs, blocked (OCB, K, 16) in fp32) have two bf16 copies of B
    tiles, made from the fp32 master weights after each change (templates/_amx.c.j2,
    fc_weight_tiles): forward tiles (OCB, KP/32, 16 input pairs, 16 features, 2) and
    backward-data tiles (K/16, FP/32, 16 feature pairs, 16 inputs, 2), zero past K and F."""
    k: int          # inputs per image: the previous layer's blocked activation (a multiple of 16)
    features: int   # output features padded to 16-lane blocks: OCB x 16
    kp: int         # K rounded up to a tile row of 32 inputs
    fp: int         # features rounded up to 32

    @property
    def forward_tile_values(self) -> int:
        return self.features * self.kp

    @property
    def data_tile_values(self) -> int:
        return self.k * self.fp

    def scratch_values(self, pass_name: str, batch: int) -> int:
        """bf16 values of a pass's scratch: forward, the input rows (32-image rows of KP);
        backward-data, the masked dy rows (of FP); backward-weights, x transposed (K rows of the
        minibatch rounded up to 32) then dy in image pairs (OCB blocks of 16 features)."""
        rows = -(-batch // 32) * 32
        return rows * {"fwd": self.kp, "bwd_data": self.fp, "bwd_weights": self.k + self.features}[pass_name]


@functools.lru_cache(maxsize=512)  # the same
def fc_tile_geometry(in_shape: tuple[int, int, int], features: int, v: int = 16) -> FcTileGeometry:
    c, h, w = in_shape
    k, f = blocks(c, v) * v * h * w, blocks(features, v) * v
    return FcTileGeometry(k, f, -(-k // 32) * 32, -(-f // 32) * 32)


# A conv backward-weights tile loads and stores its accumulators once a pixel block (a bf16
# kernel's band). Where one image is fewer than BAND_MIN_PIXELS output pixels (a 4x4 plane: 8
# pixel pairs for bf16, 16 pixels for fp32) a block spans several whole images (band_images),
# as many as make up BAND_PIXELS pixels. Measured (emulated Zen 4, Ice Lake VM, benchmarks/ab.py):
# bf16 on 4x4 planes 1.7-2.3x; on 7x7 and 8x8 planes 0.71-1.67x, so not there.
BAND_MIN_PIXELS = 32
BAND_PIXELS = 128


def band_images(out_shape: tuple[int, int, int]) -> int:
    """The most whole images a pixel block of a conv backward-weights kernel may span (its plan
    takes fewer where they would not fit half of L2)."""
    pixels = out_shape[1] * out_shape[2]
    return 1 if pixels >= BAND_MIN_PIXELS else -(-BAND_PIXELS // pixels)


def bf16_weight_ring_rows(block_rows: int, stride: tuple[int, int], kernel: tuple[int, int], images: int = 1,
                          in_rows: int = 0) -> tuple[int, int]:
    """(input, output) rows per channel block of the rings a bf16 conv backward-weights kernel
    pairs x and dy into (templates/conv_bwd_weights_bf16.c.j2, XRING_ROWS and DRING_ROWS): two
    bands of block_rows output rows, counted across images, before the minibatch's own rows cap
    them; with bands of `images` > 1 whole images (block_rows the image's rows), two bands'
    images of in_rows input rows each."""
    if images > 1:
        return 2 * images * in_rows, 2 * images * block_rows
    return (2 * block_rows - 1) * stride[0] + 2 * kernel[0], 2 * block_rows


def bf16_weight_scratch(in_shape: tuple[int, int, int], out_shape: tuple[int, int, int], kernel: tuple[int, int],
                        stride: tuple[int, int], v: int, batch: int) -> int:
    """bf16 values of scratch a bf16 conv backward-weights kernel needs: its rings (x in pairs,
    rows of (2 ceil(OW/2) - 2) SW + KW columns stored in 2 SW phases of equal length, from a
    cache line; dy in pairs, rows of ceil(OW/2)), each at most the minibatch's rows, then each
    dy row's fp32 sum (V floats: 2V values) for the bias gradient. The runtime reads no plan, so
    the rings are sized for bands of the most whole images any plan's kernel takes."""
    c, ih, _ = in_shape
    oc, oh, ow = out_shape
    images = band_images(out_shape)
    x_ring, dy_ring = bf16_weight_ring_rows(oh, stride, kernel, images, ih)
    if images > 1:  # or one image's bands of fewer rows, if a plan's bands are those
        x_ring, dy_ring = max(x_ring, bf16_weight_ring_rows(oh, stride, kernel)[0]), max(dy_ring, 2 * oh)
    pairs, phases = -(-ow // 2), 2 * stride[1]
    columns = -(-((2 * pairs - 2) * stride[1] + kernel[1]) // phases) * phases
    x_pairs = blocks(c, v) * min(x_ring, batch * ih) * columns * v * 2
    return (-(-x_pairs // 32) * 32 + blocks(oc, v) * min(dy_ring, batch * oh) * pairs * v * 2
            + batch * blocks(oc, v) * oh * v * 2)
