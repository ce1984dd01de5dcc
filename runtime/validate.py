"""Reading and checking what users hand the tools: JSON files, and typed fields with ranges.

One reader for every user file (net.json, arch and machine descriptions, build manifests,
checkpoint metadata): a regular file of bounded size, UTF-8, strict JSON (no NaN, no
duplicate keys, integers of at most 20 digits) nested at most MAX_DEPTH deep. `Fields` checks
values against types and documented ranges. Every problem is one `PcldnnError` line
`<file>: <json path>: <problem>`, never a traceback. Names use full-match patterns (`$` alone
would let a final newline through).
"""
from __future__ import annotations

import difflib
import glob
import json
import math
import os
import re
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import numpy as np

from .errors import PcldnnError
from .limits import format_bytes

# Layer, net and C-identifier-bound names: they become C symbols and file names.
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# Labels of CPU and machine descriptions: printed in reports and generated comments.
LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")

SHA256_RE = re.compile(r"[0-9a-f]{64}")  # digests of libraries and net descriptions

# Field names of PyTorch, ONNX and Keras for what our files call otherwise: suggested when
# one of them appears as an unknown field.
FIELD_SYNONYMS = {"kernel_size": "kernel", "kernel_shape": "kernel", "padding": "pad", "pads": "pad",
                  "strides": "stride", "filters": "out_channels", "units": "out_features",
                  "num_classes": "classes", "p": "rate", "ratio": "rate", "act": "activation"}


def suggest_field(key: str, allowed: Iterable[str]) -> str | None:
    """The allowed field `key` most likely stands for: a known synonym, else a close spelling."""
    allowed = sorted(allowed)
    synonym = FIELD_SYNONYMS.get(key.lower())
    if synonym in allowed:
        return synonym
    close = difflib.get_close_matches(key.lower(), allowed, n=1, cutoff=0.75)
    return close[0] if close else None


MAX_JSON_BYTES = 16 * 1024 * 1024   # a net of thousands of layers is a few hundred KiB
MAX_DEPTH = 32                      # the deepest legitimate file (a manifest) nests 6 levels
MAX_INT_DIGITS = 20                 # 2^64 has 20 digits; anything longer is not a size


def full_match(pattern: re.Pattern, value: Any) -> bool:
    return isinstance(value, str) and pattern.fullmatch(value) is not None


def open_regular(path: str | Path, error: type[PcldnnError] = PcldnnError) -> BinaryIO:
    """A user's file opened for binary reading, after checking on the open descriptor that it is
    a regular file: a FIFO (the open does not wait for a writer) or a device (`/dev/zero`) is
    refused, and no swap between a check and the open can slip one in. OSError and
    FileNotFoundError pass through for the caller to phrase."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except ValueError as e:  # a NUL byte in the path
        raise error(f"{show(str(path))}: not a usable path ({e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{path}: not a regular file")
    return os.fdopen(fd, "rb")


def read_bounded(path: str | Path, max_bytes: int, error: type[PcldnnError] = PcldnnError) -> bytes:
    """The whole of a user's regular file (open_regular) of at most `max_bytes`, or one error
    naming it."""
    try:
        with open_regular(path, error) as f:
            if os.fstat(f.fileno()).st_size > max_bytes:
                raise error(f"{path}: larger than {format_bytes(max_bytes)}")
            return f.read()
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None


def read_text(path: str | Path, error: type[PcldnnError] = PcldnnError, max_bytes: int = MAX_JSON_BYTES,
              what: str = "file") -> str:
    """A user's text file: a regular file (`open_regular`) of at most `max_bytes`, in UTF-8."""
    try:
        with open_regular(path, error) as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise error(f"{path}: {what} is more than the {max_bytes} bytes allowed")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def read_json(path: str | Path, error: type[PcldnnError] = PcldnnError, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A user's JSON file, or `error` naming the file and the problem."""
    return parse_json(read_text(path, error, max_bytes, "JSON file"), str(path), error)


def parse_json(text: str, origin: str, error: type[PcldnnError] = PcldnnError) -> Any:
    """Strict JSON: duplicate keys, NaN / Infinity, over-long integers and over-deep nesting
    are errors (Python's json accepts the first three and overflows the stack on the last)."""
    def pairs(items: Any) -> Any:
        out = {}
        for key, value in items:
            if key in out:
                raise _Bad(f"duplicate key {key!r}")
            out[key] = value
        return out

    def constant(name: Any) -> None:
        raise _Bad(f"{name} is not a JSON number")

    def integer(digits: Any) -> Any:
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            raise _Bad(f"integer of {len(digits)} digits")
        return int(digits)

    def number(text_: Any) -> Any:
        value = float(text_)
        if not math.isfinite(value):
            raise _Bad(f"number {text_} overflows a double")
        return value

    try:
        data = json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_int=integer,
                          parse_float=number)
    except json.JSONDecodeError as e:
        raise error(f"{origin}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except RecursionError:  # the parser's own limit, far deeper than MAX_DEPTH
        raise error(f"{origin}: nested more than {MAX_DEPTH} levels deep") from None
    except (_Bad, ValueError) as e:
        raise error(f"{origin}: invalid JSON: {e}") from None
    if _depth(data) > MAX_DEPTH:
        raise error(f"{origin}: nested more than {MAX_DEPTH} levels deep")
    return data


class _Bad(Exception):
    pass


def _depth(value: Any) -> int:
    """Deepest container nesting of a parsed document (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def non_finite_at(array: Any) -> int | None:
    """Flat index of the first NaN or infinity in a float array, None when there is none. One
    BLAS dot product of the array with itself (memory-bound, about half the time of np.sum):
    NaN and infinity propagate into it, so a finite result proves every element finite; only a
    result that is not (or a sum of squares past float32's range: values of 1e19 and more)
    pays for the exact search."""
    flat = np.ravel(array)
    with np.errstate(over="ignore", invalid="ignore"):
        if math.isfinite(float(np.dot(flat, flat))):
            return None
    bad = np.flatnonzero(~np.isfinite(flat))
    return int(bad[0]) if bad.size else None


def show(value: Any, limit: int = 60) -> str:
    """A value as JSON, shortened for an error line (never a multi-line or huge string)."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def join(where: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else str(key)


class Fields:
    """Typed checks that raise `error` with '<origin>: <json path>: <problem>'."""

    def __init__(self, origin: str, error: type[PcldnnError] = PcldnnError):
        self.origin, self.error = origin, error

    def fail(self, where: str, problem: str) -> NoReturn:
        raise self.error(f"{self.origin}: {where or '(top level)'}: {problem}")

    def obj(self, value: Any, where: str, required: Iterable[str], optional: Iterable[str] = ()) -> dict:
        """An object with these fields. Unknown fields are reported first, with the allowed
        field a misspelling or another framework's name most likely meant (`kernel_size` ->
        `kernel`), since a missing-field error alone does not say what was typed instead."""
        required, optional = set(required), set(optional)
        if not isinstance(value, dict):
            self.fail(where, f"must be an object, got {show(value)}")
        allowed = required | optional
        for key in value:
            if key not in allowed:
                guess = suggest_field(key, allowed) if isinstance(key, str) else None
                plain = isinstance(key, str) and len(key) <= 40 and key.isprintable()
                self.fail(join(where, key if plain else show(key, 40)),
                          "unknown field" + (f"; did you mean {guess!r}?" if guess else "")
                          + f" (allowed: {', '.join(sorted(allowed))})")
        for key in sorted(required):
            if key not in value:
                self.fail(join(where, key), "missing required field")
        return value

    def array(self, value: Any, where: str, lo: int = 0, hi: int = 1 << 20) -> list:
        if not isinstance(value, list) or not lo <= len(value) <= hi:
            self.fail(where, f"must be a list of {lo} to {hi} items, got {show(value)}")
        return value

    def int_in(self, value: Any, where: str, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self.fail(where, f"must be {_int_kind(lo)} (at most {hi}), got {show(value)}")
        return value

    def number_in(self, value: Any, where: str, lo: float, hi: float, *, open_lo: bool = False,
                  open_hi: bool = False) -> float:
        ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
              and (lo < value if open_lo else lo <= value) and (value < hi if open_hi else value <= hi))
        if not ok:
            self.fail(where, f"must be a number in {'(' if open_lo else '['}{lo:g}, {hi:g}{')' if open_hi else ']'}, "
                      f"got {show(value)}")
        return float(value)

    def boolean(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            self.fail(where, f"must be true or false, got {show(value)}")
        return value

    def string(self, value: Any, where: str, pattern: re.Pattern, what: str) -> str:
        if not full_match(pattern, value):
            self.fail(where, f"must match {pattern.pattern} ({what}), got {show(value)}")
        return value

    def text(self, value: Any, where: str, max_len: int = 200) -> str:
        """Free text (a description): printable, one line, bounded."""
        if not isinstance(value, str) or len(value) > max_len or not value.isprintable():
            self.fail(where, f"must be one line of printable text of at most {max_len} characters, got {show(value)}")
        return value

    def choice(self, value: Any, where: str, choices: Iterable[Any]) -> Any:
        choices = tuple(choices)
        if not any(type(value) is type(c) and value == c for c in choices):
            self.fail(where, f"must be one of {', '.join(str(c) for c in choices)}, got {show(value)}")
        return value

    def int_pair(self, value: Any, where: str, lo: int, hi: int) -> tuple[int, int]:
        """An int or [h, w], each in [lo, hi]."""
        def ok(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
        if ok(value):
            return (value, value)
        if isinstance(value, list) and len(value) == 2 and all(ok(v) for v in value):
            return (value[0], value[1])
        self.fail(where, f"must be {_int_kind(lo)} or [h, w] (each at most {hi}), got {show(value)}")


def _int_kind(lo: int) -> str:
    return {0: "a non-negative int", 1: "a positive int"}.get(lo, f"an int >= {lo}")


def check_writable(path: str | Path, what: str, error: type[PcldnnError] = PcldnnError,
                   directory: bool = False, make_parents: bool = False) -> Path:
    """A path a command will write, checked before the long work that ends in writing it: a file
    goes where no directory is, into an existing, writable folder (or, `make_parents`, one the
    writer creates); a `directory` (made with its parents) goes where no file is. One error
    naming `what` and the path."""
    path = Path(path)
    try:
        if directory and path.exists() and not path.is_dir():
            raise error(f"{what} {path}: exists and is not a directory")
        if not directory and path.is_dir():
            raise error(f"{what} {path}: is a directory")
        folder = path if directory else path.parent
        probe = folder
        while not probe.exists() and probe != probe.parent:  # the folder the writer creates under
            probe = probe.parent
        if not probe.is_dir():
            raise error(f"{what} {path}: {probe} is not a directory")
        if probe != folder and not (directory or make_parents):
            raise error(f"{what} {path}: {folder} does not exist")
        if not os.access(probe, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise error(f"{what} {path}: not writable")
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, a loop of links
        raise error(f"{what} {show(str(path))}: not a usable path ({e})") from None
    return path


def remove_stale_temporaries(path: Path) -> None:
    """Temporary files `.<name>.<pid>.*.tmp` of earlier writes of `path` whose writer is gone
    (killed mid-write); those of a live process writing it now are kept."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue  # another live process is saving the same checkpoint right now
        tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_atomic(path: Path, data: bytes) -> None:
    """`data` into a temporary file beside `path`, then renamed over it: readers see the old
    file or the new one, never half of it, and a failed write leaves no temporary behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
