"""Layer shapes the kernel tests share: the conformance harness's case lists
(test_conformance.py) and the family-specific tests of test_bf16_families.py."""
from __future__ import annotations

import dataclasses

from pcldnn_gen.arch import get_arch

CONV_CASES = [
    ({"channels": 20, "height": 9, "width": 11}, {"out_channels": 16, "kernel": 3, "stride": 1, "pad": 1, "activation": "relu"}),
    ({"channels": 16, "height": 10, "width": 7}, {"out_channels": 35, "kernel": 3, "stride": 2, "pad": 1}),
    ({"channels": 19, "height": 6, "width": 6}, {"out_channels": 24, "kernel": 5, "stride": 1, "pad": 2}),
    ({"channels": 48, "height": 7, "width": 7}, {"out_channels": 24, "kernel": 1, "stride": 1, "pad": 0}),
    # 13 input-channel blocks: backward-data's last ic group is narrower than its tiles
    ({"channels": 208, "height": 5, "width": 9}, {"out_channels": 16, "kernel": 3, "stride": 1, "pad": 1, "activation": "relu"}),
]


# Stride-1 convolutions of the AMX forward kernel: the bf16 cases above, several reduction
# chunks with an odd number of output blocks, and a layer whose band is one work item (its
# partial sums are stored before the next chunk reads them back).
AMX_CASES = [case for case in CONV_CASES if case[1]["stride"] == 1] + [
    ({"channels": 200, "height": 13, "width": 17}, {"out_channels": 40, "kernel": 3, "stride": 1, "pad": 0}),
    ({"channels": 100, "height": 4, "width": 4}, {"out_channels": 16, "kernel": 3, "stride": 1, "pad": 1}),
]


# strided forward passes on phase planes: odd padded sizes (plane rows and columns of unequal
# phases), a 1x1 stride-2 projection, 40 channels (2 blocks of 32), a 5x5 window at stride 4
# (windows of more taps pass the bound too, but their bound outgrows bf16's own error: the
# "differs from unrounded" check cannot tell there)
AMX_STRIDED_CASES = [
    CONV_CASES[1],
    ({"channels": 32, "height": 9, "width": 9}, {"out_channels": 16, "kernel": 1, "stride": 2, "pad": 0}),
    ({"channels": 40, "height": 23, "width": 25}, {"out_channels": 20, "kernel": 3, "stride": 2, "pad": 1,
                                                    "activation": "relu"}),
    ({"channels": 16, "height": 19, "width": 21}, {"out_channels": 16, "kernel": 5, "stride": 4, "pad": 2}),
    ({"channels": 24, "height": 12, "width": 13}, {"out_channels": 16, "kernel": 3, "stride": 3, "pad": 1}),
]


# backward-data per phase of dx (geometry.AmxResultPhase): the strided layers above, a stride-1
# layer padded by its window side (dy read from an offset), several reduction chunks over 200
# channels of dy, a 2x2 window at stride 3 (a phase no tap reaches: zero) over a 17-channel
# tail, and unequal strides and windows along rows and columns
AMX_PHASED_CASES = AMX_STRIDED_CASES + [
    ({"channels": 20, "height": 8, "width": 9}, {"out_channels": 24, "kernel": 3, "stride": 1, "pad": 3}),
    ({"channels": 16, "height": 11, "width": 10}, {"out_channels": 200, "kernel": 3, "stride": 2, "pad": 1,
                                                    "activation": "relu"}),
    ({"channels": 17, "height": 10, "width": 11}, {"out_channels": 16, "kernel": 2, "stride": 3, "pad": 1}),
    ({"channels": 16, "height": 9, "width": 12}, {"out_channels": 32, "kernel": [3, 5], "stride": [2, 1],
                                                   "pad": [1, 2]}),
]

FC_CASES = [((20, 3, 3), 40, "relu"), ((16, 3, 3), 24, None), ((16, 2, 2), 70, "relu")]


# An L2 of 64 KiB: the AMX backward-weights kernel then reduces a few pixel blocks per residency of
# its accumulators and reloads them between groups (the path large layers take); the fc tile
# kernels take several reduction and output-block chunks.
AMX_ARCH = dataclasses.replace(get_arch("avx512"), name="avx512-amx", amx=True, l2_bytes=64 * 1024)
SMALL_L2_AVX512 = dataclasses.replace(AMX_ARCH, name="avx512-small-l2", amx=False)


# The packed few-channel first layer (an RGB image): VGG's 3x3, AlexNet's 11x11 stride 4 (363
# window values; a kernel row's 33: two forward steps), a 7x7 stride-2 window over 5 channels
# with a ReLU (7 output rows of one 16-pixel piece: the image's last unit has one piece)
PACKED_CASES = [
    ({"channels": 3, "height": 10, "width": 9}, {"out_channels": 40, "kernel": 3, "stride": 1, "pad": 1}),
    ({"channels": 3, "height": 27, "width": 31}, {"out_channels": 16, "kernel": 11, "stride": 4, "pad": 2}),
    ({"channels": 5, "height": 13, "width": 12}, {"out_channels": 24, "kernel": 7, "stride": 2, "pad": 3,
                                                   "activation": "relu"}),
]
# On AMX, and whether its forward reads kernel rows in place (the 7x7 window over 5 channels: B
# tiles per kernel row, 28 KiB, would not stay in AMX_ARCH's 32 KiB L1, so im2col rows): one
# channel (a kernel row 5 of its 32 values), rows of 37 pixels (three pieces, the last of 5), 27
# pieces an image; 100 output channels of a 5x5 window (35 KiB of B tiles: im2col rows)
PACKED_AMX_FORWARD_CASES = [(*case, in_place) for case, in_place in zip(PACKED_CASES, (True, True, False))] + [
    ({"channels": 1, "height": 9, "width": 37}, {"out_channels": 20, "kernel": 5, "stride": 1, "pad": 2}, True),
    ({"channels": 3, "height": 11, "width": 13}, {"out_channels": 100, "kernel": 5, "stride": 2, "pad": 2}, False),
]
# its backward-weights (windows of 64 values or more: families.AMX_PACKED_GRADIENT_WINDOW)
PACKED_AMX_GRADIENT_CASES = PACKED_CASES[1:] + [
    ({"channels": 3, "height": 10, "width": 9}, {"out_channels": 40, "kernel": 5, "stride": 1, "pad": 2})]
# its backward-data: PACKED_CASES (AlexNet's 33-value kernel-row run: three 16-value blocks, two
# pieces a unit), one channel over 37-wide rows (one block, three pieces in one unit), 100
# output channels (four 32-channel steps, the last partial) with a ReLU, a 2x2 window at stride 3
# (dx rows and columns no window reaches: zero), a 9x9 window over 9 channels (81-value runs: six
# blocks, in two groups of C tiles)
PACKED_AMX_DATA_CASES = PACKED_CASES + [
    ({"channels": 1, "height": 9, "width": 37}, {"out_channels": 20, "kernel": 5, "stride": 1, "pad": 2}),
    ({"channels": 3, "height": 11, "width": 13}, {"out_channels": 100, "kernel": 5, "stride": 2, "pad": 2,
                                                   "activation": "relu"}),
    ({"channels": 2, "height": 10, "width": 11}, {"out_channels": 16, "kernel": 2, "stride": 3, "pad": 0}),
    ({"channels": 9, "height": 12, "width": 10}, {"out_channels": 24, "kernel": 9, "stride": 1, "pad": 4}),
]
# On vdpbf16ps: one channel under a 5-wide window (an odd run of 5 values: its last pair half
# past the window), two under a 3-wide one at stride 2 without padding (an even run; rows of 14
# pixels: full register tiles and a narrower last one)
PACKED_BF16_CASES = PACKED_CASES + [
    ({"channels": 1, "height": 9, "width": 37}, {"out_channels": 20, "kernel": 5, "stride": 1, "pad": 2}),
    ({"channels": 2, "height": 11, "width": 30}, {"out_channels": 16, "kernel": 3, "stride": 2, "pad": 0,
                                                  "activation": "relu"}),
]
# and its backward-weights (windows of families.BF16_PACKED_GRADIENT_WINDOW values or more):
# AlexNet's 11x11 stride 4 (363 values, 33 a kernel row), 7x7 stride 2 over 5 channels with a
# ReLU, a 7x7 window over 3 channels on rows of 13 pixels (an odd row: its last pair half
# missing) with a ReLU, an 11x11 window over one channel at stride 2 (121 values, 11 a row)
PACKED_BF16_GRADIENT_CASES = PACKED_CASES[1:] + [
    ({"channels": 3, "height": 10, "width": 13}, {"out_channels": 40, "kernel": 7, "stride": 1, "pad": 3,
                                                   "activation": "relu"}),
    ({"channels": 1, "height": 25, "width": 24}, {"out_channels": 16, "kernel": 11, "stride": 2, "pad": 1}),
]
# An L2 of 16 KiB: the packed vdpbf16ps backward-weights kernel then pairs bands of a few output
# rows (the last one shorter), the accumulators loaded and stored between them.
SMALL_L2 = dataclasses.replace(get_arch("avx512"), name="avx512-small-l2", l2_bytes=16 * 1024)

# The vdpbf16ps backward-weights kernel (pixel pairs in bands, rings of x and dy pair rows):
# with small caches (4 KiB L1, 64 KiB L2) bands of a few output rows, so each image is several
# bands and the rings wrap within images and across them; and where an image is fewer than
# geometry.BAND_MIN_PIXELS output pixels, bands of several whole images (4x4: 8; 5x5: 6; 4x3 at
# stride 2: 11) with more images (the last element) than two bands hold
SMALL_CACHES = dataclasses.replace(get_arch("avx512"), name="avx512-small-caches", l1d_bytes=4 << 10, l2_bytes=64 << 10)
BF16_ROW_BAND_CASES = [
    ({"channels": 32, "height": 13, "width": 40}, {"out_channels": 40, "kernel": 3, "stride": 1, "pad": 1,
                                                    "activation": "relu"}),
    ({"channels": 24, "height": 23, "width": 33}, {"out_channels": 32, "kernel": 3, "stride": 2, "pad": 0}),
    ({"channels": 16, "height": 21, "width": 36}, {"out_channels": 16, "kernel": 5, "stride": 1, "pad": 2}),
]
BF16_IMAGE_BAND_CASES = [
    ({"channels": 32, "height": 4, "width": 4}, {"out_channels": 40, "kernel": 3, "stride": 1, "pad": 1,
                                                  "activation": "relu"}, 19),
    ({"channels": 20, "height": 5, "width": 5}, {"out_channels": 16, "kernel": 3, "stride": 1, "pad": 1}, 13),
    ({"channels": 16, "height": 9, "width": 7}, {"out_channels": 24, "kernel": 3, "stride": 2, "pad": 0}, 25),
]

# Depthwise convolutions (groups = channels): a 3x3 ReLU layer (one block and a partial one),
# MobileNet's 3x3 stride 2, a 5x5 window wider than its 4-column input (every output pixel on the
# border), unequal windows, strides and padding, a padding beyond the window (rows of padding
# only), and rows of 37 output pixels (register tiles and a narrower last one)
DEPTHWISE_CASES = [
    ({"channels": 20, "height": 9, "width": 11}, {"kernel": 3, "stride": 1, "pad": 1, "activation": "relu"}),
    ({"channels": 32, "height": 10, "width": 7}, {"kernel": 3, "stride": 2, "pad": 1}),
    ({"channels": 16, "height": 6, "width": 4}, {"kernel": 5, "stride": 1, "pad": 2, "activation": "relu"}),
    ({"channels": 7, "height": 8, "width": 13}, {"kernel": [5, 3], "stride": [1, 2], "pad": [2, 0]}),
    ({"channels": 3, "height": 5, "width": 6}, {"kernel": 2, "stride": 3, "pad": 3}),
    ({"channels": 24, "height": 3, "width": 37}, {"kernel": 3, "stride": 1, "pad": 1}),
]
