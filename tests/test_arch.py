"""CPU descriptions: presets, JSON files, native, and refusing an ISA the CPU lacks."""
from __future__ import annotations

import json

import numpy as np
import pytest

import pcldnn_runtime as pr
from conftest import build_and_load
from pcldnn_gen.arch import PRESETS, get_arch, native_arch
from pcldnn_gen.errors import ArchError
from pcldnn_runtime import cpu


def test_presets_vector_widths():
    assert get_arch("avx2").vector_floats == 8
    assert get_arch("avx512").vector_floats == 16
    assert get_arch("scalar").vector_floats == 1
    assert get_arch("avx2").cflags == ("-mavx2", "-mfma")
    assert all("native" not in f for a in PRESETS.values() for f in a.cflags)


def test_native_reads_this_cpu():
    arch = native_arch()
    assert arch.isa == cpu.best_isa()
    assert arch.cores == cpu.usable_cores() >= 1
    sizes = cpu.cache_sizes()
    if 1 in sizes:
        assert arch.l1d_bytes == sizes[1]


def test_arch_from_json_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**PRESETS["avx2"].to_json(), "name": "mine", "l2_bytes": 2 * 1024 * 1024,
                                "broadcasts_per_cycle": 2}))
    arch = get_arch(str(path))
    assert arch.name == "mine" and arch.l2_bytes == 2 * 1024 * 1024 and arch.fma_latency == 4
    assert arch.broadcasts_per_cycle == 2.0


@pytest.mark.parametrize("patch,message", [
    ({"vector_registers": 0}, "vector_registers: must be a positive int"),
    ({"fma_units": 1.5}, "fma_units: must be a positive int"),
    ({"broadcasts_per_cycle": 0}, "broadcasts_per_cycle: must be a positive number"),
    ({"broadcasts_per_cycle": True}, "broadcasts_per_cycle: must be a positive number"),
    ({"isa": "neon"}, "isa: unknown ISA 'neon'"),
    ({"cflags": ["-march=native"]}, "cflags: -march/-mtune=native is not allowed"),
    ({"cflags": ["-mavx2; rm -rf /"]}, "cflags: must be a list of -m ISA flags"),
    ({"vector_bits": 128}, "vector_bits: avx2 vectors are 256 bits"),
    ({"colour": "red"}, "colour: unknown field"),
])
def test_bad_arch_files(tmp_path, patch, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**PRESETS["avx2"].to_json(), **patch}))
    with pytest.raises(ArchError, match=message):
        get_arch(str(path))


def test_unknown_arch_name():
    with pytest.raises(ArchError, match="unknown arch 'sse9'"):
        get_arch("sse9")


def test_running_an_isa_the_cpu_lacks_is_refused_before_any_call(tmp_path, monkeypatch):
    net = build_and_load(tmp_path, [{"name": "f", "type": "fc", "out_features": 3}], (4, 1, 1), "scalar")
    assert net.layers["f"].forward(np.ones((1, 4), np.float32)).shape == (1, 3)
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import parse_netspec
    spec = parse_netspec({"name": "t", "input": {"channels": 4, "height": 1, "width": 1},
                          "layers": [{"name": "f", "type": "fc", "out_features": 3}]})
    build(spec, get_arch("avx2"), tmp_path / "avx2")  # generating for another ISA is fine
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    with pytest.raises(pr.ArchError, match="needs ISA 'avx2' but this CPU lacks avx2, fma"):
        pr.load(tmp_path / "avx2")
