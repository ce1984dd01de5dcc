"""C source → shared library, through a content-addressed cache.

The key hashes the source, the compiler's identity and the flags, so an unchanged kernel is
never recompiled, whichever build directory asks for it. Entries are written under a file
lock to a temporary name and renamed into place, so concurrent compiles (several shells,
several MPI ranks) are safe; each library's digest is recorded beside it and checked on
every lookup, so a truncated or corrupt entry is rebuilt rather than served.

Parsing <immintrin.h> (62,000 lines) took two thirds of an average kernel's compile, so under
GCC a SIMD kernel is compiled with that header precompiled for its flags (one .gch per flag set
in the cache, built once): the same library, byte for byte, in half the time.

The libraries are loaded in cffi's ABI mode (`ffi.dlopen`) by the runtime: a node that
only runs kernels needs no compiler.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from filelock import FileLock

from pcldnn_runtime.manifest import file_sha256
from pcldnn_runtime.validate import write_atomic

from .arch import Arch
from .errors import CompileError, CompilerWarning


@dataclass(frozen=True)
class Source:
    """One emitted C file and the kernels it defines ({symbol: kernel kind})."""

    filename: str
    text: str
    symbols: dict[str, str]
    # flags beyond the ISA's that this file's instructions need (a precision's: -mavx512bf16),
    # from the allow-list cpu.PRECISION_CFLAGS
    cflags: tuple[str, ...] = ()


CACHE_FORMAT = "pcldnn-cache/1"
BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-Wall", "-Wno-unused-function")


def cache_dir() -> Path:
    """$PCLDNN_CACHE_DIR, else $XDG_CACHE_HOME/pcldnn-gen, else ~/.cache/pcldnn-gen."""
    if os.environ.get("PCLDNN_CACHE_DIR"):
        return Path(os.environ["PCLDNN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pcldnn-gen"


def c_compiler() -> str:
    return os.environ.get("CC", "cc")


@functools.lru_cache(maxsize=None)
def compiler_identity(cc: str) -> str:
    """Resolved path and first --version line: part of every cache key."""
    path = shutil.which(cc)
    if path is None:
        raise CompileError(f"C compiler {cc!r} not found on PATH (set CC to a gcc or clang)")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise CompileError(f"cannot run {path} --version: {e}") from None
    return f"{os.path.realpath(path)} {out.stdout.splitlines()[0] if out.stdout else ''}"


def compile_flags(arch: Arch, extra: tuple[str, ...] = ()) -> list[str]:
    return [*BASE_FLAGS, *arch.cflags, *extra]


@dataclass(frozen=True)
class CompileResult:
    library: Path       # the cached shared library
    compiled: bool      # False when served from the cache


def cache_key(text: str, cc: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (CACHE_FORMAT, compiler_identity(cc), " ".join(flags), text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def usable_cache(cache: Path | None = None) -> Path:
    """The cache directory, created if needed; when it cannot be used (a file, read-only, its
    parent read-only) a warning names it and PCLDNN_CACHE_DIR, and a private temporary
    directory (removed at exit) serves this process instead."""
    cache = cache or cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=cache)
        os.close(fd)
        os.unlink(probe)
        return cache
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
    fallback = Path(tempfile.mkdtemp(prefix="pcldnn-nocache-"))
    atexit.register(shutil.rmtree, fallback, True)
    warnings.warn(f"kernel cache {cache} is unusable ({reason}); compiling without a cache "
                  "(set PCLDNN_CACHE_DIR to a writable directory)", RuntimeWarning, stacklevel=2)
    return fallback


def _clear(path: Path) -> None:
    """Remove whatever occupies a cache entry's path that is not a regular file (a directory,
    a link): the entry is then rebuilt."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or (path.exists() and not path.is_file()):
        path.unlink()


def _valid_entry(lib: Path, digest_file: Path) -> bool:
    try:
        return (lib.is_file() and not lib.is_symlink() and digest_file.is_file()
                and digest_file.read_text().strip() == file_sha256(lib))
    except (OSError, UnicodeDecodeError):
        return False


@contextlib.contextmanager
def _temp_file(folder: Path, prefix: str, suffix: str) -> Iterator[str]:
    """A temporary name in the entry's folder (same filesystem: the rename is atomic), removed
    on the way out unless _install took it."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)
    os.close(fd)
    try:
        yield tmp
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _install(tmp: str, entry: Path, digest_file: Path) -> None:
    """Rename a finished file into place, then record its digest (checked by _valid_entry)."""
    digest = file_sha256(Path(tmp))
    os.replace(tmp, entry)
    write_atomic(digest_file, digest.encode())


# The header every SIMD kernel includes and whose parse dominates its compile; precompiled per flag set.
PRELUDE_INCLUDE = "#include <immintrin.h>"


@functools.lru_cache(maxsize=None)
def _is_gcc(cc: str) -> bool:
    """GCC's --version names the Free Software Foundation; clang's and others' do not (their
    precompiled headers work differently: those compilers just parse the header)."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in out


@functools.lru_cache(maxsize=None)
def prelude_args(cc: str, flags: tuple[str, ...], cache: Path) -> tuple[str, ...]:
    """`-include` of <immintrin.h> precompiled with exactly these flags, or () where there is
    none to be had (not GCC, the build failed): the kernel then parses the header itself. The
    .gch is built once per cache (file lock, atomic rename), its digest checked once per
    process. GCC uses a .gch only when it matches the compile (flags, compiler build) and
    otherwise reads the header, so a stale one cannot change a library, only its compile time."""
    return _build_prelude(cc, flags, cache) if _is_gcc(cc) else ()


def _build_prelude(cc: str, flags: tuple[str, ...], cache: Path) -> tuple[str, ...]:
    folder = (cache / "pch" / cache_key(PRELUDE_INCLUDE, cc, list(flags))).resolve()
    header, gch, digest_file = folder / "prelude.h", folder / "prelude.h.gch", folder / "prelude.h.gch.sha256"
    try:
        if not (folder.is_dir() and not folder.is_symlink()):
            _clear(folder)
            folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder.parent / f"{folder.name}.lock"), timeout=900):
            if not _valid_entry(gch, digest_file):
                for entry in (gch, digest_file):
                    _clear(entry)
                write_atomic(header, (PRELUDE_INCLUDE + "\n").encode())
                with _temp_file(folder, ".prelude.", ".gch.tmp") as tmp:
                    pch_flags = [f for f in flags if f != "-shared"]
                    if subprocess.run([cc, *pch_flags, "-x", "c-header", "-o", tmp, str(header)],
                                      capture_output=True, timeout=600).returncode != 0:
                        return ()
                    _install(tmp, gch, digest_file)
    except (OSError, subprocess.SubprocessError):
        return ()
    return ("-include", str(header))


def compile_source(source: Source, arch: Arch, cache: Path | None = None) -> CompileResult:
    """Return the cached library for `source`, compiling it first if absent or corrupt."""
    cache = cache or cache_dir()
    try:
        return _compile_cached(source, arch, cache)
    except OSError as e:  # the cache was usable at the start: disk full, removed underneath us, ...
        raise CompileError(f"kernel cache {cache}: {e.strerror or e} (set PCLDNN_CACHE_DIR to another "
                           "directory)") from None


def _compile_cached(source: Source, arch: Arch, cache: Path) -> CompileResult:
    cc = c_compiler()
    flags = compile_flags(arch, source.cflags)
    key = cache_key(source.text, cc, flags)
    folder = cache / key[:2]
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        _clear(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lib, digest_file, c_file = folder / f"{key}.so", folder / f"{key}.so.sha256", folder / f"{key}.c"
    if _valid_entry(lib, digest_file):
        return CompileResult(lib, compiled=False)
    lock = folder / f"{key}.lock"
    _clear(lock)  # a directory or link there is no lock anybody holds
    with FileLock(str(lock), timeout=900):
        if _valid_entry(lib, digest_file):  # another process finished it while we waited
            return CompileResult(lib, compiled=False)
        for entry in (lib, digest_file, c_file):
            _clear(entry)
        write_atomic(c_file, source.text.encode())
        prelude = prelude_args(cc, tuple(flags), cache) if PRELUDE_INCLUDE in source.text else ()
        with _temp_file(folder, f".{key[:16]}.", ".so.tmp") as tmp:
            cmd = [cc, *flags, "-o", tmp, str(c_file)]
            try:
                proc = subprocess.run([cc, *prelude, *cmd[1:]], capture_output=True, text=True, timeout=600)
                if proc.returncode != 0 and prelude:  # say what the source itself does, without the .gch
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                    if proc.returncode == 0:  # the .gch was at fault (removed underneath us?): look again next time
                        prelude_args.cache_clear()
            except subprocess.TimeoutExpired:
                raise CompileError(f"compiling {source.filename} timed out after 600 s: {shlex.join(cmd)}") from None
            if proc.returncode != 0:
                raise CompileError(
                    f"compiling {source.filename} failed (source kept at {c_file})\n"
                    f"command: {shlex.join(cmd)}\n{proc.stderr.strip()}")
            if proc.stderr.strip():
                warnings.warn(f"the C compiler warned about {source.filename} (a pcldnn-gen bug: please report it "
                              f"with {c_file}):\n{proc.stderr.strip()}", CompilerWarning, stacklevel=2)
            _install(tmp, lib, digest_file)
    return CompileResult(lib, compiled=True)


def compile_all(sources: list[Source], arch: Arch, jobs: int | None = None,
                cache: Path | None = None) -> list[CompileResult]:
    """Compile independent sources in parallel (`jobs` compiler processes at once)."""
    compiler_identity(c_compiler())  # fail fast, once, if there is no compiler
    cache = usable_cache(cache)
    jobs = max(1, jobs or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda s: compile_source(s, arch, cache), sources))


