""".npy and .npz files read defensively: a header is parsed and its claims (dtype, shape, bytes)
are checked against the file and the memory bound before anything is mapped or allocated, so a
header that lies (more rows than the file holds, 10^12 rows, a negative or overflowing
dimension, an object dtype) is one error naming the file, never numpy's ValueError,
OverflowError or MemoryError. Shared by datasets (`MemmapDataset`), weight files (`read_npz`)
and checkpoints."""
from __future__ import annotations

import hashlib
import io
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from . import limits
from .errors import PcldnnError
from .validate import open_regular, read_bounded, show

MAX_HEADER = 10000  # bytes of a header's dict: numpy's own default limit
NUMBER_KINDS = "fiub"  # float, signed, unsigned, bool: what an image or weight can be
MAX_NPZ_MEMBERS = 1 << 16


@dataclass(frozen=True)
class NpyHeader:
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # where the data starts in the stream

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def read_header(f: IO[bytes], origin: str, error: type[PcldnnError] = PcldnnError,
                kinds: str = NUMBER_KINDS) -> NpyHeader:
    """The header at the stream's position: a C-ordered array of plain numbers of `kinds`, every
    dimension a non-negative int. Python's tokenizer parses numpy's header, so any exception may
    come out of it: each is this project's error."""
    start = f.tell()
    try:
        version = np.lib.format.read_magic(f)
        reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0,
                  (3, 0): np.lib.format.read_array_header_2_0}.get(version)
        if reader is None:
            raise error(f"{origin}: not a .npy array (unknown format version {version})")
        shape, fortran, dtype = reader(f, max_header_size=MAX_HEADER)
    except PcldnnError:
        raise
    except Exception as e:
        raise error(f"{origin}: not a .npy array ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise error(f"{origin}: the header's shape {show(list(shape) if isinstance(shape, tuple) else shape)} "
                    "is not a list of non-negative ints")
    if fortran:
        raise error(f"{origin}: Fortran-ordered arrays are not read; save it C-ordered (np.ascontiguousarray)")
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in kinds:
        raise error(f"{origin}: holds {dtype}, expected plain numbers ({_kind_names(kinds)})")
    return NpyHeader(tuple(shape), dtype, f.tell() - start)


def _kind_names(kinds: str) -> str:
    names = {"f": "float", "i": "signed int", "u": "unsigned int", "b": "bool"}
    return ", ".join(names[k] for k in kinds)


def check_claim(header: NpyHeader, available: int, origin: str, error: type[PcldnnError] = PcldnnError) -> None:
    """The bytes the header claims must be the bytes there are (no more: a short file would
    fault when mapped; no fewer: trailing bytes mean the header is not the file's)."""
    if header.nbytes != available:
        raise error(f"{origin}: the header claims {list(header.shape)} x {header.dtype} = {header.nbytes} bytes, "
                    f"the file holds {available}")


def npy_file_header(path: Path, error: type[PcldnnError] = PcldnnError, kinds: str = NUMBER_KINDS) -> NpyHeader:
    """The checked header of a .npy file whose data must fill the rest of the file exactly."""
    try:
        f = open_regular(path, error)
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    with f:
        header = read_header(f, str(path), error, kinds)
        size = f.seek(0, 2)
    check_claim(header, size - header.offset, str(path), error)
    return header


def read_npz(path: str | Path, error: type[PcldnnError] = PcldnnError, max_bytes: int = 1 << 36,
             sha256: str | None = None) -> dict[str, np.ndarray]:
    """Every array of an .npz file, each member's header checked against the member's size and
    all of them together against the memory bound before one is read. With `sha256`, the bytes
    read are the bytes checked against it."""
    path = Path(path)
    bound = limits.max_memory()
    data = read_bounded(path, min(max_bytes, bound + (64 << 20)), error)  # a file far over the bound: not read
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise error(f"{path}: corrupt (sha256 differs from manifest.json); run `pcldnn-gen compile` again")
    if data.startswith(b"\x93NUMPY"):
        raise error(f"{path}: a single array, not an .npz file of named arrays")
    out: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            members = z.infolist()
            if len(members) > MAX_NPZ_MEMBERS:
                raise error(f"{path}: {len(members)} members, more than {MAX_NPZ_MEMBERS}")
            headers = []
            for info in members:
                if not info.filename.endswith(".npy") or info.is_dir():
                    raise error(f"{path}: member {show(info.filename)} is not a .npy array")
                with z.open(info) as f:
                    header = read_header(f, f"{path}: {info.filename}", error)
                check_claim(header, info.file_size - header.offset, f"{path}: {info.filename}", error)
                headers.append((info, header))
            total = sum(h.nbytes for _, h in headers)
            if total > bound:
                raise error(f"{path}: {limits.format_bytes(total)} of arrays, more than the "
                            f"{limits.format_bytes(bound)} memory bound ({limits.MEMORY_ENV})")
            for info, header in headers:
                out[info.filename[:-4]] = read_data(z, info, header, f"{path}: {info.filename}", error)
    except PcldnnError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError,
            RuntimeError) as e:  # not a zip, an unsupported compression, a corrupt member (CRC)
        raise error(f"{path}: not a NumPy .npz file of arrays ({type(e).__name__}: {str(e)[:200]})") from None
    return out


def read_data(z: zipfile.ZipFile, info: zipfile.ZipInfo, header: NpyHeader, origin: str,
              error: type[PcldnnError] = PcldnnError) -> np.ndarray:
    """A member's array, its header already checked: exactly header.nbytes are read."""
    with z.open(info) as f:
        f.seek(header.offset)
        raw = f.read(header.nbytes + 1)
    if len(raw) != header.nbytes:
        raise error(f"{origin}: truncated ({len(raw)} bytes of {header.nbytes})")
    return np.frombuffer(raw, dtype=header.dtype).reshape(header.shape).copy()
