"""Trainer: steps, evaluation, epochs with progress and metrics, atomic checkpoints.

Reproducibility: the data order of epoch e is a permutation drawn from (seed, e), and the
net's dropout masks from (net seed, draw count), so a run resumed from a checkpoint at
step k replays exactly the steps an uninterrupted run takes after k.
"""
from __future__ import annotations

import io
import json
import math
import os
import tempfile
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from . import cpu, npyfile, observe
from .data import ArrayDataset, prefetched
from .errors import CheckpointError, NonFiniteError, PcldnnError
from .optim import SGD
from .partition import shard_bounds
from .validate import NAME_RE, SHA256_RE, Fields, check_writable, open_regular, remove_stale_temporaries, show

# /3: and the batchnorm layers' running statistics (statistics.npy, meta "batch_counts"); /2:
# canonical layouts (Net.to_canonical), so a checkpoint moves between ISAs (still read for nets
# without batchnorm); /1 held the blocked buffers of one ISA and no record of which.
CHECKPOINT_FORMAT = "pcldnn-checkpoint/3"
_CANONICAL_FORMAT = "pcldnn-checkpoint/2"


def softmax_metrics(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(mean cross-entropy, top-1 accuracy) of a batch of logits, in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = -logp[np.arange(len(labels)), labels].mean()
    return float(loss), float((logits.argmax(axis=1) == labels).mean())


class Trainer:
    """`Trainer(net, optimizer=SGD(...), seed=0)`: `step`, `evaluate`, `fit`, `save`, `resume`."""

    def __init__(self, net: Any, optimizer: SGD | None = None, seed: int = 0, *, comm: Any = None, parallel: Any = "auto",
                 trace: list | None = None, gradient_exchange: str = "fp32", sync_batchnorm: bool = False) -> None:
        """comm: an MPI communicator (e.g. MPI.COMM_WORLD) for synchronous SGD over its ranks;
        each rank then passes its own shard to `step`. parallel: "auto" (fc layers that are
        large against the minibatch go model parallel), "data" (every layer data parallel), or
        a mapping of layer-name patterns to "data", "model" (over all ranks) or "model:G"
        (hybrid: model parallel within groups of G ranks), e.g. {"fc*": "model:2"}; see
        `pcldnn_runtime.layer_modes.layer_modes`. trace: a list that collects Chrome-trace
        events of each step (MPI only). gradient_exchange: "fp32" (default: the part-reduce
        sums exact fp32 gradients, p ranks reach one rank's weights) or "bf16" (each rank's
        gradients rounded to bf16 for the exchange: half the bytes, a change of numerics;
        docs/precision.md). sync_batchnorm: batchnorm layers normalize by the statistics of
        every rank's shard (PyTorch's SyncBatchNorm), so p ranks equal one rank with the global
        minibatch; off (the default, like DDP), each rank normalizes by its own shard's."""
        if net.loss_layer is None:
            raise PcldnnError(f"net {net.name} has no loss layer: add a softmax_cross_entropy layer to train it")
        self.net = net
        self.optimizer = optimizer or SGD(lr=0.01)
        self.optimizer.bind(net)
        self.seed = Fields("Trainer").int_in(seed, "seed", 0, _U64)  # SeedSequence takes no negative
        self.step_count = 0          # optimizer updates done
        self.last_accuracy = math.nan
        self.comm, self.dist = comm, None
        if comm is not None:  # SyncSGD makes an exception on any rank abort the job
            from .distributed import SyncSGD
            self.dist = SyncSGD(net, self.optimizer, comm, parallel=parallel, trace=trace,
                                gradient_exchange=gradient_exchange, sync_batchnorm=sync_batchnorm)
        elif gradient_exchange != "fp32":
            raise PcldnnError(f"gradient_exchange={gradient_exchange!r} needs comm (an MPI communicator): "
                              "one process exchanges no gradients")
        elif sync_batchnorm:
            raise PcldnnError("sync_batchnorm=True needs comm (an MPI communicator): one process's batchnorm "
                              "statistics are already the whole minibatch's")

    @property
    def rank(self) -> int:
        return self.comm.rank if self.comm is not None else 0

    # -- one minibatch -------------------------------------------------------------------
    def step(self, x: np.ndarray, labels: np.ndarray) -> float:
        """Forward, backward and one SGD update on a minibatch; returns its mean loss."""
        return self._step(x, labels, None)

    def _step(self, x: np.ndarray, labels: np.ndarray, global_batch: int | None) -> float:
        try:
            return self._checked_step(x, labels, global_batch)
        except NonFiniteError as e:
            if e.step is not None:  # the optimizer's names its step; the input check knows none
                raise
            raise NonFiniteError(e.message, self.step_count) from None

    def _checked_step(self, x: np.ndarray, labels: np.ndarray, global_batch: int | None) -> float:
        labels = np.asarray(labels)
        if self.dist is not None:  # x, labels: this rank's shard; loss and accuracy: global
            shared = {"seed": self.seed, "global_batch": global_batch}
            loss, self.last_accuracy = self.dist.step(x, labels, self.step_count, shared)
        else:
            start = time.perf_counter()
            logits = self.net.forward(x, training=True)
            loss = self.net.backward(labels)
            update = time.perf_counter()
            self.optimizer.apply(self.net.params, self.net.grads, self.step_count)
            self.last_accuracy = float((logits.argmax(axis=1) == labels).mean())
            watch = observe.observer()
            if watch is not None:  # PCLDNN_TIMELINE
                end = time.perf_counter()
                watch.span(f"step {self.step_count}", "steps", start, end, {"minibatch": len(labels)})
                watch.span("sgd", "steps", update, end)
        if not math.isfinite(loss):
            raise PcldnnError(f"step {self.step_count}: the loss is {loss} (diverged: lower the learning rate)")
        self.step_count += 1
        return loss

    def sync(self) -> None:
        """Under MPI, wait for the last step's part-broadcasts: `net.params` is then complete."""
        if self.dist is not None:
            self.dist.sync()

    def evaluate(self, x: Any, labels: np.ndarray | None = None, batch_size: int = 256) -> dict:
        """{'loss', 'accuracy'} over all of (x, labels), or of a dataset, in evaluation mode
        (no dropout, no augmentation), read `batch_size` samples at a time."""
        Fields("evaluate").int_in(batch_size, "batch_size", 1, 1 << 20)
        if _is_dataset(x):
            data = x
        elif labels is None:
            raise PcldnnError("evaluate: give labels with the images, or a dataset")
        else:
            data = ArrayDataset(x, labels, "evaluation data")
        lo, hi = 0, len(data)
        if self.dist is not None:  # each rank evaluates its share of the samples
            self.dist.agree("Trainer.evaluate", {"samples": len(data), "batch_size": batch_size})
            self.sync()
            lo, hi = shard_bounds(len(data), self.comm.size, self.rank)
        sums = np.zeros(2)
        chunks = [np.arange(start, min(start + batch_size, hi)) for start in range(lo, hi, batch_size)]
        for xb, yb in prefetched(data, chunks, None):
            yb = self.net.loss_layer.check_labels(yb, len(yb))  # a negative label would index from the end
            loss, acc = softmax_metrics(self.net.forward(xb, training=False), yb)
            sums += (loss * len(yb), acc * len(yb))
        if self.dist is not None:
            self.dist.blocking(lambda: self.comm.Allreduce(self.dist.MPI.IN_PLACE, sums),
                                "Trainer.evaluate: allreduce of the metrics")
        return {"loss": sums[0] / len(data), "accuracy": sums[1] / len(data)}

    # -- epochs --------------------------------------------------------------------------
    def epoch_order(self, epoch: int, n: int) -> np.ndarray:
        return np.random.default_rng(np.random.SeedSequence([self.seed, epoch])).permutation(n)

    def _epoch_batches(self, train: Any, epoch: int, batch_size: int | None, skip: int, workers: int, prefetch: int) -> Any:
        """(x, labels, global minibatch) of one epoch from `skip` on; under MPI x and labels
        are this rank's rows only (a dataset reads nothing else)."""
        if _is_dataset(train):
            assert batch_size is not None
            order = self.epoch_order(epoch, len(train))
            picks = [order[b * batch_size:(b + 1) * batch_size] for b in range(skip, len(train) // batch_size)]
            if self.dist is not None:  # batch_size is the global minibatch: read this rank's shard
                lo, hi = shard_bounds(batch_size, self.comm.size, self.rank)
                picks = [p[lo:hi] for p in picks]
            for xb, yb in prefetched(train, picks, epoch, workers, prefetch):
                yield xb, yb, batch_size
            return
        produced = 0
        for i, item in enumerate(train):
            produced += 1
            if i < skip:
                continue
            try:
                xb, yb = item
            except (TypeError, ValueError):
                raise PcldnnError(f"fit: batch {i} of epoch {epoch + 1} is not an (x, labels) pair") from None
            xb, yb = np.asarray(xb), np.asarray(yb)
            if xb.ndim < 2 or yb.shape != (xb.shape[0],):
                raise PcldnnError(f"fit: batch {i} of epoch {epoch + 1}: images {xb.shape} and labels {yb.shape} "
                                  "do not pair up")
            global_batch = len(yb)
            if self.dist is not None:
                lo, hi = shard_bounds(global_batch, self.comm.size, self.rank)
                xb, yb = xb[lo:hi], yb[lo:hi]
            yield xb, yb, global_batch
        if produced == 0:
            raise PcldnnError(f"fit: the training data gave no batches in epoch {epoch + 1} (a generator is used up "
                              "after one pass: give a list, a dataset, or an object whose __iter__ starts again)")

    def fit(self, train: Any, val: Any = None, *, epochs: int, batch_size: int | None = None,
            metrics_file: str | Path | None = None, checkpoint: str | Path | None = None,
            progress: bool | None = None, workers: int = 2, prefetch: int = 4) -> list[dict]:
        """Train until `epochs` epochs are done in total (a resumed trainer continues where it
        stopped). `train`: a dataset (ArrayDataset, MemmapDataset, ImageFolder, or anything with
        len() and read(indices, epoch)), shuffled per epoch from (seed, epoch) and read one
        global minibatch of `batch_size` at a time by `workers` background threads up to
        `prefetch` batches ahead; or an iterable of (x, labels) numpy batches (each a global
        minibatch; under MPI every rank iterates it and keeps its shard). Per step, a JSON line
        {step, epoch, loss, accuracy, lr, images_per_s} is appended to `metrics_file`; after
        each epoch the validation metrics are computed and, with `checkpoint`, the trainer is
        saved there. `progress`: a bar of each epoch's steps on rank 0's stderr, always (True),
        never (False) or where stderr is a terminal (None: a log or a pipe gets none). Returns
        one dict per epoch run."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise PcldnnError(f"fit: epochs must be a positive int, got {epochs!r}")
        for name, value in (("workers", workers), ("prefetch", prefetch)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 256:
                raise PcldnnError(f"fit: {name} must be an int in [1, 256], got {value!r}")
        if _is_dataset(train):
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise PcldnnError(f"fit: batch_size must be a positive int, got {batch_size!r}")
            if batch_size > len(train):
                raise PcldnnError(f"fit: batch size {batch_size} is larger than the {len(train)} training samples")
            per_epoch: int | None = len(train) // batch_size
        elif hasattr(train, "__iter__"):
            per_epoch = len(train) if hasattr(train, "__len__") else None
            if per_epoch is None and self.step_count:
                raise PcldnnError("fit: resuming mid-run needs the training data's length (len(train)) to find "
                                  "the epoch; give a dataset or a list of batches")
        else:
            raise PcldnnError(f"fit: train must be a dataset or an iterable of (x, labels) batches, "
                              f"got {type(train).__name__}")
        if val is not None and not _is_dataset(val):
            raise PcldnnError(f"fit: val must be a dataset (len() and read(indices)), got {type(val).__name__}; "
                              "wrap arrays as pr.ArrayDataset(x, labels)")
        shape = getattr(val, "sample_shape", None)  # the training shape fails the first step; this one an epoch later
        if shape is not None and tuple(shape) != tuple(self.net.chain[0].in_shape):
            raise PcldnnError(f"fit: val samples are {tuple(shape)}, the net takes {tuple(self.net.chain[0].in_shape)}")
        if checkpoint and self.rank == 0:  # written after the first epoch: checked before it
            check_writable(checkpoint, "fit: checkpoint", CheckpointError, make_parents=True)
        classes = self.net.loss_layer.in_shape[0]
        for data in (train, val):  # every label in range before the first step, not at the end of the run
            if hasattr(data, "check_classes"):
                data.check_classes(classes)
        history = []
        lead = self.rank == 0  # progress, metrics and checkpoint files: rank 0 only
        progress = progress if lead else False
        try:
            if metrics_file and lead:
                Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            metrics = open(metrics_file, "a") if metrics_file and lead else None  # noqa: SIM115 (closed in the finally)
        except OSError as e:
            raise PcldnnError(f"{metrics_file}: cannot write the metrics file: {e.strerror or e}") from None
        try:
            for epoch in range(self.step_count // per_epoch if per_epoch else 0, epochs):
                skip = self.step_count - epoch * per_epoch if per_epoch else 0  # resumed mid-epoch
                bar = _progress(per_epoch - skip if per_epoch else None, f"epoch {epoch + 1}/{epochs}", progress)
                seen, losses, accs, start = 0, [], [], time.perf_counter()
                for xb, yb, global_batch in self._epoch_batches(train, epoch, batch_size, skip, workers, prefetch):
                    t0 = time.perf_counter()
                    loss = self._step(xb, yb, global_batch)
                    dt = time.perf_counter() - t0
                    seen += global_batch
                    losses.append(loss)
                    accs.append(self.last_accuracy)
                    rate = seen / (time.perf_counter() - start)
                    if metrics:
                        metrics.write(json.dumps({
                            "step": self.step_count, "epoch": epoch + 1, "loss": loss, "accuracy": self.last_accuracy,
                            "lr": self.optimizer.lr_at(self.step_count - 1), "images_per_s": global_batch / dt}) + "\n")
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss:.4f}", acc=f"{self.last_accuracy:.3f}", img_s=f"{rate:.0f}")
                        bar.update(1)
                if bar is not None:
                    bar.close()
                record = {"epoch": epoch + 1, "step": self.step_count,
                          "train_loss": float(np.mean(losses)) if losses else math.nan,
                          "train_accuracy": float(np.mean(accs)) if accs else math.nan,
                          "images_per_s": seen / max(time.perf_counter() - start, 1e-9)}
                if val is not None:
                    ev = self.evaluate(val)
                    record.update(val_loss=ev["loss"], val_accuracy=ev["accuracy"])
                if lead and losses:
                    _warn_if_stuck(record, self.net.loss_layer.out_shape[0], self.optimizer.lr)
                if metrics:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                history.append(record)
                if checkpoint:
                    self.save(checkpoint)
        finally:
            if metrics:
                metrics.close()
        return history

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write weights, optimizer state, step and RNG state to `path` atomically: a
        temporary file in the same directory, flushed to disk, then renamed over `path`.
        Temporary files that killed saves of the same checkpoint left behind are removed.
        Under MPI every rank calls it (rank 0 writes the gathered state)."""
        path = Path(path)
        velocity = self.optimizer.bound_velocity()
        if self.dist is not None:  # collective: every rank calls save; rank 0 writes the gathered state
            self.dist.agree("Trainer.save", {"step": self.step_count})
            self.sync()
            velocity = self.dist.gather_velocity()
            if self.rank != 0:
                self.dist.blocking(self.comm.Barrier, "Trainer.save: waiting for rank 0 to write the file")
                return path
        params, velocity = self.net.to_canonical(self.net.params), self.net.to_canonical(velocity)
        statistics, counts = self.net.running_statistics()  # (rank 0's: per-rank statistics, as DDP's)
        for name, buf in (("weights", params), ("momentum", velocity), ("running statistics", statistics)):
            if not np.isfinite(buf).all():
                raise CheckpointError(f"{path}: refusing to save: the {name} hold NaN or infinity")
        # isa / vector_floats / precision: where the state was trained, for the record (the
        # layouts are canonical, so any build of the net resumes it)
        meta = {"format": CHECKPOINT_FORMAT, "net": self.net.name, "net_hash": self.net.net_hash,
                "step": self.step_count, "seed": self.seed, "net_seed": self.net.seed,
                "dropout_draws": self.net.dropout_draws,
                "optimizer": self.optimizer.config(), "params": int(params.size),
                "batch_counts": counts,
                "isa": self.net.isa, "vector_floats": self.net.vector_floats, "precision": self.net.precision}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(path)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
        except OSError as e:
            raise CheckpointError(f"{path}: cannot write the checkpoint: {e.strerror or e}") from None
        try:
            with os.fdopen(fd, "wb") as f:
                _write_checkpoint(f, meta, params, velocity, statistics)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise CheckpointError(f"{path}: cannot write the checkpoint: {e.strerror or e}") from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if self.dist is not None:
            self.dist.blocking(self.comm.Barrier, "Trainer.save: waiting for rank 0 to write the file")
        return path

    @classmethod
    def resume(cls, path: str | Path, net: Any, optimizer: SGD | None = None, *, comm: Any = None, **kwargs: Any) -> Trainer:
        """A trainer in the state `save` recorded, for `net` (which must be built from the same
        net description). The optimizer's hyperparameters come from the checkpoint unless one
        is given. Under MPI (comm), every rank calls it, with any number of ranks: the file
        holds the full state."""
        path = Path(path)
        meta, params, velocity, statistics = read_checkpoint(path, net)
        trainer = cls(net, optimizer or _optimizer_from(meta["optimizer"], path), seed=meta["seed"], comm=comm,
                      **kwargs)
        net.from_canonical(params, net.params)
        net.from_canonical(velocity, trainer.optimizer.bound_velocity())
        net.set_running_statistics(statistics, meta.get("batch_counts", []))
        trainer.step_count = meta["step"]
        net.seed, net.dropout_draws = meta["net_seed"], meta["dropout_draws"]  # dropout masks continue
        return trainer


# Checkpoint files: a zip (numpy's .npz layout, uncompressed) of exactly these members (/2: the
# first three).
_MEMBERS = {"meta.npy": np.uint8, "params.npy": np.float32, "velocity.npy": np.float32, "statistics.npy": np.float32}
_MAX_META = 1 << 20
_U64 = 2 ** 64 - 1


def _warn_if_stuck(record: dict, classes: int, lr: float) -> None:
    """A warning naming the likely cause when an epoch's training ends far above the loss of a
    uniform guess (ln classes) or at chance accuracy: silent divergence or dead ReLUs otherwise
    look like a slow start."""
    chance = math.log(classes)
    if record["train_loss"] > 2 * chance + 1:
        warnings.warn(f"epoch {record['epoch']}: mean training loss {record['train_loss']:.4g} is far above "
                      f"ln({classes}) = {chance:.3g}, the loss of a uniform guess: the learning rate ({lr:g}) is "
                      "likely too high, or the inputs are not normalised", RuntimeWarning, stacklevel=3)
    elif classes > 1 and record["train_accuracy"] <= 1.5 / classes and record["epoch"] >= 2:
        # A loss at ln(classes) is the uniform guess: the output ignores the input. Deep plain
        # nets (no normalisation layers) sit there for epochs, in PyTorch alike, before they learn.
        uniform = abs(record["train_loss"] - chance) < 0.05 * chance
        cause = ("the net's output is a uniform guess that ignores the input: a deep net without "
                 "normalisation layers can sit there for several epochs (train longer, with a longer warm-up "
                 f"or a lower learning rate than {lr:g}), or the labels do not match the images" if uniform else
                 f"the weights may have diverged into dead ReLUs (a learning rate of {lr:g} too high?), or the labels "
                 "do not match the images")
        warnings.warn(f"epoch {record['epoch']}: training accuracy {record['train_accuracy']:.3f} is at chance "
                      f"(1/{classes}): {cause}", RuntimeWarning, stacklevel=3)


def _is_dataset(obj: Any) -> bool:
    """Random access by sample index (pcldnn_runtime.data.Dataset or the same two methods)."""
    return hasattr(obj, "read") and hasattr(obj, "__len__")


def read_checkpoint(path: Path, net: Any) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """(meta, params, velocity, running statistics) of a checkpoint file, checked against `net`.
    The file is parsed defensively: zip directory, each member's npy header (dtype, shape against
    the net) before its data is read, metadata fields and ranges, finite values, variances not
    negative. Any defect is one CheckpointError with the reason."""
    norms = net.batch_norm_channels()
    meta, arrays = _read_checkpoint(Path(path), net.name, net.net_hash, (net.canonical_size, 2 * sum(norms)))
    assert arrays is not None
    counts = meta.get("batch_counts", [])
    if meta["format"] == _CANONICAL_FORMAT and norms:
        raise CheckpointError(f"{path}: a {_CANONICAL_FORMAT} checkpoint holds no batchnorm statistics, and this net "
                              f"has {len(norms)} batchnorm layer(s)")
    if meta["format"] == CHECKPOINT_FORMAT and len(counts) != len(norms):
        raise CheckpointError(f"{path}: meta.batch_counts: {len(counts)} counts, this net has {len(norms)} batchnorm "
                              "layer(s)")
    start = 0
    for c in norms:  # each layer's running mean, then its running variance
        if (arrays[2][start + c:start + 2 * c] < 0).any():
            raise CheckpointError(f"{path}: statistics hold a negative running variance")
        start += 2 * c
    return meta, *arrays


def checkpoint_meta(path: str | Path, net_name: str, net_hash: str) -> dict:
    """A checkpoint's metadata, checked (members, fields, the net description's hash) before
    anything is built: what `pcldnn-gen train --resume` checks before it compiles."""
    return _read_checkpoint(Path(path), net_name, net_hash, None)[0]


def _read_checkpoint(path: Path, net_name: str, net_hash: str,
                     sizes: tuple[int, int] | None) -> tuple[dict, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """sizes: (parameters, running statistics) of the net, or None for the metadata only."""
    try:
        with open_regular(path, CheckpointError) as f, zipfile.ZipFile(f) as z:
            names = sorted(z.namelist())
            if names not in (sorted(_MEMBERS), sorted(set(_MEMBERS) - {"statistics.npy"})):
                raise CheckpointError(f"{path}: not a pcldnn checkpoint (members {names[:5]}, expected "
                                      f"{sorted(_MEMBERS)})")
            meta = _read_meta(path, _read_member(z, "meta.npy", path, (_MAX_META,)))
            if ("statistics.npy" in names) != (meta["format"] == CHECKPOINT_FORMAT):
                raise CheckpointError(f"{path}: not a pcldnn checkpoint (members {names}, format {meta['format']})")
            if meta["net_hash"] != net_hash:
                raise CheckpointError(f"{path}: checkpoint of net {meta['net']!r} (description {meta['net_hash'][:12]}),"
                                      f" but this net is {net_name!r} ({net_hash[:12]})")
            if sizes is None:
                return meta, None
            size, stats = sizes
            if meta["params"] != size:
                raise CheckpointError(f"{path}: holds {meta['params']} parameters, this net has {size}")
            params = _read_member(z, "params.npy", path, (size,), exact=True)
            velocity = _read_member(z, "velocity.npy", path, (size,), exact=True)
            statistics = (_read_member(z, "statistics.npy", path, (stats,), exact=True) if "statistics.npy" in names
                          else np.zeros(0, np.float32))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except CheckpointError:
        raise
    except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, RuntimeError,
            NotImplementedError) as e:
        raise CheckpointError(f"{path}: not a readable pcldnn checkpoint ({type(e).__name__}: {e})") from None
    for name, buf in (("params", params), ("velocity", velocity), ("statistics", statistics)):
        bad = np.flatnonzero(~np.isfinite(buf))
        if bad.size:
            raise CheckpointError(f"{path}: {name} hold {bad.size} NaN or infinite values (first at index {bad[0]})")
    return meta, (params, velocity, statistics)


def _read_member(z: zipfile.ZipFile, name: str, path: Path, shape: tuple[int], exact: bool = False) -> np.ndarray:
    """One .npy member: header checked (dtype, shape, order, bytes) before any data is read."""
    dtype = np.dtype(_MEMBERS[name])
    info = z.getinfo(name)
    with z.open(info) as f:
        header = npyfile.read_header(f, f"{path}: {name}", CheckpointError)
    if header.dtype != dtype or len(header.shape) != 1:
        raise CheckpointError(f"{path}: {name}: expected a 1-D {dtype} array, got {header.dtype} {header.shape}")
    count = header.shape[0]
    if (exact and count != shape[0]) or count > shape[0]:
        raise CheckpointError(f"{path}: {name}: {count} values, this net needs {shape[0]}")
    if info.file_size - header.offset < header.nbytes:
        raise CheckpointError(f"{path}: {name}: truncated ({info.file_size - header.offset} bytes of {header.nbytes})")
    return npyfile.read_data(z, info, header, f"{path}: {name}", CheckpointError)


def _read_meta(path: Path, raw: np.ndarray) -> dict:
    f = Fields(str(path), CheckpointError)
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: metadata is not JSON ({e})") from None
    keys = {"format", "net", "net_hash", "step", "seed", "net_seed", "dropout_draws", "optimizer", "params", "isa",
            "vector_floats", "precision"}
    if not isinstance(meta, dict) or meta.get("format") not in (CHECKPOINT_FORMAT, _CANONICAL_FORMAT):
        fmt = meta.get("format") if isinstance(meta, dict) else None
        if fmt == "pcldnn-checkpoint/1":
            raise CheckpointError(f"{path}: format pcldnn-checkpoint/1 holds one ISA's blocked layout and does not "
                                  "say which; it cannot be read safely. Load it with the version that wrote it, "
                                  f"then save again ({CHECKPOINT_FORMAT}, canonical layouts)")
        raise CheckpointError(f"{path}: not a pcldnn checkpoint (format {show(fmt)}, expected {CHECKPOINT_FORMAT!r})")
    f.obj(meta, "meta", keys | ({"batch_counts"} if meta["format"] == CHECKPOINT_FORMAT else set()))
    for i, count in enumerate(f.array(meta.get("batch_counts", []), "meta.batch_counts", 0, 1 << 20)):
        f.int_in(count, f"meta.batch_counts[{i}]", 0, 2 ** 24 - 1)
    f.string(meta["net"], "meta.net", NAME_RE, "a net name")
    f.string(meta["net_hash"], "meta.net_hash", SHA256_RE, "a sha256 digest")
    f.int_in(meta["step"], "meta.step", 0, 2 ** 53)
    f.int_in(meta["seed"], "meta.seed", 0, _U64)
    f.int_in(meta["net_seed"], "meta.net_seed", 0, 2 ** 63 - 1)
    f.int_in(meta["dropout_draws"], "meta.dropout_draws", 0, 2 ** 53)
    f.int_in(meta["params"], "meta.params", 1, 2 ** 40)
    f.choice(meta["isa"], "meta.isa", ("scalar", "avx2", "avx512"))
    f.choice(meta["vector_floats"], "meta.vector_floats", (1, 8, 16))
    f.choice(meta["precision"], "meta.precision", cpu.PRECISIONS)  # the state is fp32 whatever the build's kernels
    f.obj(meta["optimizer"], "meta.optimizer", set(), set(SGD(0.1).config()))
    return meta


def _optimizer_from(config: dict, path: Path) -> SGD:
    try:
        return SGD(**config)
    except (PcldnnError, TypeError) as e:
        raise CheckpointError(f"{path}: optimizer settings in the checkpoint are invalid: {e}") from None


def _write_checkpoint(f: Any, meta: dict, params: np.ndarray, velocity: np.ndarray, statistics: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), params=params, velocity=velocity,
             statistics=statistics)
    f.write(buf.getbuffer())


def _progress(total: int | None, desc: str, enabled: bool | None) -> Any:
    """None: tqdm's own test, a bar where stderr is a terminal (as compiler.compile_all's)."""
    if enabled is False:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True,
                disable=None if enabled is None else False)
