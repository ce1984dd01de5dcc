"""CPU descriptions: presets, JSON files, native, and refusing an ISA the CPU lacks."""
from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import build_and_load

import pcldnn_runtime as pr
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


AVX512_FLAGS = frozenset({"avx512f", "avx2", "fma"})
AVX2_FLAGS = frozenset({"avx2", "fma"})
AMX_FLAGS = frozenset(cpu.AMX_FLAGS)


@pytest.mark.parametrize("vendor, family, model, flags, want", [
    ("GenuineIntel", 6, 0x3F, AVX2_FLAGS, "haswell"),
    ("GenuineIntel", 6, 0x55, AVX512_FLAGS, "skylake-x"),
    ("GenuineIntel", 6, 0x6A, AVX512_FLAGS, "icelake"),
    ("GenuineIntel", 6, 0x8F, AVX512_FLAGS, "sapphirerapids"),
    ("GenuineIntel", 6, 0x8F, AVX2_FLAGS, "avx2"),         # AVX-512 hidden by a VM: the family's figures do not apply
    ("GenuineIntel", 6, 0x9E, AVX2_FLAGS, "avx2"),         # a client part we do not describe: generic
    ("AuthenticAMD", 25, 0x21, AVX2_FLAGS, "zen3"),
    ("AuthenticAMD", 25, 0x11, AVX512_FLAGS, "zen4"),
    ("AuthenticAMD", 26, 0x02, AVX512_FLAGS, "zen5"),
    ("AuthenticAMD", 23, 0x31, AVX2_FLAGS, "avx2"),        # Zen 2: generic AVX2
    ("", -1, -1, frozenset(), "scalar"),                   # nothing readable
])
def test_native_takes_the_widest_isa_and_the_family_figures(monkeypatch, vendor, family, model, flags, want):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu, "cpu_identity", lambda: cpu.CpuIdentity(vendor, family, model, "test"))
    monkeypatch.setattr(cpu, "cache_sizes", lambda: {1: 48 * 1024, 2: 2 * 1024 * 1024, 3: 64 * 1024 * 1024})
    arch = native_arch()
    assert arch.name == f"native-{want}"
    assert arch.isa == PRESETS[want].isa == ("avx512" if "avx512f" in flags else "avx2" if flags else "scalar")
    fields = ("vector_registers", "fma_units", "fma_latency", "dot_latency", "load_ports", "broadcasts_per_cycle")
    assert [getattr(arch, f) for f in fields] == [getattr(PRESETS[want], f) for f in fields]
    assert (arch.l1d_bytes, arch.l2_bytes, arch.l3_bytes) == (48 * 1024, 2 * 1024 * 1024, 64 * 1024 * 1024)  # sysfs wins


@pytest.mark.parametrize("vendor, model, flags, arch, slow", [
    ("GenuineIntel", 0x8F, AVX512_FLAGS, "avx512", True),           # Sapphire Rapids by its model
    ("GenuineIntel", 0xA7, AVX512_FLAGS | AMX_FLAGS, "avx512", True),  # a VM's other model, AMX flags: that class
    ("GenuineIntel", 0x8F, AVX512_FLAGS, "sapphirerapids", False),  # the tiles: the bf16 engine
    ("GenuineIntel", 0x8F, AVX512_FLAGS, "zen5", False),            # compiling for another CPU: its rate
    ("AuthenticAMD", 0x02, AVX512_FLAGS, "avx512", False),          # Zen 5 host (family 26): 2x fp32
    ("GenuineIntel", 0x55, AVX512_FLAGS, "avx512", False),          # not known to be slower
])
def test_a_bf16_build_slower_than_fp32_says_so(tmp_path, monkeypatch, vendor, model, flags, arch, slow):
    """compile does not build a bf16 path slower than fp32 silently: without AMX tiles, where
    vdpbf16ps runs under the fp32 kernels' rate (Arch.dot_rate: Sapphire Rapids 0.5), the build
    warns once (SlowBuildWarning) with the reason and what to use; the generic avx512 preset is
    judged by the compiling CPU's family."""
    import warnings

    from pcldnn_gen.arch import slow_bf16_reason
    from pcldnn_gen.build import build
    from pcldnn_gen.errors import SlowBuildWarning
    from pcldnn_gen.netspec import parse_netspec
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu, "cpu_identity", lambda: cpu.CpuIdentity(vendor, 26 if vendor == "AuthenticAMD" else 6,
                                                                      model, "test"))
    reason = slow_bf16_reason(get_arch(arch))
    assert (reason is not None) == slow
    if slow:
        assert "0.5x the fp32" in reason and "--precision fp32" in reason and "sapphirerapids" in reason
    if slow and model == 0x8F:  # one build says it
        spec = parse_netspec({"name": "s", "input": {"channels": 16, "height": 4, "width": 4},
                              "layers": [{"name": "c", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1}]})
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            build(spec, get_arch(arch), tmp_path / "s", precision="bf16")
        assert [str(w.message) for w in seen if w.category is SlowBuildWarning] == [reason]


def test_every_preset_is_a_valid_arch_description():
    from pcldnn_gen.arch import arch_from_dict
    for name, arch in PRESETS.items():
        assert arch_from_dict(arch.to_json(), name) == arch
        assert arch.vector_bits == cpu.ISA_VECTOR_BITS[arch.isa]


def test_arch_from_json_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**PRESETS["avx2"].to_json(), "name": "mine", "l2_bytes": 2 * 1024 * 1024,
                                "broadcasts_per_cycle": 2}))
    arch = get_arch(str(path))
    assert arch.name == "mine" and arch.l2_bytes == 2 * 1024 * 1024 and arch.fma_latency == 4
    assert arch.broadcasts_per_cycle == 2.0


@pytest.mark.parametrize("patch,message", [
    ({"vector_registers": 0}, r"vector_registers: must be an int >= 4 \(at most 16\), got 0"),
    ({"vector_registers": 10 ** 6}, r"vector_registers: must be an int >= 4 \(at most 16\)"),
    ({"isa": "avx512", "vector_bits": 512, "vector_registers": 33, "cflags": None}, r"vector_registers: .*at most 32"),
    ({"fma_units": 1.5}, "fma_units: must be a positive int"),
    ({"fma_units": 10 ** 9}, r"fma_units: must be a positive int \(at most 4\)"),
    ({"l3_bytes": 10 ** 18}, r"l3_bytes: must be an int >= 65536"),
    ({"l1d_bytes": 1 << 21}, "l2_bytes: cache sizes must grow with the level: L1d 2097152, L2 1048576"),
    ({"cores": 2 ** 63}, "cores: must be a positive int"),
    ({"dot_latency": 0}, r"dot_latency: must be a positive int \(at most 32\), got 0"),
    ({"dot_latency": 6.5}, "dot_latency: must be a positive int"),
    ({"broadcasts_per_cycle": 0}, r"broadcasts_per_cycle: must be a number in \[0.1, 16\], got 0"),
    ({"broadcasts_per_cycle": True}, r"broadcasts_per_cycle: must be a number in \[0.1, 16\], got true"),
    ({"isa": "neon"}, 'isa: must be one of scalar, avx2, avx512, got "neon"'),
    ({"isa": ["avx2"]}, r'isa: must be one of scalar, avx2, avx512, got \["avx2"\]'),
    ({"cflags": ["-march=native"]}, 'cflags: flag "-march=native" is not allowed for isa avx2'),
    ({"cflags": ["-mavx2; rm -rf /"]}, "cflags: flag .* is not allowed for isa avx2"),
    ({"cflags": ["-mavx2", "-mfma", "-mavx512f"]}, 'cflags: flag "-mavx512f" is not allowed for isa avx2'),
    ({"isa": "scalar", "vector_bits": 32, "cflags": ["-mavx512f"]}, 'cflags: flag "-mavx512f" is not allowed for isa scalar'),
    ({"isa": "avx512", "vector_bits": 512, "cflags": []}, "cflags: isa avx512 is compiled with exactly -mavx512f -mavx2 -mfma"),
    ({"cflags": ["-m"]}, 'cflags: flag "-m" is not allowed'),
    ({"cflags": ["-m\u00e9"]}, "cflags: flag .* is not allowed"),
    ({"cflags": "-mavx2"}, "cflags: must be a list of compiler flags"),
    ({"vector_bits": 128}, "vector_bits: avx2 vectors are 256 bits"),
    ({"name": "x */ int evil; /*"}, "name: must match"),
    ({"name": "avx2\n"}, "name: must match"),
    ({"colour": "red"}, "colour: unknown field"),
    ({"amx": 1}, "amx: must be true or false, got 1"),
    ({"amx": True}, "amx: AMX tiles come with AVX-512 cores; this arch's isa is avx2"),
])
def test_bad_arch_files(tmp_path, patch, message):
    path = tmp_path / "bad.json"
    data = {**PRESETS["avx2"].to_json(), **patch}
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    with pytest.raises(ArchError, match=message):
        get_arch(str(path))


def test_cflags_follow_from_the_isa(tmp_path):
    """Omitted cflags are derived from the ISA; listed ones may come in any order."""
    data = PRESETS["avx512"].to_json()
    del data["cflags"]
    (tmp_path / "a.json").write_text(json.dumps(data))
    assert get_arch(str(tmp_path / "a.json")).cflags == cpu.ISA_CFLAGS["avx512"]
    (tmp_path / "b.json").write_text(json.dumps(dict(data, cflags=["-mfma", "-mavx512f", "-mavx2"])))
    assert get_arch(str(tmp_path / "b.json")).cflags == cpu.ISA_CFLAGS["avx512"]


def test_amx_is_a_capability_of_avx512_archs(tmp_path, monkeypatch):
    """`amx` defaults off, Sapphire Rapids has it, an arch file may say so, and `native` sets it
    exactly where the CPU has the AMX flags and Linux grants the tile state."""
    assert not PRESETS["avx512"].amx and PRESETS["sapphirerapids"].amx
    path = tmp_path / "amx.json"
    path.write_text(json.dumps({**PRESETS["avx512"].to_json(), "amx": True}))
    assert get_arch(str(path)).amx
    assert native_arch().amx == (cpu.best_isa() == "avx512" and cpu.request_amx() is None)
    if cpu.best_isa() == "avx512":
        monkeypatch.setattr(cpu, "request_amx", lambda: "this CPU lacks amx_tile")
        assert not native_arch().amx


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
    monkeypatch.delenv(cpu.MAX_ISA_VARIABLE, raising=False)  # the CPU is faked whole: no cap to name
    with pytest.raises(pr.ArchError, match="needs ISA 'avx2' but this CPU lacks avx2, fma"):
        pr.load(tmp_path / "avx2")


# The flags of a Sapphire Rapids core, as /proc/cpuinfo spells them (a subset: the ones that matter)
SPR_FLAGS = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl",
                       "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"})


@pytest.mark.parametrize("cap, best, level, kept, hidden", [
    ("scalar", "scalar", "scalar", {"sse2", "avx"}, {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"}),
    ("avx2", "avx2", "avx2", {"avx2", "fma", "f16c"}, {"avx512f", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16"}),
    ("AVX512", "avx512", "avx512", {"avx512f", "avx512_fp16", "avx512_vnni"}, {"avx512_bf16", "amx_tile", "amx_int8"}),
    ("avx512_bf16", "avx512", "avx512_bf16", {"avx512f", "avx512_bf16"}, {"amx_tile", "amx_bf16"}),
    ("amx", "avx512", "amx", set(SPR_FLAGS), set()),
    ("", "avx512", "amx", set(SPR_FLAGS), set()),
])
def test_max_isa_caps_what_the_process_believes(monkeypatch, cap, best, level, kept, hidden):
    """PCLDNN_MAX_ISA (as oneDNN's ONEDNN_MAX_CPU_ISA, case as typed) hides the flags of the
    levels above it from every decision: the widest ISA, native's arch, the runtime's checks."""
    monkeypatch.setattr(cpu, "raw_cpu_flags", lambda: SPR_FLAGS)
    monkeypatch.setattr(cpu, "_request_tile_state", lambda: None)  # Linux grants the tiles
    monkeypatch.setattr(cpu, "cpu_identity", lambda: cpu.CpuIdentity("GenuineIntel", 6, 0x8F, "test"))
    monkeypatch.setenv(cpu.MAX_ISA_VARIABLE, cap)
    flags = cpu.cpu_flags()
    assert kept <= flags and not hidden & flags, (kept - flags, hidden & flags)
    assert (cpu.best_isa(), cpu.isa_level()) == (best, level)
    arch = native_arch()
    assert arch.isa == best and arch.amx == (level == "amx")
    # the Sapphire Rapids figures only where its AVX-512 is believed (a cap at avx2 plans as a generic AVX2 CPU)
    assert arch.name == ("native-sapphirerapids" if best == "avx512" else f"native-{best}")
    if level != "amx":
        assert cpu.request_amx() == f"this CPU (capped by PCLDNN_MAX_ISA={cap.lower()}) lacks amx_tile, amx_bf16"


def test_max_isa_refuses_an_unknown_level_and_names_the_cap_in_refusals(tmp_path, monkeypatch, capsys):
    from pcldnn_gen.cli import main
    monkeypatch.setenv(cpu.MAX_ISA_VARIABLE, "avx1024")
    with pytest.raises(ArchError, match=r"^PCLDNN_MAX_ISA='avx1024' is not an ISA level; use one of scalar, avx2, "
                                        r"avx512, avx512_bf16, amx$"):
        cpu.cpu_flags()
    net = tmp_path / "net.json"
    net.write_text(json.dumps({"name": "t", "input": {"channels": 4, "height": 1, "width": 1},
                               "layers": [{"name": "f", "type": "fc", "out_features": 3}]}))
    assert main(["compile", str(net), "-o", str(tmp_path / "b")]) == 2  # native reads the flags
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == ["error: PCLDNN_MAX_ISA='avx1024' is not an ISA level; use one of scalar, avx2, avx512, "
                                "avx512_bf16, amx"] and not (tmp_path / "b").exists()
    monkeypatch.setenv(cpu.MAX_ISA_VARIABLE, "scalar")
    assert main(["compile", str(net), "--arch", "avx2", "-o", str(tmp_path / "b")]) == 0  # generating is not running
    with pytest.raises(pr.ArchError, match=r"needs ISA 'avx2' but this CPU \(capped by PCLDNN_MAX_ISA=scalar\) lacks "
                                           r"avx2, fma"):
        pr.load(tmp_path / "b")
    assert main(["compile", str(net), "-o", str(tmp_path / "native")]) == 0
    assert json.loads((tmp_path / "native" / "manifest.json").read_text())["arch"]["isa"] == "scalar"
