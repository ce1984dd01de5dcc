"""The data path against in-memory arrays, training cifar_small (examples/nets): peak resident
memory when the training set is a 2 GB memory-mapped .npy file instead of a 50 MB array, and the
step time when the images are 32x32 PNG files decoded (with augmentation) by background threads.
Each configuration runs in a fresh process; figures are medians of the measured steps.

    python benchmarks/data_pipeline.py --arch native --threads 2 --workdir /tmp/pcldnn-data
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

NET = Path(__file__).resolve().parent.parent / "examples" / "nets" / "cifar_small.json"


def make_data(work: Path, gigabytes: float, pngs: int) -> None:
    """images.npy (uint8, N x 3 x 32 x 32, `gigabytes` large), small.npy (the first 50 MB as
    float32), labels, and a folder of `pngs` PNG files in 10 classes."""
    work.mkdir(parents=True, exist_ok=True)
    n = int(gigabytes * 2 ** 30 // (3 * 32 * 32))
    if not (work / "images.npy").exists():
        images = np.lib.format.open_memmap(work / "images.npy", mode="w+", dtype=np.uint8, shape=(n, 3, 32, 32))
        rng = np.random.default_rng(0)
        for start in range(0, n, 65536):
            stop = min(n, start + 65536)
            images[start:stop] = rng.integers(0, 256, (stop - start, 3, 32, 32), dtype=np.uint8)
        images.flush()
        del images
        np.save(work / "labels.npy", np.random.default_rng(1).integers(0, 10, n).astype(np.int32))
    small = 50 * 2 ** 20 // (3 * 32 * 32 * 4)
    np.save(work / "small_x.npy", np.load(work / "images.npy", mmap_mode="r")[:small].astype(np.float32) / 255)
    np.save(work / "small_y.npy", np.load(work / "labels.npy")[:small])
    folder = work / "png"
    if not folder.exists():
        from PIL import Image
        x = np.load(work / "images.npy", mmap_mode="r")
        y = np.load(work / "labels.npy")
        for i in range(pngs):
            d = folder / f"class{y[i]}"
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.ascontiguousarray(x[i].transpose(1, 2, 0))).save(d / f"{i:06d}.png")


def run(cfg: dict) -> dict:
    """One configuration, in this process: train `steps` steps; peak RSS and step times."""
    import pcldnn_runtime as pr
    from pcldnn_gen import compile as compile_net
    net = pr.load(compile_net(str(NET), arch=cfg["arch"]), threads=cfg["threads"])
    work = Path(cfg["work"])
    aug = pr.Augment(crop_padding=4, flip=True) if cfg.get("augment") else None
    if cfg["data"] == "memmap":
        data = pr.MemmapDataset(work / "images.npy", work / "labels.npy", augment=aug)
    elif cfg["data"] == "array":
        data = pr.ArrayDataset(np.load(work / "small_x.npy"), np.load(work / "small_y.npy"), augment=aug)
    else:
        data = pr.ImageFolder(work / "png", size=(32, 32), augment=aug)
    trainer = pr.Trainer(net, pr.SGD(0.01, momentum=0.9))
    times: list[float] = []
    order = trainer.epoch_order(0, len(data))
    batches = [order[i * cfg["batch"]:(i + 1) * cfg["batch"]] for i in range(cfg["steps"])]
    from pcldnn_runtime.data import prefetched
    last = time.perf_counter()
    for xb, yb in prefetched(data, batches, 0, cfg["workers"], 4):
        trainer.step(xb, yb)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return {"peak_rss_mb": _peak_rss_mb(),
            "step_ms": 1e3 * statistics.median(times[5:]), "samples": len(data)}


def _peak_rss_mb() -> float:
    """This process's own peak resident set (VmHWM: reset at exec, unlike ru_maxrss, which Linux
    carries over from the parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--arch", default="native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--gigabytes", type=float, default=2.0)
    ap.add_argument("--pngs", type=int, default=4000)
    ap.add_argument("--workdir", default="/tmp/pcldnn-data")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run(json.loads(args.one))))
        return
    work = Path(args.workdir)
    make_data(work, args.gigabytes, args.pngs)
    base = {"arch": args.arch, "threads": args.threads, "workers": args.workers, "batch": args.batch,
            "steps": args.steps, "work": str(work)}
    results = {}
    for name, extra in (("array", {"data": "array"}), ("memmap", {"data": "memmap"}),
                        ("array+augment", {"data": "array", "augment": True}),
                        ("png+augment", {"data": "png", "augment": True})):
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps(base | extra)], capture_output=True,
                             text=True, check=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
        print(f"{name:<14} {results[name]['samples']:>8} samples  peak RSS {results[name]['peak_rss_mb']:7.0f} MB  "
              f"step {results[name]['step_ms']:7.2f} ms", flush=True)
    print(f"memmap - array peak RSS: {results['memmap']['peak_rss_mb'] - results['array']['peak_rss_mb']:.0f} MB "
          f"(target <= 300); png+augment / array+augment step time: "
          f"{results['png+augment']['step_ms'] / results['array+augment']['step_ms']:.2f} (target <= 1.15)")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": base, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
