"""Layer shapes the kernel tests share: the conformance harness's case lists
(test_conformance.py) and the family-specific tests of test_bf16.py."""
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
