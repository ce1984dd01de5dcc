"""Training data: minibatches over numpy arrays, the digits set that ships with scikit-learn,
and a synthetic generator for tests and benchmarks. Nothing is downloaded."""
from __future__ import annotations

import numpy as np

from .errors import PcldnnError
from .validate import Fields


class ArrayDataset:
    """Images (N, C, H, W) float32 and integer labels (N,), optionally normalised per channel."""

    def __init__(self, x: np.ndarray, y: np.ndarray, name: str = "data"):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim != 4:
            raise PcldnnError(f"{name}: images must be (N, C, H, W), got shape {x.shape}")
        if y.shape != (x.shape[0],):
            raise PcldnnError(f"{name}: labels must be ({x.shape[0]},) to match the images, got {y.shape}")
        if not np.issubdtype(y.dtype, np.integer):
            raise PcldnnError(f"{name}: labels must be integers, got {y.dtype}")
        if x.shape[0] == 0:
            raise PcldnnError(f"{name}: no samples")
        self.x = np.ascontiguousarray(x, dtype=np.float32)
        self.y = y.astype(np.int32)
        self.name = name

    def __len__(self) -> int:
        return self.x.shape[0]

    def channel_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and standard deviation (compute them on the training split)."""
        x = self.x.astype(np.float64)
        return x.mean(axis=(0, 2, 3)), x.std(axis=(0, 2, 3))

    def normalized(self, mean, std) -> "ArrayDataset":
        mean, std = (np.asarray(a, np.float32).reshape(1, -1, 1, 1) for a in (mean, std))
        return ArrayDataset((self.x - mean) / np.maximum(std, 1e-8), self.y, self.name)

    def batches(self, batch_size: int, order: np.ndarray | None = None):
        """(x, y) minibatches of exactly `batch_size` in `order` (default: as stored); a last
        partial batch is dropped so that every step has the same shape."""
        if batch_size > len(self):
            raise PcldnnError(f"{self.name}: batch size {batch_size} is larger than the {len(self)} samples")
        order = np.arange(len(self)) if order is None else order
        for start in range(0, len(self) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield self.x[idx], self.y[idx]


def digits(size: int = 16, test_fraction: float = 0.2, seed: int = 0) -> tuple[ArrayDataset, ArrayDataset]:
    """scikit-learn's bundled handwritten digits (1,797 images of 8x8, 10 classes), upsampled
    to `size` x `size` by pixel repetition, split into (train, test) by a fixed seeded
    permutation, both normalised with the training split's mean and deviation."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise PcldnnError("the digits data set ships with scikit-learn: pip install 'pcldnn-gen[demo]'") from None
    if size % 8:
        raise PcldnnError(f"digits: size must be a multiple of 8, got {size}")
    bunch = load_digits()
    x = bunch.images.astype(np.float32)[:, None] / 16.0
    x = x.repeat(size // 8, axis=2).repeat(size // 8, axis=3)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test_idx, train_idx = order[:n_test], order[n_test:]
    train = ArrayDataset(x[train_idx], bunch.target[train_idx], "digits-train")
    test = ArrayDataset(x[test_idx], bunch.target[test_idx], "digits-test")
    mean, std = train.channel_stats()
    return train.normalized(mean, std), test.normalized(mean, std)


def synthetic(n: int, shape: tuple[int, int, int], classes: int, seed: int = 0, noise: float = 1.0,
              split: int = 0) -> ArrayDataset:
    """A learnable random set: each class has a fixed random pattern (drawn from `seed`); a
    sample is its class's pattern plus Gaussian noise of deviation `noise`. Splits of one seed
    share the patterns and draw their samples independently (train: split 0, test: split 1)."""
    f = Fields("synthetic")
    f.int_in(n, "n", 1, 1 << 24)
    f.int_in(classes, "classes", 1, 1 << 20)
    f.array(list(shape) if isinstance(shape, tuple) else shape, "shape", 3, 3)
    for i, d in enumerate(shape):
        f.int_in(d, f"shape[{i}]", 1, 1 << 14)
    f.number_in(noise, "noise", 0, 1e6)
    f.int_in(seed, "seed", 0, 2 ** 63 - 1)
    f.int_in(split, "split", 0, 2 ** 31)
    patterns = np.random.default_rng(np.random.SeedSequence([seed])).standard_normal((classes, *shape)).astype(np.float32)
    rng = np.random.default_rng(np.random.SeedSequence([seed, split + 1]))
    labels = rng.integers(0, classes, n)
    x = patterns[labels] + noise * rng.standard_normal((n, *shape)).astype(np.float32)
    return ArrayDataset(x, labels, f"synthetic-{seed}-{split}")
