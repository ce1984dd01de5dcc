"""Compiler cache: hits, concurrency, corruption, and compiler failures."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import NETS

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.compiler import Source, compile_source
from pcldnn_gen.errors import BuildDirError, CompileError
from pcldnn_gen.netspec import load_netspec


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
    compiled = [int(r[0].split(" kernels compiled")[0].rsplit(" ", 1)[1]) for r in results]
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
    with pytest.raises(BuildDirError, match="conv2_fwd.so: kernel library is corrupt"):
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
    assert os.path.exists(kept) and "int x = ;" in open(kept).read()
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
    """pcldnn-build/4's packed first-layer AMX forward read its weights as fewer B tiles than the
    runtime now makes (/2's stride-1 AMX conv kernels copied their whole padded source into the
    scratch the runtime no longer gives them): loading one is refused; compiling over it is allowed."""
    import json

    import pcldnn_runtime as pr
    out = tmp_path / "b"
    spec = load_netspec(NETS / "cifar_small.json")
    build(spec, get_arch("scalar"), out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["format"] = "pcldnn-build/5"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BuildDirError, match="format is 'pcldnn-build/5', expected 'pcldnn-build/6'; recompile"):
        pr.load(out)
    build(spec, get_arch("scalar"), out)
    assert pr.load(out).name == "cifar_small"


