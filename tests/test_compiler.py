"""Compiler cache: hits, concurrency, corruption, and compiler failures."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import NETS, REPO

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.compiler import Source, compile_source
from pcldnn_gen.errors import BuildDirError, CompileError
from pcldnn_gen.netspec import load_netspec, parse_netspec

sys.path.insert(0, str(REPO / "benchmarks"))
import spill_scan


def _is_gcc_cc() -> bool:
    from pcldnn_gen.compiler import _is_gcc, c_compiler
    return _is_gcc(c_compiler())


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PCLDNN_CACHE_DIR", str(cache))
    return cache


def test_second_compile_compiles_nothing(tmp_path, fresh_cache):
    net = load_netspec(NETS / "cifar_small.json")
    first = build(net, get_arch("scalar"), tmp_path / "a")
    assert first.compiled == first.cached + first.compiled > 0 and first.cached == 0
    second = build(net, get_arch("scalar"), tmp_path / "a")
    assert second.compiled == 0 and second.cached == first.compiled
    # another build directory for the same net is served from the same cache
    third = build(net, get_arch("scalar"), tmp_path / "b")
    assert third.compiled == 0
    pr.load(tmp_path / "b").forward(np.zeros((1, 3, 32, 32), np.float32))


def test_concurrent_compiles_of_the_same_net_both_succeed(tmp_path, fresh_cache):
    out = tmp_path / "shared-build"
    cmd = [sys.executable, "-m", "pcldnn_gen.cli", "compile", str(NETS / "cifar_small.json"),
           "--arch", "scalar", "-o", str(out), "--jobs", "2"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    # every kernel was compiled exactly once between the two processes
    compiled = [int(re.search(r"(\d+) kernels? compiled", r[0]).group(1)) for r in results]
    libs = len(list((out / "lib").glob("*.so")))
    assert sum(compiled) == libs
    net = pr.load(out)
    assert net.forward(np.ones((2, 3, 32, 32), np.float32)).shape == (2, 10)
    leftovers = [p.name for p in tmp_path.iterdir() if "staging" in p.name or ".old-" in p.name]
    assert leftovers == []


def test_truncated_library_is_detected_and_rebuilt(tmp_path, fresh_cache):
    net = load_netspec(NETS / "cifar_small.json")
    build(net, get_arch("scalar"), tmp_path / "b")
    cached = sorted(fresh_cache.glob("*/*.so"))
    victim = cached[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated cache entry
    again = build(net, get_arch("scalar"), tmp_path / "b")
    assert again.compiled == 1
    # a truncated library in the build directory itself is refused on load, not executed
    lib = tmp_path / "b" / "lib" / "conv2_fwd.so"
    lib.write_bytes(lib.read_bytes()[:1000])
    with pytest.raises(BuildDirError, match=r"conv2_fwd\.so: kernel library is corrupt"):
        pr.load(tmp_path / "b")
    build(net, get_arch("scalar"), tmp_path / "b")
    pr.load(tmp_path / "b")


def test_compiler_error_carries_command_stderr_and_source(fresh_cache):
    with pytest.raises(CompileError) as info:
        compile_source(Source("broken_fwd.c", "void f(void) { int x = ; }\n", {}), get_arch("scalar"))
    msg = str(info.value)
    assert "compiling broken_fwd.c failed" in msg
    assert "command: " in msg and " -O3 " in msg and "-fopenmp" in msg
    assert "error:" in msg  # the compiler's own stderr
    kept = msg.split("(source kept at ")[1].split(")")[0]
    assert os.path.exists(kept) and "int x = ;" in pathlib.Path(kept).read_text()
    assert not list(fresh_cache.glob("*/*.so"))


def test_flags_target_the_arch_never_native(tmp_path, fresh_cache):
    from pcldnn_gen.compiler import compile_flags
    assert "-mavx2" in compile_flags(get_arch("avx2")) and "-mfma" in compile_flags(get_arch("avx2"))
    assert not any("native" in f for isa in ("scalar", "avx2", "avx512") for f in compile_flags(get_arch(isa)))


def test_refuses_to_overwrite_a_foreign_directory(tmp_path, fresh_cache):
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(BuildDirError, match="not a pcldnn-gen build directory"):
        build(load_netspec(NETS / "cifar_small.json"), get_arch("scalar"), precious)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_a_build_of_an_older_format_is_refused_then_replaced(tmp_path, fresh_cache):
    """A pcldnn-build/9 build's convolution and batchnorm kernels take no fused statistics or
    shortcut (/7: its SGD update says nothing of non-finite weights): loading one is refused;
    compiling over it is allowed."""
    import json

    import pcldnn_runtime as pr
    out = tmp_path / "b"
    spec = load_netspec(NETS / "cifar_small.json")
    build(spec, get_arch("scalar"), out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["format"] = "pcldnn-build/9"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BuildDirError, match="format is 'pcldnn-build/9', expected 'pcldnn-build/10'; recompile"):
        pr.load(out)
    build(spec, get_arch("scalar"), out)
    assert pr.load(out).name == "cifar_small"




def _simd_source(tag: str) -> Source:
    return Source(f"{tag}_fwd.c", f"/* {tag} */\n#include <immintrin.h>\n"
                  "void zero(float *x) { _mm256_storeu_ps(x, _mm256_setzero_ps()); }\n", {})


def _source_cflags(c_file) -> tuple[str, ...]:
    """The flags an fp32 build's source was compiled with beyond the ISA's: a layout library's -O2."""
    from pcldnn_gen.codegen import LAYOUT_CFLAGS
    return LAYOUT_CFLAGS if "layout conversions between" in c_file.read_text()[:300] else ()


def _same_as_plain_compile(lib, arch, tmp_path) -> bool:
    """Whether a cached library is the one the compiler makes from its source alone, with no
    precompiled header (compiled under the same file name: the name is in the library)."""
    from pcldnn_gen.compiler import c_compiler, compile_flags
    (tmp_path / "plain").mkdir(exist_ok=True)
    src, out = tmp_path / "plain" / lib.with_suffix(".c").name, tmp_path / "plain" / lib.name
    src.write_text(lib.with_suffix(".c").read_text())
    subprocess.run([c_compiler(), *compile_flags(arch, _source_cflags(src)), "-o", str(out), str(src)], check=True)
    return out.read_bytes() == lib.read_bytes()


def _uses_precompiled_header(c_file, arch, cache) -> bool:
    """GCC's `-H` lists the headers a compile reads and marks a precompiled one it used with '!'
    (one it rejected, for other flags say, would cost its full parse again)."""
    from pcldnn_gen.compiler import c_compiler, compile_flags, prelude_args
    flags = compile_flags(arch, _source_cflags(c_file))
    run = subprocess.run([c_compiler(), *flags, *prelude_args(c_compiler(), tuple(flags), cache), "-H", "-fsyntax-only",
                          str(c_file)], capture_output=True, text=True, check=True)
    return "! " + str((cache / "pch").resolve()) in run.stderr


@pytest.mark.skipif(not _is_gcc_cc(), reason="precompiled headers are used with GCC only")
def test_simd_kernels_share_one_valid_precompiled_header_and_the_same_libraries(tmp_path, fresh_cache):
    """Every SIMD kernel of a build is compiled with <immintrin.h> precompiled for its flags: one
    .gch for each of the build's flag sets (the kernels', the layout libraries' -O2), which GCC
    accepts for those flags, and the libraries are the ones the sources alone give."""
    arch = get_arch("avx2")
    build(load_netspec(NETS / "cifar_small.json"), arch, tmp_path / "b")
    assert len(list((fresh_cache / "pch").glob("*/prelude.h.gch"))) == 2
    kernels = [c for c in sorted(fresh_cache.glob("*/*.c")) if "#include <immintrin.h>" in c.read_text()]
    assert len(kernels) >= 5 and _uses_precompiled_header(kernels[0], arch, fresh_cache)
    assert all(_same_as_plain_compile(c.with_suffix(".so"), arch, tmp_path) for c in kernels[:3])


@pytest.mark.skipif(not _is_gcc_cc(), reason="precompiled headers are used with GCC only")
def test_a_broken_precompiled_header_never_breaks_or_changes_a_kernel(tmp_path, fresh_cache):
    """A truncated .gch (its digest no longer matches) is rebuilt; one that is garbage yet carries
    a matching digest is ignored by GCC; one removed under a running process makes the compile
    fall back to parsing the header, and the next compile builds it again. Each time the library
    is the source's own. (A .gch is not byte-reproducible: rebuilt ones are checked by use.)"""
    import shutil

    from pcldnn_gen import compiler
    arch = get_arch("avx2")
    first = compile_source(_simd_source("first"), arch).library
    (folder,) = [p for p in (fresh_cache / "pch").iterdir() if p.is_dir()]
    gch, digest = folder / "prelude.h.gch", folder / "prelude.h.gch.sha256"

    gch.write_bytes(gch.read_bytes()[:100_000])
    compiler.prelude_args.cache_clear()  # a new process
    lib = compile_source(_simd_source("truncated"), arch).library
    assert digest.read_text() == compiler.file_sha256(gch)
    assert _uses_precompiled_header(first.with_suffix(".c"), arch, fresh_cache)
    assert _same_as_plain_compile(lib, arch, tmp_path)

    gch.write_bytes(b"not a precompiled header")
    digest.write_text(compiler.file_sha256(gch))
    compiler.prelude_args.cache_clear()
    lib = compile_source(_simd_source("garbage"), arch).library
    assert _same_as_plain_compile(lib, arch, tmp_path)

    shutil.rmtree(folder)  # the memo still points at it
    lib = compile_source(_simd_source("removed"), arch).library
    assert _same_as_plain_compile(lib, arch, tmp_path)
    compile_source(_simd_source("again"), arch)  # looks again: builds a new one
    assert _uses_precompiled_header(first.with_suffix(".c"), arch, fresh_cache)


def test_other_compilers_parse_the_header_themselves(tmp_path, fresh_cache, monkeypatch):
    """A compiler that is not GCC (its --version says clang here) gets no -include and no .gch
    is built: other compilers' precompiled headers work differently."""
    import shutil
    fake = tmp_path / "clang"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "clang version 17.0.6"; exit 0; fi\n'
                    f'exec {shutil.which("gcc") or "cc"} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    lib = compile_source(_simd_source("clang"), get_arch("avx2")).library
    assert lib.is_file() and not (fresh_cache / "pch").exists()


def test_a_compiler_warning_about_generated_code_is_reported(fresh_cache):
    """Generated C is meant to compile cleanly under -Wall: a warning reaches the user as a
    CompilerWarning naming the file and the kept source (the suite makes it an error), and the
    kernel is still built."""
    from pcldnn_gen.errors import CompilerWarning
    with pytest.warns(CompilerWarning, match=r"(?s)warns_fwd\.c .*unused variable"):
        result = compile_source(Source("warns_fwd.c", "int f(void) { int unused; return 0; }\n", {}), get_arch("scalar"))
    assert result.compiled and result.library.is_file()


def _tiny(i: int) -> Source:
    return Source(f"tiny{i}.c", f"int tiny{i}(void) {{ return {i}; }}\n", {})


def test_prune_removes_the_least_recently_used_and_a_hit_counts_as_use(fresh_cache):
    """Entries age by their last use (a hit renews the library's mtime, so compiling the oldest
    again saves it); prune --max-size removes oldest first until the rest fits, and what it
    removed compiles again on the next request while what it kept is served."""
    from pcldnn_gen.compiler import cache_entries, prune_cache
    arch = get_arch("scalar")
    libs = [compile_source(_tiny(i), arch).library for i in range(4)]
    day = 86400.0
    for age, lib in zip((4, 3, 2, 1), libs):  # tiny0 oldest
        for path in lib.parent.glob(lib.name.split(".")[0] + ".*"):
            os.utime(path, (time.time() - age * day,) * 2)
    assert compile_source(_tiny(0), arch).compiled is False  # a hit: tiny0 now the newest
    entries = cache_entries(fresh_cache)
    assert [e.files[0].name.split(".")[0] for e in entries] == [lib.name.split(".")[0] for lib in libs[1:] + libs[:1]]
    keep_two = sum(e.size for e in entries[-2:])
    (fresh_cache / "tuning.json").write_text("{}")
    result = prune_cache(fresh_cache, max_bytes=keep_two + 1)
    assert [e.key for e in result.removed] == [e.key for e in entries[:2]] and len(result.kept) == 2
    assert result.freed == sum(e.size for e in entries[:2])
    assert not libs[1].exists() and not libs[2].exists() and libs[0].exists() and libs[3].exists()
    assert (fresh_cache / "tuning.json").read_text() == "{}"
    assert [compile_source(_tiny(i), arch).compiled for i in range(4)] == [False, True, True, False]
    # by age: what was unused for more than 1.5 days
    for lib in libs[1:3]:
        os.utime(lib, (time.time() - 2 * day,) * 2)
    assert len(prune_cache(fresh_cache, max_age_s=1.5 * day).removed) == 2


def test_prune_keeps_an_entry_a_compile_holds_and_clears_dead_temporaries(fresh_cache):
    from filelock import FileLock

    from pcldnn_gen.compiler import STALE_TEMP_S, cache_entries, prune_cache
    arch = get_arch("scalar")
    held, free = (compile_source(_tiny(i), arch).library for i in (7, 8))
    dead = held.parent / f".{held.name[:16]}.abc.so.tmp"
    fresh = held.parent / f".{held.name[:16]}.def.so.tmp"
    for path in (dead, fresh):
        path.write_bytes(b"half a library")
    os.utime(dead, (time.time() - 2 * STALE_TEMP_S,) * 2)
    with FileLock(str(held.with_suffix(".lock"))):
        result = prune_cache(fresh_cache, max_bytes=0)
    assert [e.files[0].parent / e.key for e in result.busy] == [held.with_suffix("")]
    assert held.exists() and not free.exists() and result.temporaries == 1
    assert fresh.exists() and not dead.exists()  # a compile may be writing the fresh one
    assert [e.kind for e in cache_entries(fresh_cache)] == ["kernel"]


def test_cache_command(tmp_path, fresh_cache, capsys):
    """info says what the cache holds; clear empties it but for the tuning database; prune needs
    a limit; bad sizes and options are refused with one line, exit 2."""
    from pcldnn_gen.cli import main
    for i in range(3):
        compile_source(_tiny(i), get_arch("scalar"))
    (fresh_cache / "tuning.json").write_text("{}")
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "3 kernel libraries" in out and "tuning database" in out
    assert main(["cache", "clear", "--dry-run"]) == 0 and "would remove 3 entries" in capsys.readouterr().out
    assert len(list(fresh_cache.glob("*/*.so"))) == 3
    for argv, message in ((["cache", "prune"], "give --max-size"), (["cache", "--max-size", "1G"], "go with prune"),
                          (["cache", "prune", "--max-size", "5Q"], "must be a size"),
                          (["cache", "prune", "--older-than", "nan"], "number of days")):
        with contextlib.suppress(SystemExit):
            assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (argv, err)
    assert main(["cache", "clear"]) == 0 and "removed 3 entries" in capsys.readouterr().out
    assert not list(fresh_cache.glob("*/*.so")) and (fresh_cache / "tuning.json").is_file()
    (tmp_path / "file").write_text("")
    os.environ["PCLDNN_CACHE_DIR"] = str(tmp_path / "file")  # restored by fresh_cache's monkeypatch
    assert main(["cache"]) == 2 and "not a directory" in capsys.readouterr().err


def test_a_build_survives_a_prune_between_compile_and_copy(tmp_path, fresh_cache, monkeypatch):
    """A cache entry pruned after compile_all returned it (another shell's `cache clear`) is
    compiled again when the build copies it, not a failed build."""
    import pcldnn_gen.build as generator
    from pcldnn_gen.compiler import prune_cache
    real = generator.compile_all

    def compile_then_prune(*args, **kwargs):
        results = real(*args, **kwargs)
        prune_cache(fresh_cache, max_bytes=0)
        return results
    monkeypatch.setattr(generator, "compile_all", compile_then_prune)
    net = parse_netspec({"name": "tiny", "input": {"channels": 3, "height": 5, "width": 5},
                         "layers": [{"name": "conv", "type": "conv", "out_channels": 4, "kernel": 3}]})
    build(net, get_arch("scalar"), tmp_path / "b")
    assert pr.load(tmp_path / "b").forward(np.ones((1, 3, 5, 5), np.float32)).shape == (1, 4, 3, 3)


@pytest.mark.skipif(not _is_gcc_cc(), reason="which values a compiler keeps in registers is gcc's here")
@pytest.mark.parametrize("pass_name,image,kernel,stride,out,tile,before,bound", [
    ("fwd", 224, 3, 2, 32, (14, 2), 63, 12),        # MobileNet's first layer at the model's 14x2
    ("bwd_data", 224, 3, 1, 64, None, 56, 16)])      # VGG-16's first layer, the few-channel kernel
def test_packed_first_layer_kernels_keep_their_accumulators_in_registers(tmp_path, pass_name, image, kernel, stride,
                                                                        out, tile, before, bound):
    """A 3-channel first layer's kernels read windows that overlap between kernel columns (the
    packed image's pixels in forward, dy's pixels in the few-channel backward-data); gcc held
    those values across columns and kept the accumulators on the stack (`before` zmm stack
    accesses: 1.50x and 1.28x slower, benchmarks/RESULTS.md); the barrier after each column
    leaves a handful, none in the tile's loop."""
    net = parse_netspec({"name": "m", "input": {"channels": 3, "height": image, "width": image}, "layers": [
        {"name": "c", "type": "conv", "out_channels": out, "kernel": kernel, "stride": stride, "pad": 1}]})
    result = build(net, get_arch("avx512"), tmp_path / "b", choices={("c", pass_name): tile} if tile else None)
    assert tile is None or result.plans[("c", pass_name)].tile.width == tile[0]
    stack, fmas = spill_scan.count(tmp_path / "b" / "lib" / f"c_{pass_name}.so", "%zmm")
    assert fmas >= 100 and stack <= bound < before, stack


def test_spill_scan_counts_every_kernel_of_a_zoo(tmp_path):
    """benchmarks/spill_scan.py: one row per kernel library of every shape (layouts left out),
    FMA instructions counted in each conv and fc kernel; `--layers` and `--json` select and
    record (the counts themselves: the accumulator test above)."""
    zoo = tmp_path / "zoo.json"
    zoo.write_text(json.dumps({"name": "z", "shapes": [
        {"name": "first", "family": "t", "input": [3, 32, 32], "layer": {"type": "conv", "out_channels": 32,
                                                                          "kernel": 3, "stride": 2, "pad": 1}},
        {"name": "fc", "family": "t", "input": [64, 1, 1], "layer": {"type": "fc", "out_features": 40}}]}))
    rows = spill_scan.scan(zoo, "avx512", "fp32", None, tmp_path / "b")
    assert sorted(r.kernel for r in rows) == sorted(f"{s}_{p}" for s in ("first", "fc")
                                                    for p in ("fwd", "bwd_data", "bwd_weights"))
    assert all(r.fmas > 0 and r.stack >= 0 for r in rows)
    out = tmp_path / "s.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["spill_scan.py", "--zoo", str(zoo), "--json", str(out), "--layers", "fc"])
        assert spill_scan.main() == 0
    assert {k["shape"] for k in json.loads(out.read_text())["kernels"]} == {"fc"}


def test_compile_shows_its_progress_on_request(fresh_cache, capsys):
    """A terminal sees kernels done of all and the cache hits (a big net compiles for a minute)."""
    from pcldnn_gen.compiler import Source, compile_all
    sources = [Source(f"p{i}.c", f"int pcldnn_p{i}(void) {{ return {i}; }}\n", {f"pcldnn_p{i}": "peak"})
               for i in range(3)]
    compile_all(sources[:1], get_arch("scalar"), progress=True)
    capsys.readouterr()
    results = compile_all(sources, get_arch("scalar"), progress=True)
    err = capsys.readouterr().err
    assert [r.compiled for r in results] == [False, True, True]
    assert "compiling" in err and "3/3" in err and "1 from the cache" in err, err
    compile_all(sources, get_arch("scalar"), progress=False)
    assert capsys.readouterr().err == ""
