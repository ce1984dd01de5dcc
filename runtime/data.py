"""Training data. A dataset is anything with `len()` and `read(indices, epoch=None)` returning
(float32 images (k, C, H, W), int32 labels (k,)) for those samples: `fit` and `evaluate` read one
minibatch at a time (this rank's rows only, under MPI), in background threads a bounded number
of batches ahead, and never copy a whole dataset. In-memory arrays (`ArrayDataset`), .npy files
read through memory maps (`MemmapDataset`) and class-per-folder image trees (`ImageFolder`) are
datasets; any iterable of (x, labels) numpy batches also trains. Augmentations draw from (seed,
epoch, sample index), so p ranks see exactly what one process would. Nothing is downloaded: the
digits set ships with scikit-learn, `synthetic` is generated."""
from __future__ import annotations

import concurrent.futures
import mmap
import os
import stat
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import npyfile
from .errors import PcldnnError
from .validate import Fields, open_regular, show

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".gif", ".tif", ".tiff", ".webp")
STATS_CHUNK = 512  # samples per read when computing channel statistics
LABEL_LIMIT = 1 << 31  # labels are int32 inside: anything at or above is no class index
# Pillow modes by the value that means full intensity: 8-bit modes convert to RGB / L as they
# are; 16-bit grey scales by 1/65535 (a plain convert to L would clip it to 0 / 255). "I" (32-bit
# int) and "F" (float) have no defined range and are refused, except "I" from a PNG, whose
# samples are at most 16 bits (older Pillow opens 16-bit grey PNGs so).
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
EIGHT_BIT_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "HSV", "LAB")


def checked_labels(y: Any, origin: str, classes: int | None = None) -> np.ndarray:
    """Integer labels as int32, every one checked in [0, classes) (without `classes`: in
    [0, 2^31)) before the conversion, so no value wraps (2^32 + 1 is not 1)."""
    y = np.asarray(y)
    if y.dtype.kind not in "iu":
        raise PcldnnError(f"{origin}: labels must be integers, got {y.dtype}")
    top = LABEL_LIMIT if classes is None else classes
    if y.size:
        lo, hi = int(y.min()), int(y.max())  # Python ints: exact for every integer dtype
        if lo < 0 or hi >= top:
            bad = int(np.flatnonzero((y < 0) | (y >= top))[0]) if y.ndim == 1 else None
            raise PcldnnError(f"{origin}: labels must lie in [0, {top})"
                              + ("" if classes is None else f" (the net has {classes} classes)")
                              + f", got values from {lo} to {hi}" + ("" if bad is None else f" (first at sample {bad})"))
    return y.astype(np.int32)


def _hash_uniform(seed: int, epoch: int, indices: np.ndarray, stream: int) -> np.ndarray:
    """Uniform [0, 1) numbers, one per sample index, from SplitMix64 of (seed, epoch, index,
    stream): the same for a sample whichever process reads it, and cheap for a whole batch."""
    with np.errstate(over="ignore"):
        z = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(epoch) * np.uint64(0xBF58476D1CE4E5B9)
             + np.uint64(stream) * np.uint64(0x94D049BB133111EB) + indices.astype(np.uint64))
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = (z ^ (z >> np.uint64(shift))) * np.uint64(mult)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass(frozen=True)
class Augment:
    """Random crop with zero padding (`crop_padding` pixels on each side, then a window of the
    image's size) and horizontal flip (probability 1/2), the standard CIFAR / ImageNet-style
    training augmentations. Each sample's draws come from (seed, epoch, its index)."""
    crop_padding: int = 4
    flip: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        f = Fields("Augment")
        f.int_in(self.crop_padding, "crop_padding", 0, 1 << 12)
        f.int_in(self.seed, "seed", 0, 2 ** 63 - 1)
        if not isinstance(self.flip, bool):
            f.fail("flip", f"must be true or false, got {show(self.flip)}")

    def apply(self, x: np.ndarray, indices: np.ndarray, epoch: int) -> np.ndarray:
        n, _, h, w = x.shape
        out = x
        p = self.crop_padding
        if p:
            padded = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
            dy = np.minimum((_hash_uniform(self.seed, epoch, indices, 1) * (2 * p + 1)).astype(np.int64), 2 * p)
            dx = np.minimum((_hash_uniform(self.seed, epoch, indices, 2) * (2 * p + 1)).astype(np.int64), 2 * p)
            out = np.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
        if self.flip:
            flip = _hash_uniform(self.seed, epoch, indices, 3) < 0.5
            out = out.copy() if out is x else out
            out[flip] = out[flip][..., ::-1]
        return np.ascontiguousarray(out, dtype=np.float32)


class Dataset:
    """Samples by index. Subclasses implement `__len__` and `_load(indices)` (raw float32
    images and int32 labels); `read` adds the augmentation (training reads: `epoch` given) and
    the per-channel normalisation."""

    name = "data"
    augment: Augment | None = None
    mean: np.ndarray | None = None  # per channel, applied after augmentation
    std: np.ndarray | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def _load(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return tuple(self._load(np.arange(1))[0].shape[1:])  # type: ignore[return-value]

    def all_labels(self) -> np.ndarray | None:
        """Every sample's label (int32, checked when the dataset was opened); None where only
        reading the samples would tell (a subclass's own data: each batch is checked as read)."""
        return None

    def check_classes(self, classes: int) -> None:
        """An error naming the dataset unless every label lies in [0, classes): what `fit` and
        `pcldnn-gen train` check before the first step."""
        labels = self.all_labels()
        if labels is not None:
            checked_labels(labels, self.name, classes)

    def read(self, indices: Any, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        indices = self._indices(indices)
        x, y = self._load(indices)
        if epoch is not None and self.augment is not None:
            x = self.augment.apply(x, indices, epoch)
        if self.mean is not None and self.std is not None:
            x = (x - self.mean.reshape(1, -1, 1, 1)) / self.std.reshape(1, -1, 1, 1)
        return np.ascontiguousarray(x, dtype=np.float32), y

    def _indices(self, indices: Any) -> np.ndarray:
        """Sample indices as int64, each checked in [0, len) first (no wrap, no float truncation)."""
        try:
            a = np.asarray(indices)
        except (ValueError, TypeError, OverflowError) as e:
            raise PcldnnError(f"{self.name}: sample indices must be a list of ints ({e})") from None
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise PcldnnError(f"{self.name}: sample indices must be a 1-D list of ints in [0, {len(self)}), got "
                              f"{a.dtype} of shape {a.shape}")
        if a.size and (int(a.min()) < 0 or int(a.max()) >= len(self)):
            raise PcldnnError(f"{self.name}: sample index out of range [0, {len(self)}): got {int(a.min())} .. "
                              f"{int(a.max())}")
        return a.astype(np.int64)

    def channel_stats(self, chunk: int = STATS_CHUNK) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and standard deviation of the raw samples (no augmentation, no
        normalisation), read `chunk` samples at a time in float64."""
        Fields("channel_stats").int_in(chunk, "chunk", 1, 1 << 20)
        c = self.sample_shape[0]
        count, mean, m2 = 0, np.zeros(c), np.zeros(c)  # chunks merged as in Chan et al.'s parallel variance
        for start in range(0, len(self), chunk):
            x, _ = self._load(np.arange(start, min(start + chunk, len(self))))
            x = x.astype(np.float64)
            finite = np.isfinite(x).reshape(len(x), -1).all(axis=1)
            if not finite.all():
                raise PcldnnError(f"{self.name}: sample {start + int(np.flatnonzero(~finite)[0])} holds NaN or infinity")
            n = x.shape[0] * x.shape[2] * x.shape[3]
            chunk_mean = x.mean(axis=(0, 2, 3))
            chunk_m2 = ((x - chunk_mean.reshape(1, -1, 1, 1)) ** 2).sum(axis=(0, 2, 3))
            delta = chunk_mean - mean
            mean = mean + delta * n / (count + n)
            m2 = m2 + chunk_m2 + delta * delta * count * n / (count + n)
            count += n
        return mean, np.sqrt(m2 / count)

    def with_normalization(self, mean: Any, std: Any) -> Dataset:
        """Normalise each channel as (x - mean) / std on every read (std floored at 1e-8)."""
        c = self.sample_shape[0]
        mean, std = (np.asarray(a, np.float32).reshape(-1) for a in (mean, std))
        if mean.shape != (c,) or std.shape != (c,) or not (np.isfinite(mean).all() and np.isfinite(std).all()):
            raise PcldnnError(f"{self.name}: mean and std must be {c} finite numbers each")
        self.mean, self.std = mean, np.maximum(std, np.float32(1e-8))
        return self


class ArrayDataset(Dataset):
    """Images (N, C, H, W) and integer labels (N,) in memory."""

    def __init__(self, x: np.ndarray, y: np.ndarray, name: str = "data", augment: Augment | None = None):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim != 4:
            raise PcldnnError(f"{name}: images must be (N, C, H, W), got shape {x.shape}")
        if y.shape != (x.shape[0],):
            raise PcldnnError(f"{name}: labels must be ({x.shape[0]},) to match the images, got {y.shape}")
        if x.shape[0] == 0:
            raise PcldnnError(f"{name}: no samples")
        if x.dtype.kind not in "fiub":
            raise PcldnnError(f"{name}: images must be numbers, got {x.dtype}")
        self.y = checked_labels(y, name)
        self.x = np.ascontiguousarray(x, dtype=np.float32)
        self.name = name
        self.augment = augment

    def __len__(self) -> int:
        return self.x.shape[0]

    def _load(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.x[indices], self.y[indices]

    def all_labels(self) -> np.ndarray:
        return self.y

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return self.x.shape[1:]  # type: ignore[return-value]

    def normalized(self, mean: Any, std: Any) -> ArrayDataset:
        """A normalised copy (the arrays themselves rescaled)."""
        mean, std = (np.asarray(a, np.float32).reshape(1, -1, 1, 1) for a in (mean, std))
        return ArrayDataset((self.x - mean) / np.maximum(std, 1e-8), self.y, self.name, self.augment)

    def batches(self, batch_size: int, order: np.ndarray | None = None) -> Any:
        """(x, y) minibatches of exactly `batch_size` in `order` (default: as stored); a last
        partial batch is dropped so that every step has the same shape."""
        Fields(self.name).int_in(batch_size, "batch_size", 1, 1 << 20)
        if batch_size > len(self):
            raise PcldnnError(f"{self.name}: batch size {batch_size} is larger than the {len(self)} samples")
        order = np.arange(len(self)) if order is None else order
        for start in range(0, len(self) - batch_size + 1, batch_size):
            yield self.read(order[start:start + batch_size])


class MemmapDataset(Dataset):
    """`MemmapDataset("images.npy", "labels.npy")`: images (N, C, H, W) or (N, H, W) of any
    numeric dtype (uint8 is scaled by 1/255 unless `scale` says otherwise) and integer labels
    (N,), memory-mapped: a read touches only the rows it asks for, so under MPI each rank reads
    only its shard."""

    def __init__(self, images: str | Path, labels: str | Path, augment: Augment | None = None,
                 scale: float | None = None, name: str | None = None):
        images, labels = Path(images), Path(labels)
        head = npyfile.npy_file_header(images)
        lhead = npyfile.npy_file_header(labels, kinds="iu")
        shape = head.shape
        if len(shape) not in (3, 4) or 0 in shape:
            raise PcldnnError(f"{images}: images must be (N, C, H, W) or (N, H, W), got shape {shape}")
        if any(d > LABEL_LIMIT for d in shape):
            raise PcldnnError(f"{images}: shape {shape} has a side of more than 2^31")
        if lhead.shape != (shape[0],):
            raise PcldnnError(f"{labels}: labels must be ({shape[0]},) integers to match {images.name}, "
                              f"got {lhead.shape} {lhead.dtype}")
        if scale is not None:
            Fields("MemmapDataset").number_in(scale, "scale", -1e30, 1e30)
        self.name = name or images.stem
        self.augment = augment
        try:
            self._x: np.ndarray = np.memmap(images, dtype=head.dtype, mode="r", offset=head.offset, shape=shape)
            y = np.memmap(labels, dtype=lhead.dtype, mode="r", offset=lhead.offset, shape=lhead.shape)
        except (OSError, ValueError) as e:  # replaced or shortened since the header was read
            raise PcldnnError(f"{images}: cannot map the arrays ({type(e).__name__}: {e})") from None
        self._y = checked_labels(y, str(labels))  # small: held in memory, checked once
        mapping = getattr(self._x, "_mmap", None)  # shuffled reads: no read-ahead, no fault-around
        if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_RANDOM"):
            mapping.madvise(mmap.MADV_RANDOM)
        if self._x.ndim == 3:
            self._x = self._x[:, None]
        self.scale = np.float32(scale if scale is not None else (1 / 255 if head.dtype == np.uint8 else 1.0))

    def __len__(self) -> int:
        return self._x.shape[0]

    def _load(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(indices, kind="stable")  # ascending reads through the map, then back in place
        x = np.empty((len(indices), *self._x.shape[1:]), np.float32)
        x[order] = self._x[indices[order]]
        x *= self.scale
        return x, self._y[indices]

    def all_labels(self) -> np.ndarray:
        return self._y

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return self._x.shape[1:]  # from the header: no row read (under MPI a rank reads only its shard)


class ImageFolder(Dataset):
    """`ImageFolder(root, size=(H, W))`: root/<class>/<image> files (PNG, JPEG, BMP, ...), the
    classes in sorted order as labels 0, 1, ...; each image decoded with Pillow, converted to
    RGB (channels=3) or grey (channels=1), resized to `size` (bilinear) and scaled to [0, 1].
    Needs Pillow (the `images` extra)."""

    def __init__(self, root: str | Path, size: tuple[int, int], augment: Augment | None = None,
                 channels: int = 3, name: str | None = None):
        f = Fields("ImageFolder")
        f.array(list(size) if isinstance(size, tuple) else size, "size", 2, 2)
        self.size = (f.int_in(size[0], "size[0]", 1, 1 << 14), f.int_in(size[1], "size[1]", 1, 1 << 14))
        self.channels = f.choice(channels, "channels", (1, 3))
        root = Path(root)
        try:
            classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError as e:
            raise PcldnnError(f"{root}: cannot list the image folder: {e.strerror or e}") from None
        files, labels = [], []
        try:
            for label, cls in enumerate(classes):
                for p in sorted((root / cls).iterdir()):
                    if p.suffix.lower() in IMAGE_EXTENSIONS and stat.S_ISREG(os.stat(p).st_mode):
                        files.append(p)
                        labels.append(label)
        except OSError as e:
            raise PcldnnError(f"{root}: cannot list the image folder: {e.strerror or e}") from None
        if not files:
            raise PcldnnError(f"{root}: no images found (expected <root>/<class>/<image>.png|jpg|...)")
        self.root, self.classes, self.files = root, classes, files
        self._labels = np.array(labels, np.int32)
        self.name = name or root.name
        self.augment = augment

    def __len__(self) -> int:
        return len(self.files)

    def _decode(self, path: Path) -> np.ndarray:
        try:
            from PIL import Image
        except ImportError:
            raise PcldnnError("ImageFolder needs Pillow (pip install 'pcldnn-gen[images]')") from None
        try:
            with open_regular(path, PcldnnError) as fh, Image.open(fh) as im:
                a = self._pixels(im, Image, path)
        except PcldnnError:
            raise
        except Exception as e:  # Pillow's UnidentifiedImageError, DecompressionBombError, truncated files, ...
            raise PcldnnError(f"{path}: cannot decode the image ({type(e).__name__}: {str(e)[:200]})") from None
        return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)

    def _pixels(self, im: Any, Image: Any, path: Path) -> np.ndarray:
        """(H, W) or (H, W, 3) float32 in [0, 1] at `size`, scaled by the mode's full intensity."""
        size = (self.size[1], self.size[0])
        if im.mode in SIXTEEN_BIT_MODES or (im.mode == "I" and im.format == "PNG"):
            grey = np.asarray(im).astype(np.float32)
            if grey.ndim != 2 or grey.min() < 0 or grey.max() > 65535:
                raise PcldnnError(f"{path}: {im.mode} image with values outside 16 bits")
            plane = Image.fromarray(grey * np.float32(1 / 65535))
            if plane.size != size:
                plane = plane.resize(size, Image.Resampling.BILINEAR)
            a = np.asarray(plane, dtype=np.float32)
            return np.repeat(a[..., None], 3, axis=2) if self.channels == 3 else a
        if im.mode not in EIGHT_BIT_MODES:
            raise PcldnnError(f"{path}: image mode {im.mode} has no defined full-scale value (convert it to 8- or 16-bit)")
        im = im.convert("RGB" if self.channels == 3 else "L")
        if im.size != size:
            im = im.resize(size, Image.Resampling.BILINEAR)
        return np.asarray(im, dtype=np.float32) * np.float32(1 / 255)

    def _load(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.stack([self._decode(self.files[i]) for i in indices]), self._labels[indices]

    def all_labels(self) -> np.ndarray:
        return self._labels

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return (self.channels, *self.size)  # type: ignore[return-value]

    def check_classes(self, classes: int) -> None:
        if len(self.classes) > classes:
            raise PcldnnError(f"{self.root}: {len(self.classes)} class folders, the net has {classes} classes")


def prefetched(dataset: Dataset, batches: list[np.ndarray], epoch: int | None, workers: int = 2,
               ahead: int = 4) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """dataset.read of each index array in turn, read by `workers` background threads at most
    `ahead` batches before the one consumed (a bounded queue: memory stays a few batches)."""
    if not batches:
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="pcldnn-data") as pool:
        pending: deque = deque()
        nxt = 0
        try:
            while nxt < len(batches) or pending:
                while nxt < len(batches) and len(pending) < max(1, ahead):
                    pending.append(pool.submit(dataset.read, batches[nxt], epoch))
                    nxt += 1
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def digits(size: int = 16, test_fraction: float = 0.2, seed: int = 0) -> tuple[ArrayDataset, ArrayDataset]:
    """scikit-learn's bundled handwritten digits (1,797 images of 8x8, 10 classes), upsampled
    to `size` x `size` by pixel repetition, split into (train, test) by a fixed seeded
    permutation, both normalised with the training split's mean and deviation."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise PcldnnError("the digits data set ships with scikit-learn: pip install 'pcldnn-gen[demo]'") from None
    Fields("digits").int_in(size, "size", 8, 1 << 12)
    if size % 8:
        raise PcldnnError(f"digits: size must be a multiple of 8, got {size}")
    bunch = load_digits()
    x = bunch.images.astype(np.float32)[:, None] / 16.0
    x = x.repeat(size // 8, axis=2).repeat(size // 8, axis=3)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = round(len(x) * test_fraction)
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
