"""Hostile and broken input: every defect ends in one PcldnnError line naming the file and the
field, never another exception, a hang, or a half-written file.

Property-based (hypothesis, bounded example counts): net descriptions, arch descriptions,
manifests and checkpoints, mutated at random; plus the fixed cases of each class.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import NETS, TRAIN_LAYERS, TRAIN_SHAPE, build_and_load
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pcldnn_runtime as pr
from pcldnn_gen.arch import PRESETS, arch_from_dict
from pcldnn_gen.errors import ArchError, NetSpecError
from pcldnn_gen.netspec import parse_netspec
from pcldnn_runtime.manifest import parse_manifest
from pcldnn_runtime.validate import parse_json

CLI = [sys.executable, "-m", "pcldnn_gen.cli"]
VGG = json.loads((NETS / "vgg_a.json").read_text())

# JSON values of every kind, including the ones that break naive code: huge and negative ints,
# floats, strings with newlines and comment markers, nested containers.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "x\n", "*/", "conv1", "../x", "relu", "fc", "\u00e9"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


def _paths(value, prefix=()):
    """Every (path, value) inside a JSON document."""
    yield prefix, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _mutate(doc, data):
    """A copy of `doc` with one value replaced by an arbitrary JSON value, or one key removed."""
    doc = copy.deepcopy(doc)
    paths = [p for p, _ in _paths(doc) if p]
    path = data.draw(st.sampled_from(paths))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_values)
    return doc


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_net_descriptions_are_accepted_or_refused_in_one_line(data):
    doc = _mutate(VGG, data)
    try:
        net = parse_netspec(doc, "net.json")
    except NetSpecError as e:
        assert str(e).startswith("net.json: ") and "\n" not in str(e)
        return
    assert all(l.name.isidentifier() for l in net.layers)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mutated_arch_descriptions_are_accepted_or_refused_in_one_line(data):
    doc = _mutate(PRESETS["avx512"].to_json(), data)
    try:
        arch = arch_from_dict(doc, "arch.json")
    except ArchError as e:
        assert str(e).startswith("arch.json: ") and "\n" not in str(e)
        return
    assert arch.cflags == PRESETS[arch.isa].cflags  # the flags always follow from the ISA


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_and_load(tmp_path_factory.mktemp("h"), TRAIN_LAYERS, TRAIN_SHAPE, "scalar", name="hard").build_dir


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mutated_manifests_are_refused_with_the_field_named(built, data):
    manifest = json.loads((built / "manifest.json").read_text())
    doc = _mutate(manifest, data)
    try:
        parse_manifest(doc, "manifest.json")
    except pr.BuildDirError as e:
        assert str(e).startswith("manifest.json: ") and "\n" not in str(e)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["arch"].update(vector_bits=0), "arch.vector_bits: must be one of 32"),
    (lambda m: m["layers"][0].update(out_shape=[6, 10 ** 12, 8]), r"layers\[0\]\.out_shape\[1\]: must be a positive int"),
    (lambda m: m["layers"][0]["kernels"]["fwd"].update(library="lib/\u0000x.so"), r"kernels\.fwd\.library: must match"),
    (lambda m: m["layers"][0].pop("kernels"), r"layers\[0\]\.kernels: missing required field"),
    (lambda m: m["layers"][0].update(type=["conv"]), r"layers\[0\]\.type: must be one of"),
    (lambda m: m["layers"][1].update(in_shape=[6, 4, 4]), r"layers\[1\]\.in_shape: is \[6, 4, 4\] but"),
    (lambda m: m["layers"][0]["kernels"]["fwd"]["symbols"].update(pcldnn_conv1_fwd="fc_fwd"), "must be 'conv_fwd'"),
    (lambda m: m["arch"].update(isa="scalar", cflags=["-mavx512f"]), r"arch\.cflags: scalar builds are compiled"),
    (lambda m: m["net"].update(name="x\n"), r"net\.name: must match"),
    (lambda m: m["peak"]["symbols"].update(pcldnn_peak="conv_fwd"), r"peak\.symbols\.pcldnn_peak: must be 'peak'"),
    (lambda m: m["peak"].update(flops_per_iteration=0), r"peak\.flops_per_iteration: must be"),
    (lambda m: m["peak"].update(library="../../x.so"), "path '../../x.so' escapes the build directory"),
    (lambda m: m["sgd"]["symbols"].update(pcldnn_sgd="peak"), r"sgd\.symbols\.pcldnn_sgd: must be 'sgd'"),
    (lambda m: m["sgd"].update(library="../x.so"), "path '../x.so' escapes the build directory"),
    (lambda m: m.update(precision="fp16"), r"precision: must be one of fp32, bf16"),
])
def test_tampered_manifest_fields_are_named(built, tmp_path, edit, message):
    m = json.loads((built / "manifest.json").read_text())
    edit(m)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(pr.BuildDirError, match=message):
        pr.load(tmp_path)


# -- the user-file reader ----------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("[" * 5000 + "]" * 5000, "nested more than 32 levels deep"),
    ('{"a": ' * 40 + "1" + "}" * 40, "nested more than 32 levels deep"),  # within the parser's own limit
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"a": NaN}', "NaN is not a JSON number"),
    ('{"a": 1e999}', "overflows a double"),
    ('{"a": ' + "9" * 4400 + "}", "integer of 4400 digits"),
    ("{", "invalid JSON at line 1"),
])
def test_strict_json(text, message):
    with pytest.raises(pr.PcldnnError, match=message):
        parse_json(text, "f.json")


def _cli(*args, env=None, timeout=60):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def _one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.mark.parametrize("content, fragments", [
    (b"\xff\xfe{}", ["not UTF-8 text"]),
    (b'{"name": "n", "input": {"channels": 3, "height": 8, "width": 8}, "layers": [{"name": "a", "type": ["conv"]}]}',
     ["layers[0].type: unknown layer type"]),
    (json.dumps({"name": "fz\n", "input": {"channels": 3, "height": 8, "width": 8}, "layers": []}).encode(),
     ["name: must match"]),
    (json.dumps({**VGG, "input": {"channels": 10 ** 9, "height": 224, "width": 224}}).encode(),
     ["input.channels: must be a positive int (at most 65536)"]),
    (json.dumps({**VGG, "input": {"channels": 3, "height": 2 ** 63, "width": 224}}).encode(), ["input.height"]),
    (json.dumps({"name": "big", "input": {"channels": 3, "height": 5000, "width": 5000}, "layers": [
        {"name": "c", "type": "conv", "out_channels": 64, "kernel": 3, "pad": 1},
        {"name": "p", "type": "avgpool", "kernel": 5000}, {"name": "f", "type": "fc", "out_features": 10}]}).encode(),
     ["training needs about", "--max-memory"]),
])
def test_bad_net_files_end_in_one_line(tmp_path, content, fragments):
    path = tmp_path / "net.json"
    path.write_bytes(content)
    _one_line_error(_cli("compile", str(path), "--arch", "scalar", "-o", str(tmp_path / "out")),
                    str(path), *fragments)
    assert not (tmp_path / "out").exists()


def test_max_memory_can_be_raised(tmp_path):
    net = {**VGG, "input": {"channels": 3, "height": 448, "width": 448}}  # ~6.7 GB to train at minibatch 1
    path = tmp_path / "net.json"
    path.write_text(json.dumps(net))
    _one_line_error(_cli("inspect", str(path), "--layer", "conv1", "--arch", "scalar", "--max-memory", "1G"),
                    "more than the 1 GiB allowed")
    proc = _cli("inspect", str(path), "--layer", "conv1", "--arch", "scalar", "--max-memory", "64G")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("arch", ["/dev/zero", "/dev/null"])
def test_device_files_are_not_read(tmp_path, arch):
    _one_line_error(_cli("compile", str(NETS / "cifar_small.json"), "--arch", arch, timeout=30), "not a regular file")


def test_fifo_is_not_opened(tmp_path):
    fifo = tmp_path / "arch.json"
    os.mkfifo(fifo)
    _one_line_error(_cli("compile", str(NETS / "cifar_small.json"), "--arch", str(fifo), timeout=30),
                    "not a regular file")


# -- the compile cache -----------------------------------------------------------------------
def _cifar_compile(tmp_path, cache):
    return _cli("compile", str(NETS / "cifar_small.json"), "--arch", "scalar", "-o", str(tmp_path / "b"),
                env={"PCLDNN_CACHE_DIR": str(cache)}, timeout=300)


@pytest.mark.parametrize("kind", ["file", "read-only", "parent-read-only"])
def test_unusable_cache_compiles_without_it(tmp_path, kind):
    """Read-only directories are made with chmod, or (root writes through permissions) taken
    from a read-only file system: /proc."""
    cache = tmp_path / "cache"
    root = os.geteuid() == 0
    if kind == "file":
        cache.write_text("not a directory")
    elif kind == "read-only":
        cache = Path("/proc") if root else cache
        cache.mkdir(exist_ok=True)
        cache.chmod(0o500) if not root else None
    else:
        cache = Path("/proc/pcldnn/cache") if root else tmp_path / "ro" / "cache"
        if not root:
            cache.parent.mkdir()
            cache.parent.chmod(0o500)
    proc = _cifar_compile(tmp_path, cache)
    assert proc.returncode == 0, proc.stderr
    assert "warning: kernel cache" in proc.stderr and "PCLDNN_CACHE_DIR" in proc.stderr
    assert pr.load(tmp_path / "b", threads=1).name == "cifar_small"


def test_cache_entry_taken_by_a_directory_is_rebuilt(tmp_path):
    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.codegen import render_layout
    from pcldnn_gen.compiler import compile_source
    from pcldnn_gen.netspec import load_netspec
    net = load_netspec(NETS / "cifar_small.json")
    src = render_layout(net.layers[0], get_arch("scalar"))
    first = compile_source(src, get_arch("scalar"), tmp_path)
    first.library.unlink()
    first.library.mkdir()
    (first.library / "junk").write_text("x")
    again = compile_source(src, get_arch("scalar"), tmp_path)
    assert again.compiled and again.library.is_file()


# -- checkpoints -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(built, tmp_path_factory):
    trainer = pr.Trainer(pr.load(built, threads=1), pr.SGD(0.1, momentum=0.9))
    trainer.step(*next(pr.synthetic(8, TRAIN_SHAPE, 5).batches(8)))
    return trainer.save(tmp_path_factory.mktemp("ck") / "c.npz")


@pytest.fixture(scope="module")
def resumed(built, checkpoint):
    """(net, the state the intact checkpoint restores): one net serves every example (a
    refused resume leaves it untouched, an accepted one overwrites all of it)."""
    net = pr.load(built, threads=1)
    pr.Trainer.resume(checkpoint, net)
    return net, net.params.copy()


# The first 700 bytes hold the zip entry and npy headers of meta and params and the metadata;
# the rest is data and the central directory.
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_bit_flips_in_a_checkpoint_are_detected(checkpoint, resumed, tmp_path, data):
    """Flips anywhere (zip and npy headers, metadata, data: zip's CRC-32 covers every member)
    end in CheckpointError or, if they hit nothing read, the original state."""
    net, state = resumed
    raw = bytearray(checkpoint.read_bytes())
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, 700) | st.integers(0, len(raw) - 1))
        raw[i] ^= 1 << data.draw(st.integers(0, 7))
    path = tmp_path / "flipped.npz"
    path.write_bytes(bytes(raw))
    try:
        trainer = pr.Trainer.resume(path, net)
    except pr.CheckpointError as e:
        assert "\n" not in str(e)
        return
    np.testing.assert_array_equal(net.params, state)
    assert trainer.step_count == 1


def _rewrite(src: Path, dst: Path, meta_edit=None, params_edit=None) -> Path:
    with zipfile.ZipFile(src) as z:
        meta = json.loads(bytes(np.load(io.BytesIO(z.read("meta.npy")))).decode())
        params = np.load(io.BytesIO(z.read("params.npy")))
        velocity = np.load(io.BytesIO(z.read("velocity.npy")))
        statistics = np.load(io.BytesIO(z.read("statistics.npy")))
    if meta_edit:
        meta_edit(meta)
    if params_edit:
        params_edit(params)
    np.savez(dst, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), params=params, velocity=velocity,
             statistics=statistics)
    return dst


@pytest.mark.parametrize("meta_edit, params_edit, message", [
    (lambda m: m.pop("seed"), None, "meta.seed: missing required field"),
    (lambda m: m["optimizer"].update(nesterov=True), None, "meta.optimizer.nesterov: unknown field"),
    (lambda m: m.update(step="three"), None, "meta.step: must be a non-negative int"),
    (lambda m: m.update(step=-5), None, "meta.step: must be a non-negative int"),
    (lambda m: m["optimizer"].update(lr=-1), None, "optimizer settings in the checkpoint are invalid"),
    (None, lambda p: p.__setitem__(3, np.nan), r"params hold 1 NaN or infinite values \(first at index 3\)"),
    (lambda m: m.update(format="other/1"), None, "not a pcldnn checkpoint"),
    (lambda m: m.update(format="pcldnn-checkpoint/1"), None, "blocked layout and does not say which"),
    (lambda m: m.update(isa="neon"), None, "meta.isa: must be one of scalar, avx2, avx512"),
    (lambda m: m.update(precision="fp8"), None, "meta.precision: must be one of fp32, bf16"),
])
def test_bad_checkpoint_metadata_and_values(built, checkpoint, tmp_path, meta_edit, params_edit, message):
    path = _rewrite(checkpoint, tmp_path / "bad.npz", meta_edit, params_edit)
    with pytest.raises(pr.CheckpointError, match=message):
        pr.Trainer.resume(path, pr.load(built, threads=1))


def test_save_removes_orphaned_temporaries_of_that_checkpoint(built, tmp_path):
    trainer = pr.Trainer(pr.load(built, threads=1), pr.SGD(0.1))
    (tmp_path / ".c.npz.abc123.tmp").write_bytes(b"half")            # an older writer's name
    (tmp_path / ".c.npz.999999999.xyz.tmp").write_bytes(b"half")     # a writer that no longer runs
    (tmp_path / f".c.npz.{os.getppid()}.live.tmp").write_bytes(b"x")  # a live process saving now
    (tmp_path / ".other.npz.abc.tmp").write_bytes(b"other")         # another checkpoint's
    trainer.save(tmp_path / "c.npz")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([".other.npz.abc.tmp", f".c.npz.{os.getppid()}.live.tmp", "c.npz"])


def test_saving_non_finite_weights_is_refused(built, tmp_path):
    net = pr.load(built, threads=1)
    trainer = pr.Trainer(net, pr.SGD(0.1))
    net.params[0] = np.inf
    with pytest.raises(pr.CheckpointError, match="weights hold NaN or infinity"):
        trainer.save(tmp_path / "c.npz")
    assert not list(tmp_path.iterdir())


# -- loading ----------------------------------------------------------------------------------
def test_threads_follow_omp_num_threads_and_local_ranks(built, monkeypatch):
    from pcldnn_runtime import cpu
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert pr.load(built).threads == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    assert pr.load(built).threads == max(1, cpu.usable_cores() // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(pr.PcldnnError, match="OMP_NUM_THREADS must be a positive int"):
        pr.load(built)


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 1.5, "0"])
def test_bad_seeds(built, seed):
    with pytest.raises(pr.PcldnnError, match="seed must be an int"):
        pr.load(built, seed=seed)


def test_load_racing_a_recompile_gets_a_build_or_a_build_dir_error(tmp_path):
    """One thread rebuilds the same directory over and over (two nets alternately, so the
    manifest and libraries really change); loads meanwhile get one of the two builds or a
    BuildDirError, never another exception."""
    import threading

    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    specs = [parse_netspec({"name": "race", "input": {"channels": 3, "height": 6, "width": 6}, "layers": [
        {"name": "c", "type": "conv", "out_channels": oc, "kernel": 3}, {"name": "f", "type": "fc", "out_features": 4}]})
        for oc in (4, 8)]
    out = tmp_path / "race"
    for spec in specs:  # fill the cache: the rebuilds below only swap directories
        build(spec, get_arch("scalar"), out)
    stop = threading.Event()

    def rebuild():
        i = 0
        while not stop.is_set():
            build(specs[i % 2], get_arch("scalar"), out)
            i += 1

    thread = threading.Thread(target=rebuild)
    thread.start()
    seen = set()
    try:
        for _ in range(150):
            with contextlib.suppress(pr.BuildDirError):  # allowed: the directory was mid-swap
                seen.add(pr.load(out, threads=1).layers["c"].out_shape[0])
    finally:
        stop.set()
        thread.join()
    assert seen <= {4, 8} and seen


@pytest.mark.parametrize("args, fragment", [
    (["peak", "--threads", "100000"], "--threads: must be an int in [1, 4096]"),
    (["bench", str(NETS / "cifar_small.json"), "--repeats", "99999999999999"], "--repeats: must be an int in [1, 1000]"),
    (["plan", str(NETS / "cifar_small.json"), "--machine", "aws-c4", "--batch", "64", "--threshold", "nan"],
     "--threshold: must be a number in (0, 1)"),
    (["plan", str(NETS / "cifar_small.json"), "--machine", "aws-c4", "--batch", "64", "--nodes", "1,100000"],
     "node counts must be positive, at most 16384"),
    (["compile", str(NETS / "cifar_small.json"), "--max-memory", "lots"], "--max-memory: must be a size"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["compile"], "the following arguments are required: net"),
])
def test_command_line_values_have_ranges(args, fragment):
    _one_line_error(_cli(*args), fragment)


def test_cache_lock_taken_by_a_directory(tmp_path):
    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.codegen import render_layout
    from pcldnn_gen.compiler import c_compiler, cache_key, compile_flags, compile_source
    from pcldnn_gen.netspec import load_netspec
    arch = get_arch("scalar")
    src = render_layout(load_netspec(NETS / "cifar_small.json").layers[0], arch)
    key = cache_key(src.text, c_compiler(), compile_flags(arch))
    (tmp_path / key[:2] / f"{key}.lock").mkdir(parents=True)
    assert compile_source(src, arch, tmp_path).library.is_file()


def test_trainer_comm_must_be_a_communicator(built):
    with pytest.raises(pr.PcldnnError, match="comm must be an MPI intracommunicator"):
        pr.Trainer(pr.load(built, threads=1), pr.SGD(0.1), comm="world")


def test_fifos_in_build_directories_and_checkpoints_do_not_block(built, tmp_path):
    """Opening a FIFO for reading waits for a writer: a planted one must be refused, not hang."""
    import shutil
    copy = tmp_path / "b"
    shutil.copytree(built, copy)
    lib = copy / json.loads((copy / "manifest.json").read_text())["layers"][0]["kernels"]["fwd"]["library"]
    lib.unlink()
    os.mkfifo(lib)
    with pytest.raises(pr.BuildDirError, match="not a regular file"):
        pr.load(copy, threads=1)
    os.mkfifo(tmp_path / "ck.npz")
    with pytest.raises(pr.CheckpointError, match="not a regular file"):
        pr.Trainer.resume(tmp_path / "ck.npz", pr.load(built, threads=1))
