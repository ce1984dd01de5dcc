"""The C ABI of generated kernels, and loading them from shared libraries with cffi.

`SIGNATURES` is the one definition of every kernel kind's parameter list: the generator
renders prototypes from it and the runtime declares the same text to cffi (ABI mode, so a
node needs no compiler), so the two cannot drift apart.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import re
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cffi
import numpy as np

from .abi import SIGNATURES
from .errors import BuildDirError
from .manifest import stream_sha256
from .validate import open_regular

_lock = threading.Lock()


class KernelLibrary(dict):
    """{symbol: callable} of one loaded library. It holds the FFI and the library handle, which
    must outlive every call: keep the KernelLibrary as long as its functions are used."""

    def __init__(self, functions: dict[str, Callable], ffi: Any, handle: Any) -> None:
        super().__init__(functions)
        self._ffi, self._handle = ffi, handle


def load_library(path: Path, sha256: str, symbols: dict[str, str], pin: bool = True) -> KernelLibrary:
    """dlopen `path` after checking its digest; return {symbol: callable} for `symbols`
    ({symbol: kernel kind}). A truncated or replaced library is refused, not executed: the
    digest is taken of the very file that is loaded (one descriptor, loaded through
    /proc/self/fd), so a concurrent recompile cannot slip another library in between."""
    try:  # a FIFO planted in a build directory is refused, not waited on
        f = open_regular(path, BuildDirError)
    except OSError:
        raise BuildDirError(f"{path}: kernel library missing; run `pcldnn-gen compile` again") from None
    with f:
        try:
            digest = stream_sha256(f)
        except OSError as e:
            raise BuildDirError(f"{path}: cannot read kernel library: {e.strerror or e}") from None
        if digest != sha256:
            raise BuildDirError(f"{path}: kernel library is corrupt (sha256 differs from manifest.json); "
                                "run `pcldnn-gen compile` again")
        ffi = cffi.FFI()
        decls = "".join(f"void {sym}({SIGNATURES[kind]});\n" for sym, kind in symbols.items())
        with _lock:
            ffi.cdef(decls)
            # dlopen recognises loaded libraries by name: a private link named after the digest
            # (pointing at the checked descriptor) is unique to this content.
            link = _link_dir() / f"{sha256}.so"
            try:
                link.unlink(missing_ok=True)
                link.symlink_to(f"/proc/self/fd/{f.fileno()}")
                lib = ffi.dlopen(str(link))
            except OSError as e:
                raise BuildDirError(f"{path}: cannot load kernel library: {e}") from None
            finally:
                link.unlink(missing_ok=True)
    if pin:  # a Net loading many libraries pins once after the last (pin_openmp_runtimes)
        pin_openmp_runtimes()
    out = {}
    for sym in symbols:
        try:
            out[sym] = getattr(lib, sym)
        except AttributeError:
            raise BuildDirError(f"{path}: symbol {sym} missing from kernel library") from None
    return KernelLibrary(out, ffi, lib)


# OpenMP runtimes park their worker threads inside their own code between parallel regions. When
# the last kernel library that pulled a runtime in is unloaded (its Net garbage-collected, or at
# interpreter exit), dlclose would unmap the runtime under those threads: SIGSEGV, in about one
# run in four of "load, forward, exit". So every OpenMP runtime mapped into the process is held
# open for the process lifetime (a handle per runtime file: one or two entries).
_OPENMP_RUNTIMES = ("libgomp", "libomp", "libiomp5")
# the path field of a /proc/self/maps line (it may hold spaces) naming one of them
_OPENMP_PATH = re.compile(r"^\S+ \S+ \S+ \S+ \S+ +(/.*/(?:" + "|".join(_OPENMP_RUNTIMES) + r")[^/\n]*\.so[^/\n]*)$",
                          re.MULTILINE)
_pinned: dict[str, ctypes.CDLL] = {}


def pin_openmp_runtimes() -> None:
    """Hold every OpenMP runtime mapped into the process open. Reading /proc/self/maps costs
    about a millisecond once PyTorch or onnxruntime are loaded (hundreds of mappings), so the
    scan is one regular expression, and a Net runs it once, not once per kernel library."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return
    for path in set(_OPENMP_PATH.findall(maps)):
        if path not in _pinned:
            with _lock:
                _pinned.setdefault(path, ctypes.CDLL(path))


@functools.lru_cache(maxsize=1)
def _link_dir() -> Path:
    """A private directory for the links `load_library` dlopens (removed at exit)."""
    folder = Path(tempfile.mkdtemp(prefix="pcldnn-libs-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def fma_peak_gflops(fn: Callable, flops_per_iteration: int, threads: int, repeats: int = 5) -> float:
    """GFLOP/s of a peak kernel (templates/peak.c.j2: `flops_per_iteration` per thread and loop
    iteration) on `threads` threads: the loop count calibrated to ~50 ms a call, then the median
    of `repeats` calls."""
    sink = np.zeros(1, dtype=np.float32)
    iters = 1 << 16
    while True:
        start = time.perf_counter()
        fn(iters, threads, ptr(sink))
        if time.perf_counter() - start > 0.05 or iters > 1 << 34:
            break
        iters *= 4
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(iters, threads, ptr(sink))
        times.append(time.perf_counter() - start)
    return flops_per_iteration * threads * iters / float(np.median(times)) / 1e9


def bf16_bits(x: np.ndarray, out: np.ndarray, flush_subnormals: bool = False) -> None:
    """float32 `x` rounded to bf16 (to nearest, ties to even; a NaN stays a quiet NaN), as
    uint16 bits into `out`: what a bf16 gradient exchange sends (subnormals rounded), or with
    `flush_subnormals` exactly what the kernels' vcvtneps2bf16 gives (subnormal inputs become
    signed zeros): an activation stored as bf16 given through the layer API."""
    u = x.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    if flush_subnormals:
        rounded = np.where((u & 0x7F800000) == 0, (u >> 16) & 0x8000, rounded)
    np.copyto(out, np.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, rounded), casting="unsafe")


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits as float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


_C_TYPES = {np.dtype(np.float32): "float[]", np.dtype(np.int32): "int[]", np.dtype(np.float64): "double[]",
            np.dtype(np.uint16): "unsigned short[]"}  # uint16: bf16 values


def ptr(arr: np.ndarray | None) -> Any:
    """A typed C pointer to the data of a C-contiguous array (no copy; it keeps the array
    alive); NULL for None. Through the buffer protocol: 0.5 us a pointer against 1.7 us for a
    cast of `arr.ctypes.data`, and a kernel call passes four to seven of them."""
    if arr is None:
        return _ffi.NULL
    if not arr.flags.c_contiguous:
        raise ValueError("kernels need C-contiguous arrays")
    return _ffi.from_buffer(_C_TYPES[arr.dtype], arr, require_writable=False)


def ptr_array(arrays: list[np.ndarray]) -> Any:
    """A C array of float pointers to these float32 arrays' data (an add's or a concat's inputs);
    it keeps the arrays alive."""
    pointers = [ptr(a) for a in arrays]
    out = _ffi.new("float *[]", pointers)
    _keep[out] = pointers
    return out


_ffi = cffi.FFI()
_ffi.cdef("int memcmp(const void *, const void *, size_t);")
_libc = _ffi.dlopen(None)
_keep: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a pointer array -> the pointers it holds


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two C-contiguous arrays of one dtype and shape hold the same bytes: libc's memcmp,
    at the memory's speed (np.array_equal first builds a boolean array of every element: 12.5 ms
    for two 26 MB bf16 activations; VGG-A conv4's per-layer backward_weights ran 3.6 ms faster)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return _libc.memcmp(ptr(a), ptr(b), a.nbytes) == 0


CACHE_LINE_FLOATS = 16  # floats in a 64-byte cache line: parameter blocks and MPI parts start on one


def empty_aligned(shape: tuple[int, ...], align: int = 64, dtype: Any = np.float32, zeroed: bool = False) -> np.ndarray:
    """An uninitialised array (float32 unless said) whose data starts on an `align`-byte
    boundary (cache line), so vector loads never split lines at the start of a buffer.
    `zeroed`: through calloc, so a large buffer's pages are mapped zero and first written by
    whoever uses them (no pass over a net's parameters at load)."""
    count, size = int(np.prod(shape)), np.dtype(dtype).itemsize
    raw = (np.zeros if zeroed else np.empty)(count + align // size, dtype=dtype)
    offset = (-raw.ctypes.data % align) // size
    return raw[offset:offset + count].reshape(shape)


def zeros_aligned(shape: tuple[int, ...], align: int = 64) -> np.ndarray:
    return empty_aligned(shape, align, zeroed=True)
