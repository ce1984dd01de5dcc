"""The pcldnn-gen command line: compile, inspect, errors, and what a hostile net.json can do."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import NETS

from pcldnn_gen.cli import main


def test_compile_writes_the_build_directory(tmp_path, capsys):
    out = tmp_path / "cifar"
    assert main(["compile", str(NETS / "cifar_small.json"), "--arch", "scalar", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "conv1" in printed and "kernels compiled" in printed and "0 kernel " not in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["arch"]["isa"] == "scalar" and manifest["net"]["name"] == "cifar_small"
    conv1 = manifest["layers"][0]
    fwd = conv1["kernels"]["fwd"]
    assert fwd["symbols"] == {"pcldnn_conv1_fwd": "conv_fwd"}
    assert (out / fwd["source"]).read_text().startswith("/*\n * pcldnn-gen")
    assert (out / fwd["library"]).is_file()
    assert fwd["plan"]["tile"]["registers"] <= 16
    # the family's own decisions, by name
    assert fwd["plan"]["template"] == "conv_fwd.c.j2" and fwd["plan"]["blocks"]["ifm_chunk"] >= 1
    assert fwd["plan"]["reduction_chunk"] == f"{fwd['plan']['blocks']['ifm_chunk']} input-channel blocks"
    assert sorted(p.name for p in (out / "src").iterdir()) == sorted(
        [f"{l['name']}_{p}.c" for l in manifest["layers"] for p in l["kernels"]] + ["peak.c", "sgd.c"])
    assert manifest["peak"]["symbols"] == {"pcldnn_peak": "peak"} and (out / manifest["peak"]["library"]).is_file()
    from pcldnn_gen.planner import LAYER_PASSES
    for layer in manifest["layers"]:  # every pass of every layer, plus its layout conversions
        assert set(layer["kernels"]) == {*LAYER_PASSES[layer["type"]], "layout"}


def test_inspect_prints_the_emitted_c_with_its_header(capsys):
    assert main(["inspect", str(NETS / "vgg_a.json"), "--layer", "conv3", "--pass", "fwd", "--arch", "avx2"]) == 0
    c = capsys.readouterr().out
    header = c.split("*/")[0]
    assert "layer   : conv3 (conv + fused relu), input 128x56x56 -> output 256x56x56" in header
    assert "arch    : avx2" in header and "blocks  : register tile" in header and "why     :" in header
    assert "_mm256_fmadd_ps" in c and "#pragma omp parallel for" in c
    assert "void pcldnn_conv3_fwd(const float *in" in c


@pytest.mark.parametrize("pass_name,needle", [
    ("bwd_data", "scratch[((((size_t)icb * OCB + ocb)"), ("bwd_weights", "static const int OH_LO[KH]")])
def test_inspect_backward_passes(capsys, pass_name, needle):
    assert main(["inspect", str(NETS / "overfeat_fast.json"), "--layer", "conv2", "--pass", pass_name,
                 "--arch", "avx2"]) == 0
    c = capsys.readouterr().out
    assert f"pass    : {pass_name} (conv_{pass_name})" in c and needle in c and "_mm256_fmadd_ps" in c
    assert f"void pcldnn_conv2_{pass_name}(" in c


def test_inspect_scalar_has_no_intrinsics(capsys):
    assert main(["inspect", str(NETS / "cifar_small.json"), "--layer", "fc1", "--arch", "scalar"]) == 0
    c = capsys.readouterr().out
    assert "_mm" not in c and "immintrin" not in c and "void pcldnn_fc1_fwd(" in c


def test_inspect_explain(capsys):
    assert main(["inspect", str(NETS / "vgg_a.json"), "--layer", "conv5", "--arch", "avx2", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "chosen   :" in out and "rejected :" in out
    # every pass of the layer, each once, and what "% of peak" counts
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("conv5 ")] == [
        "conv5 fwd on avx2", "conv5 bwd_data on avx2", "conv5 bwd_weights on avx2"]
    assert "nominal FLOPs" in out and "padding taps included" in out
    assert main(["inspect", str(NETS / "vgg_a.json"), "--layer", "conv5", "--arch", "avx2", "--explain",
                 "--pass", "bwd_data"]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("conv5 ")] == ["conv5 bwd_data on avx2"]


@pytest.mark.parametrize("argv,message", [
    (["compile", "missing.json"], "missing.json: cannot read"),
    (["inspect", str(NETS / "vgg_a.json"), "--layer", "nope", "--arch", "avx2"], "no layer named 'nope'"),
    (["compile", str(NETS / "vgg_a.json"), "--arch", "sse9"], "unknown arch 'sse9'"),
    (["inspect", str(NETS / "vgg_a.json"), "--layer", "pool1", "--pass", "bwd_weights", "--arch", "avx2"],
     "pool1: a maxpool layer has no 'bwd_weights' pass (it has: fwd, bwd_data)"),
])
def test_user_errors_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_hostile_names_are_rejected_before_anything_is_written(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PCLDNN_CACHE_DIR", str(cache))
    for i, evil in enumerate(['x"; system("id"); //', "../../etc"]):
        net = json.loads((NETS / "cifar_small.json").read_text())
        net["layers"][2]["name"] = evil
        path = tmp_path / f"evil{i}.json"
        path.write_text(json.dumps(net))
        out = tmp_path / f"out{i}"
        proc = subprocess.run([sys.executable, "-m", "pcldnn_gen.cli", "compile", str(path), "--arch", "scalar",
                               "-o", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2
        assert proc.stderr.startswith(f"error: {path}: layers[2].name: must match")
        assert "Traceback" not in proc.stderr
        assert not out.exists() and not cache.exists() and not (tmp_path / "build").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil0.json", "evil1.json"]


def test_version_and_help():
    out = subprocess.run([sys.executable, "-m", "pcldnn_gen.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("pcldnn-gen ")
    out = subprocess.run([sys.executable, "-m", "pcldnn_gen.cli", "compile", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--arch" in out.stdout and "--jobs" in out.stdout


def test_counts_read_as_english():
    from pcldnn_gen.cli import _ago
    from pcldnn_runtime.limits import plural
    assert [plural(n, "kernel") for n in (0, 1, 2)] == ["0 kernels", "1 kernel", "2 kernels"]
    assert plural(1, "entry", "entries") == "1 entry" and plural(3, "entry", "entries") == "3 entries"
    assert [_ago(s) for s in (0.4, 1, 59, 60, 89, 91, 3600, 86400 * 2)] == [
        "0 seconds", "1 second", "59 seconds", "1 minute", "1 minute", "2 minutes", "1 hour", "2 days"]


def test_default_build_directories_say_which_build_they_hold(tmp_path, monkeypatch):
    """--arch avx2 and --arch native on an AVX2 CPU are different builds (native has this CPU's
    caches), as are bf16 and --no-fusion builds: none replaces another by default."""
    from dataclasses import replace

    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import default_build_dir
    from pcldnn_gen.netspec import load_netspec
    net = load_netspec(NETS / "cifar_small.json")
    native_avx2 = replace(get_arch("avx2"), name="native-avx2", l2_bytes=512 << 10)
    native_amx = replace(get_arch("sapphirerapids"), name="native-sapphirerapids", amx=True)
    names = {str(default_build_dir(net, arch, precision, fusion)) for arch, precision, fusion in (
        (get_arch("avx2"), "fp32", True), (native_avx2, "fp32", True), (native_avx2, "fp32", False),
        (get_arch("avx512"), "bf16", True), (native_amx, "bf16", True), (get_arch("zen3"), "fp32", True))}
    assert names == {"build/cifar_small-avx2", "build/cifar_small-native-avx2", "build/cifar_small-native-avx2-nofusion",
                     "build/cifar_small-avx512-bf16", "build/cifar_small-native-avx512-amx-bf16", "build/cifar_small-zen3"}
    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(NETS / "cifar_small.json"), "--arch", "scalar"]) == 0
    assert main(["compile", str(NETS / "cifar_small.json"), "--arch", "scalar", "--no-fusion"]) == 0
    assert sorted(p.name for p in (tmp_path / "build").iterdir() if not p.name.startswith(".")) == [
        "cifar_small-scalar", "cifar_small-scalar-nofusion"]
