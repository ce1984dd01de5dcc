"""Plain numpy references (float64), written for clarity, not speed."""
from __future__ import annotations

import numpy as np


def conv2d(x, w, b, stride, pad, relu=False):
    """x (N, C, H, W), w (OC, C, KH, KW), b (OC,) -> (N, OC, OH, OW)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    n, c, h, wd = x.shape
    oc, _, kh, kw = w.shape
    (sh, sw), (ph, pw) = stride, pad
    xp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw))
    xp[:, :, ph:ph + h, pw:pw + wd] = x
    oh = (h + 2 * ph - kh) // sh + 1
    ow = (wd + 2 * pw - kw) // sw + 1
    y = np.zeros((n, oc, oh, ow))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]  # (N, C, OH, OW)
            y += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    y += np.asarray(b, np.float64)[None, :, None, None]
    return np.maximum(y, 0) if relu else y


def fc(x, w, b, relu=False):
    """x (N, ...) flattened in C order, w (OC, IC), b (OC,)."""
    y = np.asarray(x, np.float64).reshape(x.shape[0], -1) @ np.asarray(w, np.float64).T + b
    return np.maximum(y, 0) if relu else y


def maxpool(x, kernel, stride, pad):
    x = np.asarray(x, np.float64)
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad
    xp = np.full((n, c, h + 2 * ph, w + 2 * pw), -np.inf)
    xp[:, :, ph:ph + h, pw:pw + w] = x
    oh = (h + 2 * ph - kh) // sh + 1
    ow = (w + 2 * pw - kw) // sw + 1
    y = np.full((n, c, oh, ow), -np.inf)
    for i in range(kh):
        for j in range(kw):
            y = np.maximum(y, xp[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw])
    return y
