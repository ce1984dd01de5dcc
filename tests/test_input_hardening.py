"""Hostile and broken input on the newer ways in (issue 47): model files, datasets, the tuning
database and `pcldnn-gen train`. Each class of defect ends in one PcldnnError line naming the
file, node or option, before any long work, never another exception, silent wrong data, a file
read outside the model, or a half-written file.

Property-based (hypothesis, bounded example counts) over ONNX graphs, PyTorch modules, .npy /
.npz headers, label arrays and image modes; plus one fixed case per class of the issue.
"""
from __future__ import annotations

import io
import json
import subprocess
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import RUNNABLE_ISAS, TRAIN_LAYERS, TRAIN_SHAPE, build_and_load
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pcldnn_runtime as pr
from pcldnn_gen.cli import main
from pcldnn_gen.errors import ModelImportError
from pcldnn_runtime.errors import NonFiniteError, PcldnnError
from pcldnn_runtime.state_io import read_npz

ISA = RUNNABLE_ISAS[-1]
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]}
SECRET = b"\x01\x02\x03\x04" * 8  # 8 float32 values: what an external tensor would read


def _one_line(e: Exception, origin: str) -> None:
    text = str(e)
    assert "\n" not in text and origin in text, text


# -- ONNX ------------------------------------------------------------------------------------

def _onnx_model(conv: dict | None = None, *, bias_const=None, weight=None, opset: int = 13, ratio=None,
                subgraph_tensor=None):
    """x (1, 3, 8, 8) -> Conv 4x3x3 [+ bias from a Constant] -> [Dropout] -> Flatten -> Gemm(2)."""
    from onnx import TensorProto, helper, numpy_helper
    W = weight if weight is not None else numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "W")
    F = numpy_helper.from_array(np.full((2, 4 * 6 * 6), 0.01, np.float32), "F")
    nodes, conv_in = [], ["x", "W"]
    if bias_const is not None:
        nodes.append(helper.make_node("Constant", [], ["B"], name="bias_const", value=bias_const))
        conv_in.append("B")
    node = helper.make_node("Conv", conv_in, ["c"], name="conv")
    for key, value in (conv if conv is not None else {"kernel_shape": [3, 3]}).items():
        node.attribute.append(helper.make_attribute(key, value, attr_type=helper.AttributeProto.INTS))
    nodes.append(node)
    last = "c"
    if ratio is not None:
        nodes.append(helper.make_node("Constant", [], ["r"], value=numpy_helper.from_array(np.asarray(ratio, np.float32))))
        nodes.append(helper.make_node("Dropout", ["c", "r"], ["d"], name="drop"))
        last = "d"
    if subgraph_tensor is not None:  # an If whose branch holds a constant: never run, still a tensor of the file
        branch = helper.make_graph([helper.make_node("Constant", [], ["k"], value=subgraph_tensor)], "branch", [],
                                   [helper.make_tensor_value_info("k", TensorProto.FLOAT, [4])])
        nodes.append(helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.array(True))))
        nodes.append(helper.make_node("If", ["cond"], ["unused"], then_branch=branch, else_branch=branch))
    nodes += [helper.make_node("Flatten", [last], ["f"], name="flat"),
              helper.make_node("Gemm", ["f", "F"], ["y"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [W, F])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _external(name: str, n: int = 4):
    """A float tensor whose data the model says lies in secret.bin."""
    from onnx import TensorProto
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[n])
    t.data_location = TensorProto.EXTERNAL
    entry = t.external_data.add()
    entry.key, entry.value = "location", "secret.bin"
    return t


def _save(model, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


@pytest.fixture
def onnx_dir(tmp_path, monkeypatch):
    pytest.importorskip("onnx")
    (tmp_path / "secret.bin").write_bytes(SECRET)  # beside the model and in the working directory
    monkeypatch.chdir(tmp_path)
    return tmp_path


@settings(max_examples=25, **SETTINGS)
@given(where=st.sampled_from(["initializer", "constant", "subgraph", "sparse", "attribute list"]),
       flag=st.sampled_from(["location", "entries only", "both"]))
def test_onnx_tensor_stored_outside_the_model_is_never_read(onnx_dir, where, flag):
    """Class 1: every tensor of a model file (initializer, Constant node, a subgraph's constant,
    sparse initializer, a tensor-list attribute), marked external by its data_location, by
    external_data entries alone, or both, is refused by one policy before anything reads it:
    secret.bin sits in the working directory and beside the model."""
    from onnx import TensorProto, helper, numpy_helper

    from pcldnn_gen.onnx_frontend import import_onnx
    tensor = _external("W" if where == "initializer" else "t", 108 if where == "initializer" else 4)
    if flag == "entries only":
        tensor.data_location = TensorProto.DEFAULT
    model = {"initializer": lambda: _onnx_model(weight=tensor), "constant": lambda: _onnx_model(bias_const=tensor),
             "subgraph": lambda: _onnx_model(subgraph_tensor=tensor)}.get(where, _onnx_model)()
    if where == "sparse":
        sparse = model.graph.sparse_initializer.add()
        sparse.values.CopyFrom(tensor)
        sparse.indices.CopyFrom(numpy_helper.from_array(np.arange(4, dtype=np.int64), "i"))
        sparse.dims.extend([4])
    elif where == "attribute list":
        model.graph.node[0].attribute.append(helper.make_attribute("extra", [tensor]))
    with pytest.raises(ModelImportError, match="stored in an external file") as e:
        import_onnx(_save(model, onnx_dir / "m.onnx"))
    _one_line(e.value, "m.onnx")


def test_onnx_constant_bias_inside_the_model_imports(onnx_dir):
    from onnx import numpy_helper

    from pcldnn_gen.onnx_frontend import import_onnx
    bias = np.arange(4, dtype=np.float32)
    _, state = import_onnx(_save(_onnx_model(bias_const=numpy_helper.from_array(bias, "b")), onnx_dir / "ok.onnx"))
    np.testing.assert_array_equal(state["conv.bias"], bias)


@settings(max_examples=60, **SETTINGS)
@given(strides=st.lists(st.integers(-2, 3), max_size=3), kernel=st.lists(st.integers(-1, 4), max_size=3),
       pads=st.lists(st.integers(-1, 2), max_size=5), opset=st.sampled_from([1, 6, 7, 13, 21, 22, 1000]),
       ratio=st.none() | st.lists(st.floats(-1, 2), min_size=0, max_size=2),
       dtype=st.sampled_from(["FLOAT", "DOUBLE", "INT64", "STRING", "BOOL", "FLOAT16", "COMPLEX64", "UINT64"]))
def test_onnx_graph_attributes_and_types_are_checked_before_use(onnx_dir, strides, kernel, pads, opset, ratio, dtype):
    """Class 2: geometry, element types, dropout ratios and opsets as a model file states them:
    the import translates the model or refuses it in one line naming the file; never a
    ZeroDivisionError, IndexError, TypeError or ValueError from the arithmetic."""
    from onnx import TensorProto, helper

    from pcldnn_gen.onnx_frontend import import_onnx
    conv = {"kernel_shape": kernel}
    if strides:
        conv["strides"] = strides
    if pads:
        conv["pads"] = pads
    values = np.ones(108)
    kind = getattr(TensorProto, dtype)
    weight = (helper.make_tensor("W", kind, [4, 3, 3, 3], [b"1"] * 108) if dtype == "STRING"
              else helper.make_tensor("W", kind, [4, 3, 3, 3], values.astype(complex) if "COMPLEX" in dtype else
                                      values.astype(bool) if dtype == "BOOL" else values))
    model = _onnx_model(conv, weight=weight, opset=opset, ratio=ratio)
    path = _save(model, onnx_dir / "m.onnx")
    try:
        net, state = import_onnx(path)
    except ModelImportError as e:
        _one_line(e, "m.onnx")
        return
    conv_layer = net["layers"][0]
    assert all(v >= 1 for v in conv_layer["stride"]) and conv_layer["kernel"] == [3, 3]
    assert dtype not in ("STRING", "COMPLEX64") and 7 <= opset <= 22
    assert state["conv.weight"].dtype == np.float32


def test_onnx_quoted_defects_each_name_the_node(onnx_dir):
    from pcldnn_gen.onnx_frontend import import_onnx
    for model, message in ((_onnx_model({"kernel_shape": [3, 3], "strides": [0, 0]}), r"conv \(Conv\)\.stride"),
                           (_onnx_model({"kernel_shape": [3, 3], "strides": [1]}), r"conv \(Conv\): strides \[1\]"),
                           (_onnx_model(ratio=[0.1, 0.2]), r"drop \(Dropout\): ratio of shape"),
                           (_onnx_model(opset=1000), "ai.onnx version 1000 is outside")):
        with pytest.raises(ModelImportError, match=message):
            import_onnx(_save(model, onnx_dir / "m.onnx"))


def test_import_writes_nothing_when_an_output_is_a_directory(onnx_dir, capsys):
    """Class 7: `import -o out/net.json` with out/net.json a directory leaves no net.npz behind."""
    _save(_onnx_model(), onnx_dir / "m.onnx")
    (onnx_dir / "out" / "net.json").mkdir(parents=True)
    assert main(["import", "m.onnx", "-o", "out/net.json"]) == 2
    assert "out/net.json: is a directory" in capsys.readouterr().err
    assert sorted(p.name for p in (onnx_dir / "out").iterdir()) == ["net.json"]
    dead = subprocess.Popen(["true"])
    dead.wait()  # the pid of an import killed mid-write, gone now
    (onnx_dir / "out2").mkdir()
    (onnx_dir / "out2" / f".net.npz.{dead.pid}.x1.tmp").write_bytes(b"half")
    assert main(["import", "m.onnx", "-o", "out2/net.json"]) == 0  # and a usable path works, sweeping the dead one's
    assert sorted(p.name for p in (onnx_dir / "out2").iterdir()) == ["net.json", "net.npz"]


# -- PyTorch ---------------------------------------------------------------------------------

sizes = st.one_of(st.integers(-2, 4), st.tuples(st.integers(-1, 3)), st.tuples(st.integers(-1, 3), st.integers(-1, 3)),
                  st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)), st.just("x"), st.none())


@settings(max_examples=60, **SETTINGS)
@given(stride=sizes, kernel=sizes, padding=sizes, pool=sizes, rate=st.one_of(st.floats(-1, 2), st.just([0.1, 0.2])),
       dtype=st.sampled_from(["float32", "float64", "float16", "bfloat16", "complex64", "int64"]))
def test_torch_module_attributes_devices_and_dtypes_are_checked(stride, kernel, padding, pool, rate, dtype):
    """Class 2 and 5 for from_torch: whatever a module's attributes hold, the translation
    succeeds with in-range geometry or raises one ModelImportError naming the module."""
    torch = pytest.importorskip("torch")
    import pcldnn_gen
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.5), nn.Flatten(),
                          nn.Linear(4 * 3 * 3, 2))
    model[0].stride, model[0].kernel_size, model[0].padding = stride, kernel, padding
    model[2].kernel_size, model[3].p = pool, rate
    model[5].weight = nn.Parameter(model[5].weight.detach().to(getattr(torch, dtype)), requires_grad=False)
    try:
        net, state = pcldnn_gen.from_torch(model, (3, 8, 8))
    except ModelImportError as e:
        _one_line(e, "from_torch")
        return
    conv, pooling = net["layers"][0], net["layers"][1]
    assert min(conv["stride"]) >= 1 and min(pooling["kernel"]) >= 1 and 0 <= net["layers"][2]["rate"] < 1
    assert dtype != "complex64" and all(a.dtype == np.float32 for a in state.values())


def test_torch_meta_tensors_are_refused_from_their_sizes():
    torch = pytest.importorskip("torch")
    import pcldnn_gen
    for model in (torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2, device="meta")),
                  torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(10 ** 6, 10 ** 6, device="meta"))):
        with pytest.raises(ModelImportError, match=r"parameter 1\.weight is on the meta device"):
            pcldnn_gen.from_torch(model, (3, 4, 4))
    big = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 6000))  # 294,000 floats: 1.18 MB
    pcldnn_gen.from_torch(big, (3, 4, 4))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PCLDNN_MAX_MEMORY", "1M")
        with pytest.raises(ModelImportError, match=r"take 1\.12 MiB as float32, more than the 1 MiB memory bound"):
            pcldnn_gen.from_torch(big, (3, 4, 4))


# -- .npy / .npz headers -----------------------------------------------------------------------

def _npy(header: dict, data: bytes) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + data


LIES = ("none", "negative", "huge rows", "overflow", "short", "long", "object", "fortran", "text", "labels float",
        "labels short")


@settings(max_examples=80, **SETTINGS)
@given(shape=st.lists(st.integers(1, 4), min_size=3, max_size=4), lie=st.sampled_from(LIES),
       descr=st.sampled_from(["<f4", ">f4", "|u1", "<i8", "<f2", "|b1"]), by=st.integers(1, 9))
def test_npy_headers_are_checked_against_the_file(tmp_path, shape, lie, descr, by):
    """Class 5: whatever a .npy header claims (more or less data than the file holds, 10^12
    rows, a negative or overflowing dimension, an object or text dtype, Fortran order),
    MemmapDataset maps it when it is true and refuses it in one line naming the file otherwise;
    never numpy's ValueError / OverflowError / MemoryError."""
    itemsize = np.dtype(descr).itemsize
    data = bytes(int(np.prod(shape)) * itemsize)
    header = {"descr": descr, "fortran_order": lie == "fortran", "shape": tuple(shape)}
    n = shape[0]
    if lie == "negative":
        header["shape"] = (n, -by, *shape[2:])
    elif lie == "huge rows":
        header["shape"] = (10 ** 12, *shape[1:])
    elif lie == "overflow":
        header["shape"] = (n, 2 ** 62, 2 ** 62, *shape[3:])
    elif lie in ("object", "text"):
        header["descr"] = "|O" if lie == "object" else "<U2"
    data = data[:-by] if lie == "short" else data + bytes(by) if lie == "long" else data
    (tmp_path / "x.npy").write_bytes(_npy(header, data))
    y = np.arange(n) % 3
    np.save(tmp_path / "y.npy", y.astype(np.float32) if lie == "labels float" else y[:-1] if lie == "labels short" else y)
    try:
        dataset = pr.MemmapDataset(tmp_path / "x.npy", tmp_path / "y.npy")
    except PcldnnError as e:
        _one_line(e, ".npy")
        assert lie != "none", e
        return
    assert lie == "none"
    images, labels = dataset.read(np.arange(n))
    assert images.shape == (n, *(shape[1:] if len(shape) == 4 else (1, *shape[1:])))
    np.testing.assert_array_equal(labels, y)


def test_npz_members_are_checked_before_allocation(tmp_path):
    """A member claiming 10^12 floats is refused from its header (reading it would allocate 4 TB)."""
    for shape, data in (((10 ** 12,), b"\0" * 16), ((-1, 4), b""), ((2 ** 40, 2 ** 40), b""), ((4,), b"\0" * 8)):
        path = tmp_path / "w.npz"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("fc.weight.npy", _npy({"descr": "<f4", "fortran_order": False, "shape": shape}, data))
        with pytest.raises(PcldnnError, match=r"w\.npz: fc\.weight\.npy") as e:
            read_npz(path)
        _one_line(e.value, "w.npz")
    np.savez(tmp_path / "ok.npz", a=np.arange(6, dtype=np.float32).reshape(2, 3), b=np.zeros(300_000, np.float32))
    np.testing.assert_array_equal(read_npz(tmp_path / "ok.npz")["a"], np.arange(6).reshape(2, 3))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PCLDNN_MAX_MEMORY", "1M")  # 1.2 MB of arrays
        with pytest.raises(PcldnnError, match=r"ok\.npz: 1\.14 MiB of arrays, more than the 1 MiB memory bound"):
            read_npz(tmp_path / "ok.npz")


def test_sample_indices_are_checked_before_conversion(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((5, 1, 2, 2), np.uint8))
    np.save(tmp_path / "y.npy", np.arange(5))
    data = pr.MemmapDataset(tmp_path / "x.npy", tmp_path / "y.npy")
    for bad in ([2 ** 70], [2 ** 63], [-1], [1.5], [[1, 2]], ["a"]):
        with pytest.raises(PcldnnError, match="x: sample ind"):
            data.read(bad)
    assert data.read(np.array([4, 0], np.uint64))[1].tolist() == [4, 0]


# -- labels ----------------------------------------------------------------------------------

@settings(max_examples=80, **SETTINGS)
@given(dtype=st.sampled_from(["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]),
       values=st.lists(st.integers(-2 ** 63, 2 ** 64 - 1), min_size=1, max_size=6), classes=st.integers(1, 300))
def test_labels_never_wrap(tmp_path, dtype, values, classes):
    """Class 3: labels are integers in [0, classes) on every path, checked in their own dtype:
    a dataset reads back exactly the stored values, or refuses them; check_classes refuses
    any label outside the net's classes."""
    info = np.iinfo(dtype)
    y = np.array([v for v in values if info.min <= v <= info.max] or [0], dtype=dtype)
    x = np.zeros((len(y), 1, 2, 2), np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    for make in (lambda: pr.ArrayDataset(x, y), lambda: pr.MemmapDataset(tmp_path / "x.npy", tmp_path / "y.npy")):
        try:
            data = make()
        except PcldnnError as e:
            assert "labels must lie in [0, 2147483648)" in str(e) and (int(y.min()) < 0 or int(y.max()) >= 2 ** 31)
            continue
        got = data.read(np.arange(len(y)))[1]
        assert [int(v) for v in got] == [int(v) for v in y]  # no wrap
        if int(y.max()) >= classes:
            with pytest.raises(PcldnnError, match=f"the net has {classes} classes"):
                data.check_classes(classes)
        else:
            data.check_classes(classes)


@pytest.fixture(scope="module")
def small_net(tmp_path_factory):
    return build_and_load(tmp_path_factory.mktemp("h"), TRAIN_LAYERS, TRAIN_SHAPE, ISA, name="hard", threads=1)


def test_evaluate_and_fit_check_labels_before_work(small_net):
    net = small_net
    trainer = pr.Trainer(net, pr.SGD(0.01))
    x = np.zeros((6, *TRAIN_SHAPE), np.float32)
    with pytest.raises(PcldnnError, match=r"evaluation data: labels must lie in \[0, 2147483648\)"):
        trainer.evaluate(x, np.array([0, 1, 2, 3, 4, -1]))  # would index the last class
    with pytest.raises(PcldnnError, match=r"layer loss: labels must lie in \[0, 5\)"):
        trainer.evaluate(x, np.array([0, 1, 2, 3, 4, 5]))  # was an IndexError
    good, bad = pr.ArrayDataset(x, np.arange(6) % 5), pr.ArrayDataset(x, np.arange(6))
    with pytest.raises(PcldnnError, match=r"data: labels must lie in \[0, 5\) \(the net has 5 classes\)"):
        trainer.fit(good, bad, epochs=1, batch_size=2, progress=False)
    assert trainer.step_count == 0  # refused before the first step, not after the run


def test_non_finite_input_gradient_or_weights_stop_training(small_net):
    """Class 3: NaN in the images (a fused ReLU maps it to 0, so the loss stays finite) stops
    the step before any weight changes, naming the step and the layer; so does a gradient
    that overflowed, before the update."""
    net = small_net
    trainer = pr.Trainer(net, pr.SGD(0.01))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, *TRAIN_SHAPE)).astype(np.float32)
    labels = np.array([0, 1, 2, 3])
    trainer.step(x, labels)
    before = net.params.copy()
    x[2, 1, 3, 3] = np.nan
    with pytest.raises(NonFiniteError, match=r"step 1: input sample 2 of the minibatch holds NaN or infinity \(layer conv1"):
        trainer.step(x, labels)
    np.testing.assert_array_equal(net.params, before)
    x[2, 1, 3, 3] = 0
    start, stop = net.param_ranges["fc1"]
    net.params[start] = np.float32(3e38)  # one huge weight: inf activations, NaN gradients below
    with pytest.raises(NonFiniteError, match=r"step 1: the (gradient|updated weights) of layer \w+ hold NaN"):
        trainer.step(x * 1e5, labels)
    net.params[:] = before
    # finite gradients, an update that overflows: the build's update kernel flags the weights
    # as it writes them (and the numpy form, for builds without one, checks them after)
    for kernel in (True, False):
        opt = pr.SGD(2.0, weight_decay=1.0)
        opt.bind(net)
        assert opt._kernel is not None
        if not kernel:
            opt._kernel = None
        p, g = np.zeros_like(net.params), np.zeros_like(net.grads)
        start, stop = net.param_ranges["fc2"]
        p[stop - 1] = np.float32(3e38)  # 3e38 * (1 + 2 * 1.0) overflows
        with pytest.raises(NonFiniteError, match=r"step 7: the updated weights of layer fc2 hold NaN or infinity"):
            opt.apply(p, g, 7)
        p[stop - 1] = 1.0
        opt.apply(p, g, 8)  # and a finite update passes


# -- image modes -----------------------------------------------------------------------------

@settings(max_examples=30, **SETTINGS)
@given(mode=st.sampled_from(["1", "L", "P", "RGB", "RGBA", "LA", "I;16", "I", "F", "CMYK"]),
       channels=st.sampled_from([1, 3]), seed=st.integers(0, 100))
def test_every_image_mode_is_scaled_to_unit_range_or_refused(tmp_path, mode, channels, seed):
    """Class 6: whichever mode the decoder opens, pixels come out as value / full scale of the
    mode (255 for 8-bit, 65535 for 16-bit grey), or the image is refused naming the file."""
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(seed)
    root = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example: tmp_path is shared
    folder = root / "a"
    folder.mkdir()
    if mode in ("I;16", "I"):
        grey = rng.integers(0, 65536, (4, 5)).astype(np.uint16)
        Image.fromarray(grey).save(folder / "im.png")  # a 16-bit grey PNG (opened as I;16 or I)
        want = grey.astype(np.float64) / 65535
        want = np.repeat(want[None], channels, axis=0)
    else:
        base = Image.fromarray(rng.integers(0, 256, (4, 5, 3)).astype(np.uint8))
        im = base.convert(mode) if mode != "F" else Image.fromarray(rng.random((4, 5)).astype(np.float32))
        suffix = ".tif" if mode in ("F", "CMYK") else ".png"
        im.save(folder / f"im{suffix}")
        with Image.open(folder / f"im{suffix}") as back:
            ref = np.asarray(back.convert("RGB" if channels == 3 else "L"), np.float64) / 255 if mode != "F" else None
        want = None if ref is None else (ref[None] if channels == 1 else ref.transpose(2, 0, 1))
    data = pr.ImageFolder(root, size=(4, 5), channels=channels)
    try:
        x, y = data.read([0])
    except PcldnnError as e:
        _one_line(e, "im.")
        assert want is None, e  # only the modes without a defined full scale are refused
        return
    assert want is not None and y.tolist() == [0]
    np.testing.assert_allclose(x[0], want, atol=1e-6)


# -- files the tools write ---------------------------------------------------------------------

def test_tune_checks_the_database_and_lock_paths_before_measuring(tmp_path, monkeypatch, capsys):
    from pcldnn_gen import tuner
    monkeypatch.setattr(tuner, "measure_peak", lambda *a: pytest.fail("measured before checking the paths"))
    (tmp_path / "file").write_text("x")
    (tmp_path / "db.json.lock").mkdir()
    net = str(Path(__file__).parent.parent / "examples" / "nets" / "digits.json")
    for db, message in ((tmp_path / "file" / "db.json", "file is not a directory"),
                        (tmp_path / "db.json", "db.json.lock: is a directory")):
        monkeypatch.setenv("PCLDNN_TUNING_DB", str(db))
        assert main(["tune", net, "--arch", ISA]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_a_killed_compile_leaves_nothing_the_next_one_keeps(tmp_path, monkeypatch):
    """Class 7: a compile killed mid-way leaves its temporary library in the cache entry's
    folder, and the build its staging folder: the next compile of that kernel and build sweeps
    them (under the locks no live compile holds)."""
    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import parse_netspec
    monkeypatch.setenv("PCLDNN_CACHE_DIR", str(tmp_path / "cache"))
    net = parse_netspec({"name": "sweep", "input": {"channels": 3, "height": 8, "width": 8},
                         "layers": TRAIN_LAYERS})
    out = tmp_path / "b"
    build(net, get_arch(ISA), out)
    libs = sorted((tmp_path / "cache").glob("??/*.so"))
    key = libs[0].name[:-3]
    dead = [libs[0].parent / f".{key[:16]}.dead1234.so.tmp", libs[0].parent / f".{key}.c.dead.tmp"]
    for path in dead:
        path.write_bytes(b"half a library")
    for path in (libs[0], libs[0].with_suffix(".so.sha256")):
        path.unlink()  # the killed compile never installed it
    stage = tmp_path / ".b.staging-dead"
    (stage / "src").mkdir(parents=True)
    build(net, get_arch(ISA), out)
    assert not any(p.exists() for p in dead) and not stage.exists() and libs[0].exists()


# -- pcldnn-gen train: every input and output checked first -----------------------------------

@pytest.fixture
def no_build(monkeypatch):
    """`train` must refuse before compiling: building fails the test."""
    from pcldnn_gen import train_cli
    monkeypatch.setattr(train_cli, "build", lambda *a, **k: pytest.fail("compiled before checking the inputs"))


def test_train_checks_options_and_paths_before_compiling(tmp_path, monkeypatch, capsys, no_build):
    monkeypatch.chdir(tmp_path)
    net = str(Path(__file__).parent.parent / "examples" / "nets" / "digits.json")
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    x = np.zeros((8, 1, 16, 16), np.float32)
    np.save("x.npy", x)
    np.save("y.npy", np.arange(8) % 10)
    np.save("ybig.npy", np.array([0, 1, 2, 3, 4, 5, 6, 2 ** 32 + 1], np.int64))
    np.save("yu.npy", np.array([0, 1, 2, 3, 4, 5, 6, 2 ** 63], np.uint64))
    np.save("yval.npy", np.array([0, 1, 2, 3, 4, 5, 6, 10]))
    np.save("yneg.npy", np.array([0, 1, 2, 3, 4, 5, 6, -1]))
    npy = ["--data", "x.npy", "--labels", "y.npy"]
    for extra, message in (
            (["--data", "x.npy", "--labels", "ybig.npy"], "ybig.npy: labels must lie in [0, 2147483648)"),
            (["--data", "x.npy", "--labels", "yu.npy"], "got values from 0 to 9223372036854775808"),
            (npy + ["--val", "x.npy", "--val-labels", "yval.npy"], "--val x: labels must lie in [0, 10)"),
            (npy + ["--val", "x.npy", "--val-labels", "yneg.npy"], "yneg.npy: labels must lie in [0, 2147483648)"),
            (npy + ["--metrics", "file/m.jsonl"], "--metrics file/m.jsonl: file is not a directory"),
            (npy + ["--metrics", "dir"], "--metrics dir: is a directory"),
            (npy + ["--plot", "file/p.png"], "--plot file/p.png: file is not a directory"),
            (npy + ["--plot", "p.txt"], "--plot: p.txt: the picture's format"),
            (["--data", "synthetic", "--val", "nothere.npy", "--val-labels", "y.npy"], "--val nothere.npy: no such file"),
            (npy + ["--batch-size", "0"], "--batch-size: must be a positive int"),
            (npy + ["--batch-size", "9"], "--batch-size 9 is larger than the 8 training samples"),
            (npy + ["--checkpoint-dir", "file"], "--checkpoint-dir file: exists and is not a directory"),
            (npy + ["--resume", "nothere.npz"], "--resume nothere.npz: no such file"),
            (npy + ["--resume", "x.npy"], "x.npy: not a readable pcldnn checkpoint"),
            (npy + ["--momentum", "1"], "--momentum: must be a number in [0, 1)")):
        assert main(["train", net, "--arch", ISA, "--no-progress", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (extra, err)
    np.save("xnan.npy", np.where(np.arange(8 * 256).reshape(8, 1, 16, 16) == 300, np.nan, 0).astype(np.float32))
    assert main(["train", net, "--arch", ISA, "--data", "xnan.npy", "--labels", "y.npy", "--batch-size", "4"]) == 2
    assert "xnan: sample 1 holds NaN or infinity" in capsys.readouterr().err  # normalisation reads it first
    assert not (tmp_path / "build").exists()


def test_train_stops_on_nan_images_without_normalisation(tmp_path, monkeypatch, capsys):
    """Class 3 end to end: with --no-normalize the NaN reaches the first step, which stops."""
    monkeypatch.chdir(tmp_path)
    net = tmp_path / "net.json"
    net.write_text(json.dumps({"name": "nan_net", "input": {"channels": 3, "height": 8, "width": 8},
                               "layers": TRAIN_LAYERS}))
    x = np.random.default_rng(0).random((16, 3, 8, 8)).astype(np.float32)
    x[5, 0, 2, 2] = np.nan
    np.save("x.npy", x)
    np.save("y.npy", np.arange(16) % 5)
    code = main(["train", str(net), "--arch", ISA, "--data", "x.npy", "--labels", "y.npy", "--no-normalize",
                 "--batch-size", "16", "--epochs", "1", "--no-progress", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "step 0: input sample" in err and "layer conv1's input" in err, err


def test_train_checks_the_parallel_mapping_before_compiling(tmp_path, monkeypatch, capsys, no_build):
    """Under mpiexec, a --parallel mapping that names no layer, a conv, or a group size that
    does not divide the ranks is refused from the net description (was: after the compile)."""
    from pcldnn_gen import train_cli

    class TwoRanks:
        size, rank, aborted = 2, 0, None

        def Abort(self, code):
            TwoRanks.aborted = code

    monkeypatch.setattr(train_cli, "world", TwoRanks)
    net = str(Path(__file__).parent.parent / "examples" / "nets" / "digits.json")
    for mapping, message in (('{"nothing*": "model"}', "matches no layer with weights"),
                             ('{"conv1": "model"}', "only fc layers can be model parallel"),
                             ('{"fc*": "model:3"}', "must divide the 2 ranks")):
        assert main(["train", net, "--arch", ISA, "--data", "synthetic", "--parallel", mapping]) == 2
        assert message in capsys.readouterr().err and TwoRanks.aborted == 2
