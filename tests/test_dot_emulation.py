"""benchmarks/dot_emulation.py: the emulated build is the bf16 build with only the dot product
spelled differently (and, on a CPU without AVX512_BF16, the conversion), and its timing process
flushes denormals (the assists it avoids)."""
from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, runs

SCRIPT = REPO / "benchmarks" / "dot_emulation.py"
HAS_BF16 = runs("avx512_bf16")
sys.path.insert(0, str(REPO / "benchmarks"))
import dot_emulation  # noqa: E402

NET = {"name": "emu", "input": {"channels": 32, "height": 6, "width": 8},
       "layers": [{"name": "conv", "type": "conv", "out_channels": 32, "kernel": 3, "pad": 1, "activation": "relu"},
                  {"name": "fc", "type": "fc", "out_features": 10},
                  {"name": "loss", "type": "softmax_cross_entropy"}]}


def _run(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out


def test_emulated_build_differs_only_in_the_dot_product(tmp_path):
    (tmp_path / "net.json").write_text(json.dumps(NET))
    _run("compile", str(tmp_path / "net.json"), "--arch", "avx512", "-o", str(tmp_path / "emu"))
    subprocess.run([sys.executable, "-m", "pcldnn_gen", "compile", str(tmp_path / "net.json"), "--arch", "avx512",
                    "--precision", "bf16", "-o", str(tmp_path / "real")], check=True, capture_output=True, cwd=REPO)
    for layer, pass_name in itertools.product(("conv", "fc"), ("fwd", "bwd_data", "bwd_weights")):
        real = (tmp_path / "real" / "src" / f"{layer}_{pass_name}.c").read_text()
        emu = (tmp_path / "emu" / "src" / f"{layer}_{pass_name}.c").read_text()
        assert "_mm512_dpbf16_ps(" in real and "_mm512_dpbf16_ps(" not in emu, (layer, pass_name)
        # without AVX512_BF16 here, the conversion is redefined ahead of the kernel's own text
        converts = dot_emulation.CONVERSION in real
        prelude = not HAS_BF16 and converts
        assert emu.startswith(dot_emulation.CONVERSION_WITHOUT_BF16) == prelude, (layer, pass_name)
        emu = emu.removeprefix(dot_emulation.CONVERSION_WITHOUT_BF16)
        rewritten = re.sub(r"_mm512_dpbf16_ps\((\w+), (\w+), (\w+)\)", r"_mm512_fmadd_ps((__m512)(\2), (__m512)(\3), \1)",
                           real)
        assert emu == rewritten, (layer, pass_name)


FLUSHED = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import dot_emulation
tiny = np.float32(1e-40)  # subnormal
before = float(tiny * np.float32(1))
dot_emulation.flush_denormals()
print(before, float(tiny * np.float32(1)))
"""


def test_timing_process_flushes_denormals():
    out = subprocess.run([sys.executable, "-c", FLUSHED, str(REPO / "benchmarks")], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    before, after = map(float, out.stdout.split())
    assert before > 0 and after == 0.0


@pytest.mark.needs_isa("avx512")  # the emulated kernels are AVX-512F
def test_ab_times_two_emulated_builds(tmp_path):
    (tmp_path / "net.json").write_text(json.dumps(NET))
    for side in ("a", "b"):
        _run("compile", str(tmp_path / "net.json"), "--arch", "avx512", "-o", str(tmp_path / side))
    out = _run("ab", str(tmp_path / "a"), str(tmp_path / "b"), "--batch", "2", "--rounds", "1", "--repeats", "1",
               "--layers", "conv")
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("conv ")]
    assert [r[1] for r in rows] == ["fwd", "bwd_data", "bwd_weights"]
    assert all(0 < float(r[4]) < 100 for r in rows)  # the ratio of two measured times


@pytest.mark.needs_isa("avx512")  # the emulated kernels are AVX-512F
def test_bench_json_of_an_emulated_build_says_bf16(tmp_path):
    """`bench --json` records the build's precision beside the net's own name (summarize.py keys
    bf16 runs apart from fp32 runs of the same layers by it)."""
    (tmp_path / "net.json").write_text(json.dumps(NET))
    _run("bench", str(tmp_path / "net.json"), "--arch", "avx512", "--batch", "2", "--threads", "1", "--repeats", "1",
         "--passes", "fwd", "--json", str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert (data["net"], data["precision"]) == ("emu", "bf16")
    assert [(r["layer"], r["pass_name"]) for r in data["results"]] == [("conv", "fwd"), ("fc", "fwd")]


@pytest.mark.needs_isa("avx512")
@pytest.mark.skipif(HAS_BF16, reason="only a CPU without AVX512_BF16 refuses bf16 builds")
def test_ab_without_bf16_refuses_a_build_with_bf16_instructions(tmp_path):
    """On a CPU without AVX512_BF16, `ab` loads emulated builds only: a real bf16 build would
    die by SIGILL, so it names the kernel that holds bf16 instructions instead."""
    (tmp_path / "net.json").write_text(json.dumps(NET))
    _run("compile", str(tmp_path / "net.json"), "--arch", "avx512", "-o", str(tmp_path / "emu"))
    subprocess.run([sys.executable, "-m", "pcldnn_gen", "compile", str(tmp_path / "net.json"), "--arch", "avx512",
                    "--precision", "bf16", "-o", str(tmp_path / "real")], check=True, capture_output=True, cwd=REPO)
    out = subprocess.run([sys.executable, str(SCRIPT), "ab", str(tmp_path / "emu"), str(tmp_path / "real"), "--batch", "2",
                          "--rounds", "1", "--layers", "conv"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode != 0 and "bf16 instructions this CPU lacks" in out.stderr
    assert str(tmp_path / "real" / "src") in out.stderr


@pytest.mark.needs_isa("avx512")  # the emulated kernels are AVX-512F
def test_tune_of_emulated_builds_keeps_its_own_database(tmp_path):
    """`tune` times emulated bf16 builds (their conv kernels' candidates) and records bf16
    entries in a database of its own, not the one a real compile on this machine reads."""
    (tmp_path / "net.json").write_text(json.dumps(NET))
    out = subprocess.run([sys.executable, str(SCRIPT), "tune", str(tmp_path / "net.json"), "--arch", "avx512",
                          "--batch", "2", "--threads", "1", "--rounds", "1", "--candidates", "2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PCLDNN_TUNING_DB"})
    assert out.returncode == 0, out.stderr
    assert "(bf16)" in out.stdout and str(tmp_path / "emulated-tuning.json") in out.stdout
    entries = json.loads((tmp_path / "emulated-tuning.json").read_text())["entries"]
    assert sorted(e["key"]["pass"] for e in entries) == ["bwd_data", "bwd_weights", "fwd"]
    assert {e["key"]["precision"] for e in entries} == {"bf16"}
