"""Plain numpy references (float64), written for clarity, not speed.

Convolutions loop over the kernel taps and do one matrix product (tensordot) per tap, so
that a VGG-A-sized check still runs in seconds.
"""
from __future__ import annotations

import numpy as np


def _pad(x, pad, value=0.0):
    n, c, h, w = x.shape
    ph, pw = pad
    xp = np.full((n, c, h + 2 * ph, w + 2 * pw), value)
    xp[:, :, ph:ph + h, pw:pw + w] = x
    return xp


def _out_size(h, w, kernel, stride, pad):
    return (h + 2 * pad[0] - kernel[0]) // stride[0] + 1, (w + 2 * pad[1] - kernel[1]) // stride[1] + 1


def _window(xp, i, j, stride, oh, ow):
    """The input values tap (i, j) reads for every output pixel: (N, C, OH, OW)."""
    return xp[:, :, i:i + stride[0] * (oh - 1) + 1:stride[0], j:j + stride[1] * (ow - 1) + 1:stride[1]]


def conv2d(x, w, b, stride, pad, relu=False):
    """x (N, C, H, W), w (OC, C, KH, KW), b (OC,) -> (N, OC, OH, OW)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n, _, h, wd = x.shape
    oc, _, kh, kw = w.shape
    oh, ow = _out_size(h, wd, (kh, kw), stride, pad)
    xp = _pad(x, pad)
    y = np.zeros((n, oh, ow, oc))
    for i in range(kh):
        for j in range(kw):
            y += np.tensordot(_window(xp, i, j, stride, oh, ow), w[:, :, i, j], axes=([1], [1]))
    y = y.transpose(0, 3, 1, 2) + np.asarray(b, np.float64)[None, :, None, None]
    return np.maximum(y, 0) if relu else y


def conv2d_bwd_data(dy, w, stride, pad, in_shape):
    """Gradient w.r.t. the input (N, C, H, W) of conv2d, given dy (N, OC, OH, OW)."""
    dy, w = np.asarray(dy, np.float64), np.asarray(w, np.float64)
    n, c, h, wd = in_shape
    _, _, kh, kw = w.shape
    oh, ow = dy.shape[2:]
    dxp = np.zeros((n, c, h + 2 * pad[0], wd + 2 * pad[1]))
    for i in range(kh):
        for j in range(kw):
            contrib = np.tensordot(dy, w[:, :, i, j], axes=([1], [0]))  # (N, OH, OW, C)
            _window(dxp, i, j, stride, oh, ow)[...] += contrib.transpose(0, 3, 1, 2)
    return dxp[:, :, pad[0]:pad[0] + h, pad[1]:pad[1] + wd]


def conv2d_bwd_weights(x, dy, kernel, stride, pad):
    """(dw (OC, C, KH, KW), db (OC,)) of conv2d."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    oh, ow = dy.shape[2:]
    xp = _pad(x, pad)
    dw = np.zeros((dy.shape[1], x.shape[1], *kernel))
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            dw[:, :, i, j] = np.tensordot(dy, _window(xp, i, j, stride, oh, ow), axes=([0, 2, 3], [0, 2, 3]))
    return dw, dy.sum(axis=(0, 2, 3))


def depthwise_dense(w):
    """A depthwise convolution's weights (C, 1, KH, KW) as an ordinary one's (C, C, KH, KW):
    channel c's window on the diagonal, zeros elsewhere (which add nothing, exactly)."""
    w = np.asarray(w, np.float64)
    dense = np.zeros((w.shape[0], w.shape[0], *w.shape[2:]))
    dense[np.arange(w.shape[0]), np.arange(w.shape[0])] = w[:, 0]
    return dense


def depthwise_diagonal(dw):
    """The depthwise part (C, 1, KH, KW) of an ordinary convolution's weight gradient."""
    return dw[np.arange(dw.shape[0]), np.arange(dw.shape[0])][:, None]


FC_ROWS = 256  # weight rows converted to float64 at a time: VGG-A's fc6 whole would take 820 MB


def fc(x, w, b, relu=False):
    """x (N, ...) flattened in C order, w (OC, IC), b (OC,)."""
    x = np.asarray(x, np.float64).reshape(x.shape[0], -1)
    y = np.empty((x.shape[0], w.shape[0]))
    for r in range(0, w.shape[0], FC_ROWS):
        y[:, r:r + FC_ROWS] = x @ np.asarray(w[r:r + FC_ROWS], np.float64).T
    y += b
    return np.maximum(y, 0) if relu else y


def fc_bwd_data(dy, w, in_shape):
    dy = np.asarray(dy, np.float64)
    dx = np.zeros((dy.shape[0], w.shape[1]))
    for r in range(0, w.shape[0], FC_ROWS):
        dx += dy[:, r:r + FC_ROWS] @ np.asarray(w[r:r + FC_ROWS], np.float64)
    return dx.reshape(in_shape)


def fc_bwd_weights(x, dy):
    x, dy = np.asarray(x, np.float64).reshape(x.shape[0], -1), np.asarray(dy, np.float64)
    return dy.T @ x, dy.sum(axis=0)


def maxpool(x, kernel, stride, pad):
    x = np.asarray(x, np.float64)
    oh, ow = _out_size(x.shape[2], x.shape[3], kernel, stride, pad)
    xp = _pad(x, pad, -np.inf)
    y = np.full((*x.shape[:2], oh, ow), -np.inf)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            y = np.maximum(y, _window(xp, i, j, stride, oh, ow))
    return y


def maxpool_bwd(x, dy, kernel, stride, pad):
    """Each output's gradient goes to the first maximum of its window (row-major order)."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    y = maxpool(x, kernel, stride, pad)
    oh, ow = y.shape[2:]
    xp = _pad(x, pad, -np.inf)
    dxp = np.zeros_like(xp)
    taken = np.zeros(y.shape, bool)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            hit = (_window(xp, i, j, stride, oh, ow) == y) & ~taken
            _window(dxp, i, j, stride, oh, ow)[...] += np.where(hit, dy, 0.0)
            taken |= hit
    return dxp[:, :, pad[0]:pad[0] + x.shape[2], pad[1]:pad[1] + x.shape[3]]


def avgpool(x, kernel, stride, pad):
    """Mean over the window, padding counted as zeros (divisor = kernel area)."""
    x = np.asarray(x, np.float64)
    oh, ow = _out_size(x.shape[2], x.shape[3], kernel, stride, pad)
    xp = _pad(x, pad)
    y = np.zeros((*x.shape[:2], oh, ow))
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            y += _window(xp, i, j, stride, oh, ow)
    return y / (kernel[0] * kernel[1])


def avgpool_bwd(dy, in_shape, kernel, stride, pad):
    dy = np.asarray(dy, np.float64)
    oh, ow = dy.shape[2:]
    n, c, h, w = in_shape
    dxp = np.zeros((n, c, h + 2 * pad[0], w + 2 * pad[1]))
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            _window(dxp, i, j, stride, oh, ow)[...] += dy / (kernel[0] * kernel[1])
    return dxp[:, :, pad[0]:pad[0] + h, pad[1]:pad[1] + w]


def softmax_cross_entropy(logits, labels):
    """(mean loss, gradient of the mean loss w.r.t. the logits)."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = z.shape[0]
    loss = -np.log(p[np.arange(n), labels]).mean()
    grad = p.copy()
    grad[np.arange(n), labels] -= 1
    return loss, grad / n


def net_forward(spec, net, x):
    """The whole chain in float64, reading weights from a loaded pcldnn_runtime Net
    (dropout as identity: evaluation mode). Returns the logits."""
    h = np.asarray(x, np.float64)
    for layer in spec.layers:
        L = net.layers[layer.name]
        if layer.type == "conv":
            h = conv2d(h, L.weights, L.bias, layer.stride, layer.pad, layer.activation == "relu")
        elif layer.type == "fc":
            h = fc(h, L.weights, L.bias, layer.activation == "relu")
        elif layer.type == "maxpool":
            h = maxpool(h, layer.kernel, layer.stride, layer.pad)
        elif layer.type == "avgpool":
            h = avgpool(h, layer.kernel, layer.stride, layer.pad)
        elif layer.type == "relu":
            h = np.maximum(h, 0)
    return h.reshape(h.shape[0], -1)


def net_gradients(spec, net, x, labels):
    """{weighted layer: (dw, db)} in float64 for the mean loss over (x, labels), back through
    the chain. Each layer's input and output come from `net`'s own forward pass (layer by
    layer, canonical API), so the ReLU masks and pooling maxima are the ones the kernels saw:
    float32 rounding cannot flip a mask between the two sides."""
    ins, outs, h = [], [], np.asarray(x, np.float32)
    layers = [layer for layer in spec.layers if layer.type != "softmax_cross_entropy"]
    for layer in layers:
        if layer.type == "dropout":
            raise NotImplementedError("dropout draws differ between the canonical and the chained passes")
        ins.append(h)
        h = net.layers[layer.name].forward(h)
        outs.append(h)
    _, dy = softmax_cross_entropy(h, labels)
    grads = {}
    for layer, xin, yout in reversed(list(zip(layers, ins, outs))):
        dy = np.asarray(dy, np.float64).reshape(yout.shape)
        if layer.activation:  # fused or standalone: the gradient passes where the output is positive
            assert layer.activation == "relu", "this reference has ReLU's mask only"
            dy = dy * (yout > 0)
        if layer.type == "conv":
            w = net.layers[layer.name].weights
            grads[layer.name] = conv2d_bwd_weights(xin, dy, layer.kernel, layer.stride, layer.pad)
            dy = conv2d_bwd_data(dy, w, layer.stride, layer.pad, xin.shape)
        elif layer.type == "fc":
            w = net.layers[layer.name].weights
            grads[layer.name] = fc_bwd_weights(xin, dy)
            dy = fc_bwd_data(dy, w, xin.shape)
        elif layer.type == "maxpool":
            dy = maxpool_bwd(xin, dy, layer.kernel, layer.stride, layer.pad)
        elif layer.type == "avgpool":
            dy = avgpool_bwd(dy, xin.shape, layer.kernel, layer.stride, layer.pad)
    return grads


# bf16: the rounding every bf16 copy and kernel must match
def bf16_reference(x: np.ndarray) -> np.ndarray:
    """bf16 bits of float32 x by comparing distances in float64 (not by the C code's bit trick):
    the nearer of the two bf16 values around x, the even one on a tie; inputs below the normal
    range give a signed zero and NaN a quiet NaN, as AVX512_BF16's vcvtneps2bf16 does."""
    with np.errstate(invalid="ignore"):  # NaN inputs: their result is set below
        return _bf16_reference(x)


def _bf16_reference(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32)
    sign = (bits >> 16) & 0x8000
    low = (bits >> 16).astype(np.uint32)  # truncated toward zero
    down = (low << 16).view(np.float32).astype(np.float64)
    up_bits = ((low + 1) << 16).astype(np.uint32)
    up = np.where((up_bits & 0x7FFFFFFF) == 0x7F800000, np.copysign(2.0 ** 128, x.astype(np.float64)),
                  up_bits.view(np.float32).astype(np.float64))  # past the largest bf16: 2^128, i.e. inf
    value = x.astype(np.float64)
    d_down, d_up = np.abs(value - down), np.abs(up - value)
    take_up = (d_up < d_down) | ((d_up == d_down) & (low % 2 == 1))
    out = np.where(take_up, low + 1, low).astype(np.uint32)
    exponent, mantissa = bits & 0x7F800000, bits & 0x7FFFFF
    out = np.where(exponent == 0, sign, out)
    out = np.where((exponent == 0x7F800000) & (mantissa == 0), bits >> 16, out)  # infinities stay
    out = np.where((exponent == 0x7F800000) & (mantissa != 0), (bits >> 16) | 0x40, out)
    return out.astype(np.uint16)


def as_float(bits: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bits."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
