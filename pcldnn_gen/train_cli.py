"""`pcldnn-gen train NET.json --data PATH ...`: compile (or find in the cache), load, train with
SGD and report, from a shell; `examples/train.py` is the same with the digits net as default.
Under `mpiexec` every rank runs it: synchronous SGD over the ranks, rank 0 compiling and
reporting. Defaults train every example net: inputs normalised per channel with statistics of
the training set, a learning rate by net depth with a linear warm-up over the first epoch, cosine
decay."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pcldnn_runtime as pr
from pcldnn_runtime.cpu import PRECISIONS
from pcldnn_runtime.layer_modes import mapping_modes
from pcldnn_runtime.limits import plural
from pcldnn_runtime.optim import SCHEDULES
from pcldnn_runtime.validate import Fields, check_writable, open_regular

from .arch import get_arch
from .build import build
from .errors import PcldnnError
from .netspec import NetSpec, load_netspec

# Learning rate by the number of weighted layers (SGD, momentum 0.9, batch 32-256, normalised
# inputs): deeper plain chains (no batch norm) need smaller steps. cifar_small (5 weighted
# layers) on synthetic data: 0.02 without normalisation reached a loss of 1,168 and then chance
# accuracy; see docs/models.md for the runs behind these figures.
DEFAULT_LR = ((3, 0.05), (6, 0.02), (10, 0.01))  # (at most this many weighted layers, lr)
DEEP_LR = 0.005
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def default_lr(spec: NetSpec) -> float:
    depth = sum(1 for layer in spec.layers if layer.weighted)
    return next((lr for most, lr in DEFAULT_LR if depth <= most), DEEP_LR)


def add_arguments(ap: argparse.ArgumentParser, net_default: str | None = None, data_default: str = "synthetic") -> None:
    if net_default is None:
        ap.add_argument("net", help="network description (net.json)")
    else:
        ap.add_argument("--net", default=net_default, help="network description (default: %(default)s)")
    ap.add_argument("--data", default=data_default,
                    help="digits, synthetic, an image folder (<dir>/<class>/<image>), or images.npy with --labels "
                         "(default: %(default)s)")
    ap.add_argument("--labels", help="labels.npy for --data images.npy")
    ap.add_argument("--val", help="validation data like --data (default: the digits / synthetic test split; none "
                    "for files)")
    ap.add_argument("--val-labels", help="labels.npy for --val images.npy")
    ap.add_argument("--size", type=int, nargs=2, metavar=("H", "W"), help="image size for image folders "
                    "(default: the net's input)")
    ap.add_argument("--weights", help="initial weights (.npz of <layer>.weight / <layer>.bias, e.g. from "
                    "`pcldnn-gen import` or from_torch)")
    ap.add_argument("--arch", default="native")
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32",
                    help="kernel number format: fp32 (default) or bf16 (AVX-512 builds; fp32 weights and gradients)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=None, help="default: by net depth (0.05 up to 3 weighted layers, "
                    "0.02 up to 6, 0.01 up to 10, else 0.005)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--schedule", default="cosine", help="constant, step or cosine (default)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="default: one epoch, at most 200 steps")
    ap.add_argument("--augment", action="store_true", help="random crops (padding H/8) and horizontal flips")
    ap.add_argument("--no-normalize", action="store_true", help="do not normalise inputs per channel")
    ap.add_argument("--workers", type=int, default=2, help="background threads reading batches")
    ap.add_argument("--threads", type=int, default=None, help="default: every usable core")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default=None, help="save checkpoint.npz there after every epoch")
    ap.add_argument("--resume", default=None, help="checkpoint file to continue from")
    ap.add_argument("--metrics", default=None, help="append per-step JSON lines to this file")
    ap.add_argument("--plot", default=None, help="save the loss / accuracy curves to this PNG")
    ap.add_argument("--trace", default=None, help="under mpiexec: write each rank's Chrome-trace timeline to "
                    "TRACE/trace-rank<r>.json (open in chrome://tracing or ui.perfetto.dev)")
    ap.add_argument("--parallel", default="auto", type=parallel_arg,
                    help='under mpiexec: auto, data, or a JSON mapping like \'{"fc*": "model:2"}\'')
    ap.add_argument("--gradient-exchange", default="fp32", choices=("fp32", "bf16"),
                    help="under mpiexec: bf16 rounds each rank's gradients to bf16 for the part-reduce (half the "
                         "bytes, a change of numerics; default fp32: p ranks reach one rank's weights)")
    ap.add_argument("--sync-batchnorm", action="store_true",
                    help="under mpiexec: batchnorm statistics over every rank's shard (p ranks equal one rank with "
                         "the global minibatch); default: each rank's own shard, like DDP")
    ap.add_argument("--no-progress", action="store_true", help="no bar of steps (there is none where stderr is not a "
                    "terminal)")


def parallel_arg(text: str) -> Any:
    """--parallel: "auto", "data" or a JSON object of layer patterns to "data" / "model" / "model:G"."""
    if text in ("auto", "data"):
        return text
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not auto, data or a JSON object: {e.msg}") from None
    if not isinstance(mapping, dict):
        raise argparse.ArgumentTypeError("a JSON object of layer patterns, like {\"fc*\": \"model\"}")
    return mapping


def world() -> Any:
    """MPI.COMM_WORLD when launched by mpiexec with more than one rank, else None."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD if MPI.COMM_WORLD.size > 1 else None


def check_args(args: argparse.Namespace) -> None:
    """Every number in its range and every file the run will read or write usable, before any
    compile or training: a typo in --plot must not cost the run."""
    f = Fields("command line", PcldnnError)
    f.int_in(args.epochs, "--epochs", 1, 1 << 20)
    f.int_in(args.batch_size, "--batch-size", 1, 1 << 20)
    if args.lr is not None:
        f.number_in(args.lr, "--lr", 0, 1e6, open_lo=True)
    f.number_in(args.momentum, "--momentum", 0, 1, open_hi=True)
    f.number_in(args.weight_decay, "--weight-decay", 0, 1e6)
    f.choice(args.schedule, "--schedule", SCHEDULES)
    if args.warmup_steps is not None:
        f.int_in(args.warmup_steps, "--warmup-steps", 0, 1 << 40)
    f.int_in(args.workers, "--workers", 1, 256)
    if args.threads is not None:
        f.int_in(args.threads, "--threads", 1, 1 << 12)
    f.int_in(args.seed, "--seed", 0, 2 ** 63 - 1)
    if args.size is not None:
        for i, side in enumerate(args.size):
            f.int_in(side, f"--size[{i}]", 1, 1 << 14)
    for flag, given, needs in (("--labels", args.labels, args.data), ("--val-labels", args.val_labels, args.val)):
        if given and not (needs and needs.endswith(".npy")):
            f.fail(flag, "is read only with an images .npy file (--data / --val)")
    for flag, path in (("--weights", args.weights), ("--resume", args.resume), ("--labels", args.labels),
                       ("--val-labels", args.val_labels)):
        if path:
            check_readable(path, flag)
    for flag, path in (("--data", args.data), ("--val", args.val)):
        if path and path not in ("digits", "synthetic") and not Path(path).is_dir():
            check_readable(path, flag)
    if args.val in ("digits", "synthetic"):
        f.fail("--val", f"must be a path; {args.val} data comes with its own test split (omit --val)")
    if args.metrics:
        check_writable(args.metrics, "--metrics", make_parents=True)
    if args.plot:
        check_writable(args.plot, "--plot", make_parents=True)
        suffix = Path(args.plot).suffix.lower()
        if suffix not in PLOT_SUFFIXES:
            f.fail("--plot", f"{args.plot}: the picture's format comes from its suffix: one of "
                   f"{', '.join(PLOT_SUFFIXES)}, got {suffix or 'none'}")
    if args.checkpoint_dir:
        check_writable(args.checkpoint_dir, "--checkpoint-dir", directory=True)
    if args.trace:
        check_writable(args.trace, "--trace", directory=True)


def check_readable(path: str, flag: str) -> None:
    """A file that exists and is a regular file (its contents are checked when it is read)."""
    try:
        open_regular(path, PcldnnError).close()
    except FileNotFoundError:
        raise PcldnnError(f"{flag} {path}: no such file") from None
    except OSError as e:
        raise PcldnnError(f"{flag} {path}: cannot read: {e.strerror or e}") from None
    except PcldnnError as e:
        raise PcldnnError(f"{flag} {e}") from None


def _dataset(path: str, labels: str | None, spec: NetSpec, size: Any, augment: bool, what: str) -> Any:
    """A dataset from --data / --val."""
    p = Path(path)
    aug = pr.Augment(crop_padding=max(1, spec.input[1] // 8), flip=True) if augment else None
    if p.is_dir():
        data = pr.ImageFolder(p, size=tuple(size) if size else spec.input[1:], channels=spec.input[0], augment=aug)
    elif p.suffix == ".npy":
        if not labels:
            raise PcldnnError(f"{what} {path}: give the labels file too (--labels / --val-labels)")
        data = pr.MemmapDataset(p, labels, augment=aug)
    else:
        raise PcldnnError(f"{what} {path}: expected digits, synthetic, an image folder or an images .npy file")
    if data.sample_shape != spec.input:
        raise PcldnnError(f"{what} {path}: samples are {data.sample_shape}, the net takes {spec.input}")
    return data


def datasets(args: Any, spec: NetSpec, classes: int) -> Any:
    """(train, val or None), every label checked in [0, classes), with the per-channel
    normalisation of the training set unless --no-normalize."""
    if args.data == "digits":
        train, val = pr.digits(size=spec.input[1])
    elif args.data == "synthetic":
        train = pr.synthetic(2048, tuple(spec.input), classes, seed=args.seed)
        val = pr.synthetic(512, tuple(spec.input), classes, seed=args.seed, split=1)
    else:
        train = _dataset(args.data, args.labels, spec, args.size, args.augment, "--data")
        val = None
    if args.val:
        val = _dataset(args.val, args.val_labels, spec, args.size, False, "--val")
    for data, flag in ((train, "--data"), (val, "--val")):
        if data is not None:
            if data.sample_shape != spec.input:  # digits are 1 x size x size whatever the net takes
                raise PcldnnError(f"{flag} {data.name}: samples are {data.sample_shape}, the net takes {spec.input}")
            try:
                data.check_classes(classes)
            except PcldnnError as e:
                raise PcldnnError(f"{flag} {e}") from None
    if args.batch_size > len(train):
        raise PcldnnError(f"--batch-size {args.batch_size} is larger than the {len(train)} training samples")
    if args.augment and train.augment is None:
        train.augment = pr.Augment(crop_padding=max(1, spec.input[1] // 8), flip=True)
    if not args.no_normalize:
        mean, std = train.channel_stats()
        train.with_normalization(mean, std)
        if val is not None:
            val.with_normalization(mean, std)
    return train, val


def run(args: argparse.Namespace, prog: str = "pcldnn-gen train") -> int:
    comm = world()
    lead = comm is None or comm.rank == 0
    try:
        check_args(args)
        spec = load_netspec(args.net)
        if spec.layers[-1].type != "softmax_cross_entropy":
            raise PcldnnError(f"{args.net}: the net has no softmax_cross_entropy layer to train")
        if comm is not None and isinstance(args.parallel, dict):  # checked here, not after the compile
            mapping_modes(args.parallel, {layer.name: layer.type for layer in spec.layers if layer.weighted}, comm.size)
        if args.resume:  # the net it belongs to, before the compile
            from pcldnn_runtime.trainer import checkpoint_meta
            checkpoint_meta(args.resume, spec.name, spec.source_hash)
        train, test = datasets(args, spec, spec.layers[-1].in_shape[0])
        weights = None
        if args.weights:
            from pcldnn_runtime.state_io import read_npz
            weights = read_npz(args.weights)
        directory = None
        if lead:
            built = build(spec, get_arch(args.arch), weights=weights, weights_origin=str(args.weights),
                          precision=args.precision)
            directory = built.directory
            print(f"{spec.name}: {directory} ({plural(built.compiled, 'kernel')} compiled, {built.cached} from the "
                  "cache)", flush=True)
        if comm is not None:  # rank 0 compiles (or finds the cache), the others load its build
            directory = comm.bcast(directory, root=0)
        net = pr.load(directory, threads=args.threads, seed=args.seed)
        per_epoch = len(train) // args.batch_size
        steps = args.epochs * per_epoch
        lr = args.lr if args.lr is not None else default_lr(spec)
        warmup = args.warmup_steps if args.warmup_steps is not None else min(200, per_epoch)
        opt = pr.SGD(lr, args.momentum, args.weight_decay, schedule=args.schedule,
                     total_steps=steps if args.schedule == "cosine" else 0,
                     step_size=max(1, steps // 3) if args.schedule == "step" else 0,
                     warmup_steps=min(warmup, max(steps - 1, 0)))
        trace: list | None = [] if args.trace and comm is not None else None
        extra = ({"trace": trace, "parallel": args.parallel, "gradient_exchange": args.gradient_exchange,
                  "sync_batchnorm": args.sync_batchnorm} if comm is not None else {})
        trainer = (pr.Trainer.resume(args.resume, net, opt, comm=comm, **extra) if args.resume
                   else pr.Trainer(net, opt, seed=args.seed, comm=comm, **extra))
        checkpoint = Path(args.checkpoint_dir) / "checkpoint.npz" if args.checkpoint_dir else None
        if lead and not args.resume:
            print(f"{spec.name}: {len(train)} training samples, lr {lr:g} (warm-up {opt.warmup_steps} steps, "
                  f"{args.schedule}), batch {args.batch_size}, inputs "
                  f"{'as given' if args.no_normalize else 'normalised per channel'}", flush=True)
        start = time.perf_counter()
        history = trainer.fit(train, test, epochs=args.epochs, batch_size=args.batch_size, metrics_file=args.metrics,
                              checkpoint=checkpoint, progress=False if args.no_progress else None, workers=args.workers)
        wall = time.perf_counter() - start
        final = trainer.evaluate(test) if test is not None else None
    except pr.PcldnnError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        if comm is not None:  # the other ranks may be inside a collective: end the whole job
            sys.stderr.flush()
            comm.Abort(2)
        return 2
    if trace is not None:
        try:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            (Path(args.trace) / f"trace-rank{comm.rank}.json").write_text(json.dumps({"traceEvents": trace}))
        except OSError as e:
            print(f"{prog}: error: {args.trace}: cannot write the trace: {e.strerror or e}", file=sys.stderr)
            return 2
    if not lead:
        return 0
    for h in history:
        val = f"  test loss {h['val_loss']:.4f}  acc {h['val_accuracy']:.4f}" if "val_loss" in h else ""
        print(f"epoch {h['epoch']:3d}  train loss {h['train_loss']:.4f}  acc {h['train_accuracy']:.4f}{val}  "
              f"{h['images_per_s']:.0f} images/s")
    if args.plot and history:
        try:
            save_plot(history, args.plot)
        except OSError as e:  # checked before training; the disk may have filled since
            print(f"{prog}: error: {args.plot}: cannot write the plot: {e.strerror or e}", file=sys.stderr)
            return 2
    seen = per_epoch * args.batch_size
    seconds = sum(seen / h["images_per_s"] for h in history)
    rate = seen * len(history) / seconds if history else math.nan
    result = (f"test accuracy {final['accuracy']:.4f} (loss {final['loss']:.4f})" if final else
              f"train loss {history[-1]['train_loss']:.4f}" if history else "nothing to do")
    print(f"{spec.name}: {result} after {trainer.step_count} steps; training {rate:.0f} images/s on "
          f"{comm.size if comm else 1} rank(s) x {net.threads} thread(s); {wall:.1f} s in all, evaluation included")
    return 0


def save_plot(history: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = [h["epoch"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for key, label in (("train", "train"), ("val", "test")):
        if f"{key}_loss" in history[0]:
            a.plot(epochs, [h[f"{key}_loss"] for h in history], label=label)
            b.plot(epochs, [h[f"{key}_accuracy"] for h in history], label=label)
    a.set(xlabel="epoch", ylabel="loss")
    a.legend()
    b.set(xlabel="epoch", ylabel="top-1 accuracy")
    b.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
