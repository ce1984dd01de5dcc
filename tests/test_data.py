"""Datasets and the streaming data path: augmentations drawn per sample from (seed, epoch,
index), chunked statistics, memory-mapped and image-folder datasets (hostile files refused),
fit reading one minibatch at a time in background threads, iterables of batches."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers import RUNNABLE_ISAS, TRAIN_LAYERS, TRAIN_SHAPE, build_and_load

import pcldnn_runtime as pr
from pcldnn_runtime import PcldnnError
from pcldnn_runtime.data import Dataset, prefetched

rng = np.random.default_rng(0)


def _arrays(n=40, shape=TRAIN_SHAPE, classes=5, seed=0):
    g = np.random.default_rng(seed)
    return g.standard_normal((n, *shape)).astype(np.float32), g.integers(0, classes, n)


def test_augmentation_depends_only_on_seed_epoch_and_index():
    x, y = _arrays(30, (2, 6, 7))
    data = pr.ArrayDataset(x, y, augment=pr.Augment(crop_padding=2, flip=True, seed=3))
    whole, _ = data.read(np.arange(30), epoch=4)
    for picks in ([5, 1, 29], [29], [1, 5]):  # any batch composition, any order (another rank's shard)
        part, labels = data.read(picks, epoch=4)
        np.testing.assert_array_equal(part, whole[picks])
        np.testing.assert_array_equal(labels, y[picks])
    assert not np.array_equal(data.read(np.arange(30), epoch=5)[0], whole)  # a new epoch, new draws
    np.testing.assert_array_equal(data.read(np.arange(30))[0], x)  # evaluation reads: no augmentation
    # every output is a window of the zero-padded image, mirrored or not; offsets and flips vary
    padded = np.pad(x, ((0, 0), (0, 0), (2, 2), (2, 2)))
    seen_offsets, flips = set(), 0
    for i in range(30):
        matches = [(dy, dx, f) for dy in range(5) for dx in range(5) for f in (0, 1)
                   if np.array_equal(whole[i], (lambda w: w[..., ::-1] if f else w)(padded[i, :, dy:dy + 6, dx:dx + 7]))]
        assert matches, i
        seen_offsets.add(matches[0][:2])
        flips += matches[0][2]
    assert len(seen_offsets) > 5 and 5 <= flips <= 25


def test_chunked_channel_stats_match_numpy():
    x = (rng.standard_normal((50, 3, 4, 5)) * [[[[1.0]], [[5.0]], [[0.1]]]] + [[[[100.0]], [[-3.0]], [[0.0]]]])
    data = pr.ArrayDataset(x.astype(np.float32), np.zeros(50, np.int64))
    want_mean, want_std = x.astype(np.float32).astype(np.float64).mean(axis=(0, 2, 3)), \
        x.astype(np.float32).astype(np.float64).std(axis=(0, 2, 3))
    for chunk in (1, 7, 1000):
        mean, std = data.channel_stats(chunk=chunk)
        np.testing.assert_allclose(mean, want_mean, rtol=1e-12)
        np.testing.assert_allclose(std, want_std, rtol=1e-9)
    normed = pr.ArrayDataset(x.astype(np.float32), np.zeros(50, np.int64)).with_normalization(want_mean, want_std)
    got, _ = normed.read(np.arange(50))
    np.testing.assert_allclose(got.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(got.std(axis=(0, 2, 3)), 1, atol=1e-4)


def test_memmap_dataset_reads_rows_and_refuses_bad_files(tmp_path):
    images = rng.integers(0, 256, (20, 5, 6), dtype=np.uint8)
    labels = rng.integers(0, 3, 20).astype(np.int16)
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", labels)
    data = pr.MemmapDataset(tmp_path / "x.npy", tmp_path / "y.npy")
    assert len(data) == 20
    x, y = data.read([7, 2, 19])
    np.testing.assert_array_equal(x, images[[7, 2, 19]][:, None].astype(np.float32) * np.float32(1 / 255))
    np.testing.assert_array_equal(y, labels[[7, 2, 19]])
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}] * 20, dtype=object))
    np.save(tmp_path / "f.npy", np.asfortranarray(np.zeros((20, 2, 3, 4), np.float32)))
    np.save(tmp_path / "y3.npy", np.zeros(19, np.int32))
    np.save(tmp_path / "yf.npy", np.zeros(20, np.float32))
    (tmp_path / "junk.npy").write_bytes(b"\x93NUMPY junk" * 10)
    for xs, ys, message in (("obj.npy", "y.npy", "holds object, expected plain numbers"),
                            ("f.npy", "y.npy", "Fortran-ordered"),
                            ("x.npy", "y3.npy", r"labels must be \(20,\) integers"),
                            ("x.npy", "yf.npy", "y[f]?.npy: holds float32, expected plain numbers .signed int, unsigned"),
                            ("junk.npy", "y.npy", "junk.npy: not a .npy array"),
                            ("missing.npy", "y.npy", "missing.npy")):
        with pytest.raises(PcldnnError, match=message):
            pr.MemmapDataset(tmp_path / xs, tmp_path / ys)
    with pytest.raises(PcldnnError, match=r"sample index out of range \[0, 20\)"):
        data.read([20])


def test_image_folder_decodes_resizes_and_names_broken_files(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    pictures = {}
    for cls, mode, size in (("cat", "RGB", (9, 7)), ("dog", "L", (12, 12)), ("dog", "RGBA", (6, 6))):
        (tmp_path / cls).mkdir(exist_ok=True)
        a = rng.integers(0, 256, (size[1], size[0], {"RGB": 3, "L": 1, "RGBA": 4}[mode]), dtype=np.uint8)
        im = Image.fromarray(a.squeeze(-1) if mode == "L" else a, mode)
        name = tmp_path / cls / f"{mode}.png"
        im.save(name)
        pictures[name] = im
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    data = pr.ImageFolder(tmp_path, size=(8, 10))
    assert data.classes == ["cat", "dog"] and len(data) == 3
    x, y = data.read([0, 1, 2])
    assert x.shape == (3, 3, 8, 10) and list(y) == [0, 1, 1]
    for i, f in enumerate(data.files):
        want = np.asarray(pictures[f].convert("RGB").resize((10, 8), Image.Resampling.BILINEAR), np.float32) / 255
        np.testing.assert_allclose(x[i], want.transpose(2, 0, 1), atol=1e-6)
    (tmp_path / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    data = pr.ImageFolder(tmp_path, size=(8, 10), channels=1)
    with pytest.raises(PcldnnError, match=r"broken\.png: cannot decode the image"):
        data.read(np.arange(len(data)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PcldnnError, match="no images found"):
        pr.ImageFolder(tmp_path / "empty", size=(4, 4))
    with pytest.raises(PcldnnError, match="size"):
        pr.ImageFolder(tmp_path, size=(0, 4))


class _Recording(Dataset):
    """An in-memory dataset that records what each read asked for and how many reads overlap."""

    def __init__(self, x, y, delay=0.0):
        self.x, self.y, self.delay = x, y, delay
        self.reads: list[np.ndarray] = []
        self.active = self.most_active = 0
        self.lock = threading.Lock()

    def __len__(self):
        return len(self.y)

    def _load(self, indices):
        with self.lock:
            self.reads.append(indices.copy())
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        time.sleep(self.delay)
        with self.lock:
            self.active -= 1
        return self.x[indices], self.y[indices].astype(np.int32)


def test_prefetch_keeps_order_and_a_bounded_number_of_reads_in_flight():
    x, y = _arrays(64)
    data = _Recording(x, y, delay=0.01)
    picks = [np.arange(i, i + 4) for i in range(0, 64, 4)]
    got = list(prefetched(data, picks, None, workers=3, ahead=2))
    for p, (xb, yb) in zip(picks, got):
        np.testing.assert_array_equal(xb, x[p])
        np.testing.assert_array_equal(yb, y[p])
    assert len(got) == 16 and data.most_active == 2  # 3 workers, but never more than 2 batches ahead


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return build_and_load(tmp_path_factory.mktemp("data"), TRAIN_LAYERS, TRAIN_SHAPE, RUNNABLE_ISAS[-1],
                          name="data").build_dir


def _trainer(build, seed=0):
    return pr.Trainer(pr.load(build, threads=1, seed=seed), pr.SGD(0.05, momentum=0.9), seed=7)


def test_fit_streams_batches_and_matches_in_memory_arrays(build, tmp_path):
    x, y = _arrays(40)
    recording = _Recording(x, y)
    a = _trainer(build)
    a.fit(recording, epochs=2, batch_size=8, progress=False)
    assert all(len(r) == 8 for r in recording.reads)  # one minibatch per read, never the whole set
    assert len(recording.reads) == 10
    np.testing.assert_array_equal(np.sort(np.concatenate(recording.reads[:5])), np.arange(40))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    b = _trainer(build)
    b.fit(pr.MemmapDataset(tmp_path / "x.npy", tmp_path / "y.npy"), epochs=2, batch_size=8, progress=False)
    c = _trainer(build)  # an iterable of batches in the same order
    c.fit([(x[o], y[o]) for o in c.epoch_order(0, 40).reshape(5, 8)], epochs=1, progress=False)
    c.fit([(x[o], y[o]) for o in c.epoch_order(1, 40).reshape(5, 8)], epochs=2, progress=False)
    for other in (b, c):
        np.testing.assert_array_equal(other.net.params, a.net.params)
    assert c.step_count == 10
    ev = a.evaluate(pr.MemmapDataset(tmp_path / "x.npy", tmp_path / "y.npy"), batch_size=7)
    want = a.evaluate(x, y)
    assert ev["loss"] == pytest.approx(want["loss"], rel=1e-6) and ev["accuracy"] == want["accuracy"]


def test_fit_refuses_used_up_generators_and_unpaired_batches(build):
    x, y = _arrays(16)
    gen = ((x[i:i + 8], y[i:i + 8]) for i in (0, 8))
    with pytest.raises(PcldnnError, match="gave no batches in epoch 2"):
        _trainer(build).fit(gen, epochs=2, progress=False)
    with pytest.raises(PcldnnError, match="do not pair up"):
        _trainer(build).fit([(x[:8], y[:7])], epochs=1, progress=False)
    with pytest.raises(PcldnnError, match="not an \\(x, labels\\) pair"):
        _trainer(build).fit([x[:8]], epochs=1, progress=False)
    with pytest.raises(PcldnnError, match="batch_size must be a positive int"):
        _trainer(build).fit(pr.ArrayDataset(x, y), epochs=1, progress=False)
    with pytest.raises(PcldnnError, match="workers must be an int"):
        _trainer(build).fit(pr.ArrayDataset(x, y), epochs=1, batch_size=8, workers=0, progress=False)


def test_predict_in_chunks_equals_one_forward(build):
    net = pr.load(build, threads=1)
    x, y = _arrays(23)
    want = net.forward(x)
    for got in (net.predict(x, batch_size=5), net.predict(pr.ArrayDataset(x, y), batch_size=4)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    with pytest.raises(PcldnnError, match="batch_size must be an int"):
        net.predict(x, batch_size=0)
    for size in (3, 7, 9, 11):  # any number of sizes: the workspaces stay bounded
        net.predict(x, batch_size=size)
    assert len(net._workspaces) <= pr.net.MAX_WORKSPACES
    assert np.isfinite(net.loss_and_grad(x[:6], y[:6]))  # training on yet another size still works
    assert len(net._workspaces) <= pr.net.MAX_WORKSPACES
