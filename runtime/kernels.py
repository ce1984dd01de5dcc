"""The C ABI of generated kernels, and loading them from shared libraries with cffi.

`SIGNATURES` is the one definition of every kernel kind's parameter list: the generator
renders prototypes from it and the runtime declares the same text to cffi (ABI mode, so a
node needs no compiler), so the two cannot drift apart.
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Callable

import cffi
import numpy as np

from .errors import BuildDirError

# Parameter lists, by kernel kind. Activations are blocked (N, C/V, H, W, V); weights are
# blocked (OC/V, IC/V, KH, KW, V_ic, V_oc); `batch` is the minibatch, `nthreads` the
# OpenMP thread count of this call.
SIGNATURES: dict[str, str] = {
    "conv_fwd": "const float *in, const float *wt, const float *bias, float *out, int batch, int nthreads",
    "fc_fwd": "const float *in, const float *wt, const float *bias, float *out, int batch, int nthreads",
    "maxpool_fwd": "const float *in, float *out, int batch, int nthreads",
    "act_layout": "const float *src, float *dst, int batch, int nthreads",
    "weight_layout": "const float *src, float *dst",
}

_lock = threading.Lock()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_library(path: Path, sha256: str, symbols: dict[str, str]) -> dict[str, Callable]:
    """dlopen `path` after checking its digest; return {symbol: callable} for `symbols`
    ({symbol: kernel kind}). A truncated or replaced library is refused, not executed."""
    if not path.is_file():
        raise BuildDirError(f"{path}: kernel library missing; run `pcldnn-gen compile` again")
    if file_sha256(path) != sha256:
        raise BuildDirError(
            f"{path}: kernel library is corrupt (sha256 differs from manifest.json); "
            "run `pcldnn-gen compile` again"
        )
    ffi = cffi.FFI()
    decls = "".join(f"void {sym}({SIGNATURES[kind]});\n" for sym, kind in symbols.items())
    with _lock:
        ffi.cdef(decls)
        try:
            lib = ffi.dlopen(str(path))
        except OSError as e:
            raise BuildDirError(f"{path}: cannot load kernel library: {e}") from None
    out = {}
    for sym in symbols:
        try:
            out[sym] = getattr(lib, sym)
        except AttributeError:
            raise BuildDirError(f"{path}: symbol {sym} missing from kernel library") from None
    # Keep the FFI and library alive as long as any function is referenced.
    _keepalive.append((ffi, lib))
    return out


_keepalive: list = []


def ptr(arr: np.ndarray):
    """A `float *` to the data of a C-contiguous float32 array (no copy)."""
    assert arr.dtype == np.float32 and arr.flags.c_contiguous
    return _ffi.cast("float *", arr.ctypes.data)


_ffi = cffi.FFI()


def empty_aligned(shape: tuple[int, ...], align: int = 64) -> np.ndarray:
    """An uninitialised float32 array whose data starts on an `align`-byte boundary
    (cache line), so vector loads never split lines at the start of a buffer."""
    count = int(np.prod(shape))
    raw = np.empty(count + align // 4, dtype=np.float32)
    offset = (-raw.ctypes.data % align) // 4
    return raw[offset:offset + count].reshape(shape)


def zeros_aligned(shape: tuple[int, ...], align: int = 64) -> np.ndarray:
    arr = empty_aligned(shape, align)
    arr.fill(0.0)
    return arr
