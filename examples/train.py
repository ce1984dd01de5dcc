"""Train a net on the digits data (scikit-learn's bundled 8x8 handwritten digits, upsampled to
16x16) or on a synthetic set, on this machine. `make demo` runs it with the defaults:

    python examples/train.py --net examples/nets/digits.json --epochs 30 --batch-size 32 --lr 0.02

The last line reports the test accuracy and the training throughput in images/s.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.errors import PcldnnError as GenError
from pcldnn_gen.netspec import load_netspec

NET = Path(__file__).parent / "nets" / "digits.json"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default=str(NET), help="net description (default: the digits net)")
    ap.add_argument("--arch", default="native")
    ap.add_argument("--data", choices=("digits", "synthetic"), default="digits")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--schedule", default="cosine", help="constant, step or cosine")
    ap.add_argument("--warmup-steps", type=int, default=0)
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
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def parallel_arg(text: str):
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


def world():
    """MPI.COMM_WORLD when launched by mpiexec with more than one rank, else None."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD if MPI.COMM_WORLD.size > 1 else None


def main(argv=None) -> int:
    args = parse_args(argv)
    comm = world()
    lead = comm is None or comm.rank == 0
    try:
        spec = load_netspec(args.net)
        directory = build(spec, get_arch(args.arch)).directory if lead else None
        if comm is not None:  # rank 0 compiles (or finds the cache), the others load its build
            directory = comm.bcast(directory, root=0)
        net = pr.load(directory, threads=args.threads, seed=args.seed)
        if args.data == "digits":
            train, test = pr.digits(size=spec.input[1])
        else:
            train = pr.synthetic(2048, tuple(spec.input), net.loss_layer.out_shape[0], seed=args.seed)
            test = pr.synthetic(512, tuple(spec.input), net.loss_layer.out_shape[0], seed=args.seed, split=1)
        steps = args.epochs * (len(train) // args.batch_size)
        opt = pr.SGD(args.lr, args.momentum, args.weight_decay, schedule=args.schedule,
                     total_steps=steps if args.schedule == "cosine" else 0,
                     step_size=max(1, steps // 3) if args.schedule == "step" else 0,
                     warmup_steps=args.warmup_steps)
        trace = [] if args.trace and comm is not None else None
        extra = {"trace": trace, "parallel": args.parallel} if comm is not None else {}
        trainer = (pr.Trainer.resume(args.resume, net, opt, comm=comm, **extra) if args.resume
                   else pr.Trainer(net, opt, seed=args.seed, comm=comm, **extra))
        checkpoint = Path(args.checkpoint_dir) / "checkpoint.npz" if args.checkpoint_dir else None
        start = time.perf_counter()
        history = trainer.fit(train, test, epochs=args.epochs, batch_size=args.batch_size,
                              metrics_file=args.metrics, checkpoint=checkpoint, progress=not args.no_progress)
        wall = time.perf_counter() - start
    except (pr.PcldnnError, GenError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        if comm is not None:  # the other ranks may be inside a collective: end the whole job
            sys.stderr.flush()
            comm.Abort(2)
        return 2
    final = trainer.evaluate(test)
    if trace is not None:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        (Path(args.trace) / f"trace-rank{comm.rank}.json").write_text(json.dumps({"traceEvents": trace}))
    if not lead:
        return 0
    for h in history:
        print(f"epoch {h['epoch']:3d}  train loss {h['train_loss']:.4f}  acc {h['train_accuracy']:.4f}  "
              f"test loss {h['val_loss']:.4f}  acc {h['val_accuracy']:.4f}  {h['images_per_s']:.0f} images/s")
    if args.plot and history:
        save_plot(history, args.plot)
    per_epoch = len(train) // args.batch_size * args.batch_size
    train_seconds = sum(per_epoch / h["images_per_s"] for h in history)
    rate = per_epoch * len(history) / train_seconds if history else float("nan")
    print(f"{spec.name}: test accuracy {final['accuracy']:.4f} (loss {final['loss']:.4f}) after "
          f"{trainer.step_count} steps; training {rate:.0f} images/s on {comm.size if comm else 1} rank(s) x "
          f"{net.threads} thread(s); "
          f"{wall:.1f} s in all, evaluation included")
    return 0


def save_plot(history: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    epochs = [h["epoch"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(epochs, [h["train_loss"] for h in history], label="train")
    a.plot(epochs, [h["val_loss"] for h in history], label="test")
    a.set(xlabel="epoch", ylabel="loss")
    a.legend()
    b.plot(epochs, [h["train_accuracy"] for h in history], label="train")
    b.plot(epochs, [h["val_accuracy"] for h in history], label="test")
    b.set(xlabel="epoch", ylabel="top-1 accuracy")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
