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
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

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
    # flags beyond the ISA's that this file's instructions need (a precision's: -mavx512bf16,
    # from the allow-list cpu.PRECISION_CFLAGS), or a layout library's -O2 (codegen.LAYOUT_CFLAGS)
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


@functools.cache
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


def _sweep_temporaries(folder: Path, prefixes: tuple[str, ...]) -> None:
    """Remove the temporaries of one entry's compiles that died mid-way (killed, power cut):
    called under that entry's lock, which a live compile of it would hold, so every such
    temporary found is dead. The hour-old rule of `prune_cache` covers the other entries."""
    for path in folder.iterdir():
        if path.name.startswith(prefixes) and path.name.endswith(".tmp") and path.is_file() and not path.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _mark_used(entry: Path) -> None:
    """Renew an entry's mtime on a hit: `prune_cache` removes the least recently used first
    (atime is not kept on most mounts). Best effort: a read-only cache still serves."""
    with contextlib.suppress(OSError):
        os.utime(entry)


def _install(tmp: str, entry: Path, digest_file: Path) -> None:
    """Rename a finished file into place, then record its digest (checked by _valid_entry)."""
    digest = file_sha256(Path(tmp))
    os.replace(tmp, entry)
    write_atomic(digest_file, digest.encode())


# The header every SIMD kernel includes and whose parse dominates its compile; precompiled per flag set.
PRELUDE_INCLUDE = "#include <immintrin.h>"


@functools.cache
def _is_gcc(cc: str) -> bool:
    """GCC's --version names the Free Software Foundation; clang's and others' do not (their
    precompiled headers work differently: those compilers just parse the header)."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in out


@functools.cache
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
            if _valid_entry(gch, digest_file):
                _mark_used(gch)
            else:
                for entry in (gch, digest_file):
                    _clear(entry)
                _sweep_temporaries(folder, (".prelude.",))
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
        _mark_used(lib)
        return CompileResult(lib, compiled=False)
    lock = folder / f"{key}.lock"
    _clear(lock)  # a directory or link there is no lock anybody holds
    with FileLock(str(lock), timeout=900):
        if _valid_entry(lib, digest_file):  # another process finished it while we waited
            return CompileResult(lib, compiled=False)
        for entry in (lib, digest_file, c_file):
            _clear(entry)
        _sweep_temporaries(folder, (f".{key[:16]}.", f".{key}."))
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
                cache: Path | None = None, progress: bool | None = None) -> list[CompileResult]:
    """Compile independent sources in parallel (`jobs` compiler processes at once). `progress`:
    a bar on stderr, kernels done of all and how many came from the cache (None: where stderr
    is a terminal; a big net's compile takes a minute or more)."""
    from tqdm import tqdm
    compiler_identity(c_compiler())  # fail fast, once, if there is no compiler
    cache = usable_cache(cache)
    jobs = max(1, jobs or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool, \
            tqdm(total=len(sources), desc="compiling", unit="kernel", dynamic_ncols=True,
                 disable=None if progress is None else not progress) as bar:
        futures = [pool.submit(compile_source, s, arch, cache) for s in sources]
        cached = 0
        for future in as_completed(futures):
            if future.exception() is None and not future.result().compiled:
                cached += 1
                bar.set_postfix_str(f"{cached} from the cache", refresh=False)
            bar.update()
        return [f.result() for f in futures]  # raises the first failure in source order


# Keeping the cache's size in check (`pcldnn-gen cache`). A build directory holds copies of its
# libraries, so removing cache entries never breaks a build: it only makes the next compile of
# those kernels compile again.
KERNEL_FOLDER = re.compile(r"[0-9a-f]{2}")
KERNEL_FILE = re.compile(r"([0-9a-f]{64})\.(so|so\.sha256|c)")
HEADER_FOLDER = re.compile(r"[0-9a-f]{64}")
STALE_TEMP_S = 3600.0  # a temporary older than this belongs to a compile that died


@dataclass(frozen=True)
class CacheEntry:
    """What prune removes as one: a kernel (library, digest, source) or a precompiled header's
    folder. last_used: the library's mtime (a hit renews it; a failed compile's lone source: its
    own), a header folder's newest."""
    kind: str            # "kernel" or "header"
    key: str
    files: tuple[Path, ...]
    size: int
    last_used: float
    lock: Path           # held by a compile of this entry


@dataclass(frozen=True)
class PruneResult:
    removed: tuple[CacheEntry, ...]
    kept: tuple[CacheEntry, ...]
    busy: tuple[CacheEntry, ...]   # to be removed, but a compile held its lock: kept
    temporaries: int               # leftovers of compiles that died, removed

    @property
    def freed(self) -> int:
        return sum(e.size for e in self.removed)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except OSError:  # removed underneath us
        return None


def cache_entries(cache: Path) -> list[CacheEntry]:
    """Every kernel and precompiled header in `cache`, least recently used first. Files the
    cache does not name (the tuning database, anything a user put there) are not entries."""
    entries = []
    for folder in sorted(cache.iterdir()) if cache.is_dir() else ():
        if KERNEL_FOLDER.fullmatch(folder.name) and folder.is_dir() and not folder.is_symlink():
            by_key: dict[str, list[tuple[Path, os.stat_result]]] = {}
            for path in folder.iterdir():
                match, st = KERNEL_FILE.fullmatch(path.name), _stat(path)
                if match and st is not None:
                    by_key.setdefault(match.group(1), []).append((path, st))
            for key, files in sorted(by_key.items()):
                used = [s.st_mtime for p, s in files if p.suffix == ".so"] or [s.st_mtime for _, s in files]
                entries.append(CacheEntry("kernel", key, tuple(p for p, _ in files), sum(s.st_size for _, s in files),
                                          max(used), folder / f"{key}.lock"))
    headers = cache / "pch"
    for folder in sorted(headers.iterdir()) if headers.is_dir() and not headers.is_symlink() else ():
        if HEADER_FOLDER.fullmatch(folder.name) and folder.is_dir() and not folder.is_symlink():
            files = [(p, st) for p in folder.iterdir() if (st := _stat(p)) is not None]
            entries.append(CacheEntry("header", folder.name, (folder, *(p for p, _ in files)),
                                      sum(s.st_size for _, s in files),
                                      max((s.st_mtime for _, s in files), default=0.0),  # empty: oldest
                                      headers / f"{folder.name}.lock"))
    return sorted(entries, key=lambda e: (e.last_used, e.key))


def prune_cache(cache: Path, max_bytes: int | None = None, max_age_s: float | None = None,
                dry_run: bool = False) -> PruneResult:
    """Remove entries last used more than `max_age_s` ago, then the least recently used until
    the entries take at most `max_bytes`. Each is removed under its compile lock; one a compile
    holds is kept (busy). Also removes the temporaries of compiles that died."""
    now = time.time()
    entries = cache_entries(cache)
    total = sum(e.size for e in entries)
    removed, kept, busy = [], [], []
    for entry in entries:  # oldest first
        old = max_age_s is not None and now - entry.last_used > max_age_s
        if not (old or (max_bytes is not None and total > max_bytes)):
            kept.append(entry)
            continue
        if dry_run or _remove_entry(entry):
            removed.append(entry)
            total -= entry.size
        else:
            busy.append(entry)
    temporaries = 0 if dry_run else _remove_temporaries(cache, now)
    return PruneResult(tuple(removed), tuple(kept), tuple(busy), temporaries)


def _remove_entry(entry: CacheEntry) -> bool:
    """Remove an entry's files under its lock (False: a compile holds it). The lock file goes
    too: a compile that opened it before may then race one that creates it anew, and both
    write the same bytes by atomic renames."""
    try:
        with FileLock(str(entry.lock), timeout=0):
            for path in entry.files[::-1]:  # a header folder's files before the folder
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            with contextlib.suppress(FileNotFoundError):
                entry.lock.unlink()
    except Timeout:
        return False
    return True  # an emptied kernel folder stays: a compile may have just made it its own


def _remove_temporaries(cache: Path, now: float) -> int:
    """Temporary files (`.name...`) that compiles or probes left behind over an hour ago."""
    count = 0
    folders = [cache, *(f for f in cache.iterdir() if KERNEL_FOLDER.fullmatch(f.name))] if cache.is_dir() else []
    headers = cache / "pch"
    if headers.is_dir() and not headers.is_symlink():
        folders += [f for f in headers.iterdir() if HEADER_FOLDER.fullmatch(f.name)]
    for folder in folders:
        if not folder.is_dir() or folder.is_symlink():
            continue
        for path in folder.iterdir():
            st = _stat(path)
            if ((path.name.startswith(".") and path.name.endswith(".tmp")) or path.name.startswith(".probe-")) \
                    and st is not None and now - st.st_mtime > STALE_TEMP_S and path.is_file() and not path.is_symlink():
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    count += 1
    return count
