"""`pcldnn-gen` command line: argument parsing only; each verb is one call into a stage."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn

from pcldnn_runtime.cpu import PRECISIONS
from pcldnn_runtime.limits import plural
from pcldnn_runtime.validate import check_writable

from . import __version__
from .arch import get_arch
from .build import build, check_precision, computed_by, fuse_plans, net_activations, net_gradients, plan_kernel
from .codegen import render_kernel
from .errors import PcldnnError
from .netspec import load_netspec
from .planner import LAYER_PASSES, PASSES


def _compile(args: argparse.Namespace) -> int:
    net = load_netspec(args.net, args.max_memory)
    arch = get_arch(args.arch)
    t0 = time.perf_counter()
    weights = None
    if args.weights:
        from pcldnn_runtime.state_io import read_npz
        weights = read_npz(args.weights)
    result = build(net, arch, Path(args.output) if args.output else None, args.jobs, _tuning(args),
                   weights=weights, weights_origin=str(args.weights), precision=args.precision,
                   fusion=not args.no_fusion)
    elapsed = time.perf_counter() - t0
    for layer in net.layers:
        shape = "x".join(map(str, layer.out_shape))
        detail = "  ".join(
            f"{p} {plan.tile.width}x{plan.tile.vectors}v {plan.predicted_efficiency:.0%}"
            f"{' tuned' if plan.measured is not None else ''}"
            for (name, p), plan in result.plans.items() if name == layer.name and plan.tile is not None)
        print(f"  {layer.name:<12} {layer.type:<22} -> {shape:<14} {detail}")
    print(f"{result.directory}: {plural(len(net.layers), 'layer')}, {plural(result.compiled, 'kernel')} compiled, "
          f"{result.cached} from cache, {elapsed:.2f} s ({arch.name}, {args.precision})")
    return 0


def _import(args: argparse.Namespace) -> int:
    from .onnx_frontend import import_onnx, write_net
    net, state = import_onnx(args.model, args.name)
    out = Path(args.output) if args.output else Path(args.model).with_suffix(".json")
    if out.suffix != ".json":
        raise PcldnnError(f"{out}: the output must be a .json file (the weights go beside it as .npz)")
    net_path, weights = write_net(net, state, out)
    layers = ", ".join(f"{l['name']} ({l['type']})" for l in net["layers"])
    print(f"{net_path}: {len(net['layers'])} layers: {layers}")
    print(f"{weights}: {len(state)} arrays; compile with `pcldnn-gen compile {net_path} --weights {weights}`")
    return 0


def _tuning(args: argparse.Namespace) -> Any:
    """The tuning database unless --no-tuning (then the model decides every tile)."""
    from .tuning import TuningDB
    return None if args.no_tuning else TuningDB.load()


def _inspect(args: argparse.Namespace) -> int:
    """The C of one kernel, or (--explain) the plan of each pass asked for (every pass of the
    layer unless --pass names one)."""
    net = load_netspec(args.net, args.max_memory)
    arch = get_arch(args.arch)
    check_precision(args.precision, arch)
    asked = net.layer(args.layer)
    passes = [args.pass_name] if args.pass_name else list(LAYER_PASSES[asked.type]) if args.explain else ["fwd"]
    tuning = _tuning(args)
    serving = computed_by(net, arch, args.precision, asked.name)
    layer = asked if serving is None else net.layer(serving)
    activations = net_activations(net, arch, args.precision)[layer.name]
    gradients = net_gradients(net, arch, args.precision)[layer.name]
    for n, pass_name in enumerate(passes):
        if serving is not None:  # a residual fusion: the add's work is its batchnorm's kernel (docs/design.md)
            pass_name = "fwd" if pass_name == "fwd" else "bwd_weights"
            print(f"/* {asked.name} ({asked.type}) is computed by {serving}'s {pass_name} kernel (a residual "
                  "fusion), below */")
        plan = plan_kernel(layer, pass_name, arch, tuning, None, args.precision, activations, gradients)
        plan = fuse_plans(net, arch, args.precision, {(layer.name, pass_name): plan})[(layer.name, pass_name)]
        if not args.explain:
            sys.stdout.write(render_kernel(layer, plan, arch).text)
            continue
        print(("\n" if n else "") + f"{layer.name} {plan.pass_name} on {arch.name}: {plan.reason}")
        if plan.tile is not None:
            print(f"chosen   : {plan.tile.describe()}, row average {plan.predicted_efficiency:.0%}; "
                  f"L2->L1 {plan.l2_bytes_per_flop:.4f} B/FLOP")
            for t in plan.rejected:
                print(f"rejected : {t.describe()}")
            print(_measured_lines(plan) if plan.measured else
                  f"measured : none (`pcldnn-gen tune {args.net} --arch {args.arch}"
                  f"{'' if args.precision == 'fp32' else ' --precision ' + args.precision}` times the candidates)")
    if args.explain:
        print("\n% of peak, predicted or measured: nominal FLOPs (2 per multiply-add of the layer's definition, "
              "padding taps included) over the FMA peak; a kernel that skips padded taps can show more than 100%")
    return 0


def _measured_lines(plan: Any) -> str:
    """The model's prediction beside the tuner's measurement, one candidate per line (a bf16
    kernel's % of the fp32 FMA peak, as `bench` gives it: vdpbf16ps can run at twice it)."""
    from .tuning import kernel_precision
    m = plan.measured
    fp32 = kernel_precision(plan) == "fp32"
    lines = [f"measured : minibatch {m.batch}, {m.threads} thread(s), {'' if fp32 else 'fp32 '}FMA peak "
             f"{m.peak_gflops:.1f} GFLOP/s", f"           tile     predicted  measured ms  % of {'' if fp32 else 'fp32 '}peak"]
    for t in m.timings:
        notes = [n for n, tile in (("model's first choice", m.model), ("used", (plan.tile.width, plan.tile.vectors)))
                 if tile == (t.width, t.vectors)]
        lines.append(f"           {t.width}x{t.vectors:<6} {t.predicted_efficiency:9.0%} {t.ms:12.3f} "
                     f"{m.percent_of_peak(t):10.0%}  {', '.join(notes)}")
    return "\n".join(lines)


def _tune(args: argparse.Namespace) -> int:
    from . import tuner
    from .tuning import TuningDB
    if (args.net is None) == (args.zoo is None):
        raise PcldnnError("tune: give a net file or --zoo FILE (one of the two)")
    arch = get_arch(args.arch)
    threads = args.threads or _cores()
    if args.zoo:
        from .zoo import load_zoo
        # bf16: a shape between ReLUs, on the bf16 activations it has inside a net (as `bench` times it)
        nets = [s.inner if args.precision == "bf16" else s.net for s in load_zoo(args.zoo, args.max_memory)]
    else:
        nets = [load_netspec(args.net, args.max_memory)]
    tuner.check_can_tune(arch, args.precision)
    db = TuningDB.load()
    db.check_writable()
    _check_outputs(args, "--json")
    print(f"tuning {len(nets)} net(s) on {arch.name} ({args.precision}), minibatch {args.batch}, {threads} "
          f"thread(s); database {db.path}", flush=True)
    report = tuner.tune(nets, arch, args.batch, threads, candidates=args.candidates, rounds=args.rounds,
                        repeats=args.repeats, budget=args.budget, force=args.force, db=db,
                        progress=lambda line: print(line, flush=True), precision=args.precision)
    print(tuner.summary(report))
    if args.json:
        Path(args.json).write_text(json.dumps(tuner.report_json(report, arch, args.batch, threads, args.precision),
                                              indent=1))
    return 0


def _peak(args: argparse.Namespace) -> int:
    from .bench import measure_peak
    arch = get_arch(args.arch)
    counts = sorted({1, args.threads or _cores()})
    base = None
    for n in counts:
        gflops = measure_peak(arch, n)
        base = base or gflops
        print(f"{arch.name}: {n} thread(s): {gflops:.1f} GFLOP/s FMA peak ({gflops / base:.2f}x one thread)")
    return 0


def _cache(args: argparse.Namespace) -> int:
    from pcldnn_runtime.limits import format_bytes

    from .compiler import cache_dir, cache_entries, prune_cache
    cache = cache_dir()
    if cache.exists() and not cache.is_dir():
        raise PcldnnError(f"{cache}: the kernel cache is not a directory (PCLDNN_CACHE_DIR names it)")
    limits = args.max_size is not None or args.older_than is not None
    if args.action != "prune" and limits:
        raise PcldnnError(f"cache {args.action}: --max-size and --older-than go with prune")
    if args.action == "info":
        if args.dry_run:
            raise PcldnnError("cache info: --dry-run goes with prune and clear")
        entries = cache_entries(cache)
        now = time.time()
        for kind, what in (("kernel", ("kernel library", "kernel libraries")),
                           ("header", ("precompiled header", "precompiled headers"))):
            some = [e for e in entries if e.kind == kind]
            ages = [now - e.last_used for e in some]
            used = f", last used {_ago(min(ages))} to {_ago(max(ages))} ago" if some else ""
            print(f"{cache}: {plural(len(some), *what)}, {format_bytes(sum(e.size for e in some))}{used}")
        tuning = cache / "tuning.json"
        if tuning.is_file():
            print(f"{tuning}: the tuning database (prune and clear keep it)")
        return 0
    if args.action == "prune" and not limits:
        raise PcldnnError("cache prune: give --max-size SIZE and/or --older-than DAYS (or use `cache clear`)")
    result = prune_cache(cache, 0 if args.action == "clear" else args.max_size,
                         None if args.older_than is None else args.older_than * 86400, dry_run=args.dry_run)
    print(f"{cache}: {'would remove' if args.dry_run else 'removed'} {plural(len(result.removed), 'entry', 'entries')} "
          f"({format_bytes(result.freed)}), kept {len(result.kept)} ({format_bytes(sum(e.size for e in result.kept))})"
          + (f", {len(result.busy)} in use by a compile (kept)" if result.busy else "")
          + (f", {result.temporaries} leftover temporaries removed" if result.temporaries else ""))
    return 0


def _ago(seconds: float) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            return plural(round(seconds / size), unit)
    return plural(round(max(seconds, 0)), "second")


def _cores() -> int:
    from pcldnn_runtime import cpu
    return cpu.usable_cores()


def _check_outputs(args: argparse.Namespace, *flags: str) -> None:
    """The files a verb writes at the end, checked before its measuring starts."""
    for flag in flags:
        path = getattr(args, flag.lstrip("-").replace("-", "_"))
        if path:
            check_writable(path, flag)


def _bench(args: argparse.Namespace) -> int:
    from . import bench
    if (args.net is None) == (args.zoo is None):
        raise PcldnnError("bench: give a net file or --zoo FILE (one of the two)")
    _check_outputs(args, "--json", "--plot")
    arch = get_arch(args.arch)
    threads = args.threads or _cores()
    passes = tuple(args.passes.split(","))
    bad = [p for p in passes if p not in PASSES]
    if bad:
        raise PcldnnError(f"--passes: unknown pass {', '.join(bad)}; known: {', '.join(PASSES)}")
    compare = tuple(c for c in args.compare.split(",") if c) if args.compare else ()
    if len(args.batch) > 1:
        if args.zoo or compare or args.plot:
            raise PcldnnError("bench: several --batch values (the efficiency curve) go with a net file, without "
                              "--zoo, --compare or --plot")
        if args.precision != "fp32":
            raise PcldnnError("bench: the efficiency curve (several --batch values) is measured in fp32 only")
        net = load_netspec(args.net, args.max_memory)
        layers = args.layers.split(",") if args.layers else None
        peak, curve = bench.bench_curve(net, arch, args.batch, threads, passes, layers, args.repeats, _tuning(args))
        print(bench.format_curve(net.name, arch, threads, peak, curve))
        if args.json:
            Path(args.json).write_text(json.dumps(bench.results_json(net.name, arch, args.batch, threads, peak,
                                                                     [r for rows in curve.values() for r in rows]),
                                                  indent=1))
        return 0
    args.batch = args.batch[0]
    if args.zoo:
        from .zoo import load_zoo
        shapes = load_zoo(args.zoo, args.max_memory)
        if args.layers:
            wanted = set(args.layers.split(","))
            unknown = wanted - {s.name for s in shapes}
            if unknown:
                raise PcldnnError(f"{args.zoo}: no shape named {', '.join(sorted(unknown))}")
            shapes = [s for s in shapes if s.name in wanted]
        title = f"zoo {Path(args.zoo).name}"
        peak, results = bench.bench_zoo(shapes, arch, args.batch, threads, passes, args.repeats, compare, args.rounds,
                                        _tuning(args), args.precision)
    else:
        net = load_netspec(args.net, args.max_memory)
        title = net.name
        layers = args.layers.split(",") if args.layers else None
        peak, results = bench.bench_net(net, arch, args.batch, threads, passes, layers, args.repeats, compare,
                                        rounds=args.rounds, tuning=_tuning(args), precision=args.precision)
    shown = title if args.precision == "fp32" else f"{title} ({args.precision} build: %peak against the fp32 FMA peak)"
    print(bench.format_table(shown, arch, args.batch, threads, peak, results))
    if args.json:
        Path(args.json).write_text(json.dumps(bench.results_json(title, arch, args.batch, threads, peak, results,
                                                                 zoo=bool(args.zoo), precision=args.precision), indent=1))
    if args.plot:
        bench.plot(Path(args.plot), shown, arch, results)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from pcldnn_runtime import scaling

    from . import scaling_report as report
    _check_outputs(args, "--json", "--plot", "--timeline")
    net = load_netspec(args.net, args.max_memory)
    nodes = report.parse_nodes(args.nodes)
    per_node = sorted({-(-args.batch // p) for p in nodes})  # the per-node minibatches the plans need
    machine = (report.local_machine(net, args.arch, per_node, args.bench_json, args.threads)
               if args.machine == "local" else scaling.get_machine(args.machine))
    strategies, simulated, minima, sims = report.run(net, machine, nodes, args.batch, args.threshold,
                                                     args.gradient_exchange, args.sync_batchnorm)
    print(report.format_table(net, machine, strategies, simulated, minima, args.threshold, args.epoch_images,
                              args.epochs))
    if args.json:
        Path(args.json).write_text(json.dumps(
            report.report_json(net, machine, strategies, simulated, minima, args.threshold, args.epoch_images), indent=1))
    if args.plot:
        report.plot_speedup(Path(args.plot), net, machine, strategies, simulated)
    if args.timeline:
        report.plot_timeline(Path(args.timeline), net, machine, strategies[-1], sims[-1])
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error (the usage is one --help away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="pcldnn-gen", description=__doc__.split(":")[0] + ": "
                                 "generate, compile and inspect CPU training kernels for a net.json")
    ap.add_argument("--version", action="version", version=f"pcldnn-gen {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    c = sub.add_parser("compile", help="plan, generate and compile every kernel of a net into a build directory")
    c.add_argument("net", help="network description (net.json)")
    c.add_argument("--arch", default="native", help="native (default), a CPU family (haswell, skylake-x, icelake, "
                   "sapphirerapids, zen3, zen4, zen5), avx2, avx512, scalar, or an arch JSON file")
    c.add_argument("-o", "--output", help="build directory (default build/<net>-<arch>[-bf16][-nofusion]: <arch> the "
                   "preset, e.g. avx2, or native-<isa> for --arch native)")
    c.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="kernel number format: fp32 (default) or bf16 (bf16 activations and weight copy, fp32 "
                        "accumulation and master weights; AVX-512 builds, run on CPUs with AVX512_BF16)")
    c.add_argument("--jobs", type=_int_in(1, 256), default=None, help="parallel compiler processes (default: cores)")
    c.add_argument("--no-fusion", action="store_true", help="every layer's kernels compute its own work only (no "
                   "convolution computing batchnorm statistics, no batchnorm computing its residual add)")
    c.add_argument("--weights", help="initial weights (.npz with <layer>.weight and <layer>.bias in canonical "
                   "layouts, as `pcldnn-gen import` writes): recorded in the build, loaded by pr.load")
    _no_tuning_option(c)
    _max_memory_option(c)
    c.set_defaults(func=_compile)

    i = sub.add_parser("inspect", help="print the C emitted for one layer and pass")
    i.add_argument("net")
    i.add_argument("--layer", required=True)
    i.add_argument("--pass", dest="pass_name", choices=PASSES,
                   help="the pass (default: fwd for the C; every pass of the layer with --explain)")
    i.add_argument("--arch", default="native")
    i.add_argument("--precision", choices=PRECISIONS, default="fp32", help="bf16: the kernel a bf16 build holds")
    i.add_argument("--explain", action="store_true",
                   help="print each pass's plan, the rejected tiles and the tuner's measurements instead of C")
    _no_tuning_option(i)
    _max_memory_option(i)
    i.set_defaults(func=_inspect)

    k = sub.add_parser("peak", help="measure the FMA peak (GFLOP/s) with a generated micro-kernel")
    k.add_argument("--arch", default="native")
    k.add_argument("--threads", type=_int_in(1, 4096), default=None, help="also measure with N threads (default: all cores)")
    k.set_defaults(func=_peak)

    b = sub.add_parser("bench", help="time every conv/fc layer and pass against the peak and baselines")
    b.add_argument("net", nargs="?", help="a net file (or --zoo)")
    b.add_argument("--zoo", help="a shape zoo file (benchmarks/zoo/zoo.json): every shape as a one-layer net")
    b.add_argument("--arch", default="native")
    b.add_argument("--threads", type=_int_in(1, 4096), default=None, help="OpenMP threads (default: all cores)")
    b.add_argument("--batch", type=_int_list(1, 1 << 20), default=[16],
                   help="minibatch, or several (1,2,4,...,64: each layer and pass at each, and the efficiency "
                        "curve `plan --machine local --bench-json` uses); default 16")
    b.add_argument("--passes", default=",".join(PASSES), help="comma-separated, default all")
    b.add_argument("--layers", default=None,
                   help="comma-separated conv, fc or batchnorm layers, or zoo shapes (default all)")
    b.add_argument("--repeats", type=_int_in(1, 1000), default=5)
    b.add_argument("--rounds", type=_int_in(1, 100), default=2,
                   help="rounds of (our kernels, baselines) per layer; ratios are the median of the per-round ratios")
    b.add_argument("--compare", default="", help="comma-separated baselines: numpy, onednn (needs torch)")
    b.add_argument("--json", help="write the results as JSON")
    b.add_argument("--plot", help="write a bar chart (PNG; needs matplotlib)")
    b.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16: time a bf16 build's kernels (against oneDNN on bf16 tensors with --compare onednn)")
    _no_tuning_option(b)
    _max_memory_option(b)
    b.set_defaults(func=_bench)

    t = sub.add_parser("tune", help="time the model's best few tiles per kernel; record the fastest for compile")
    t.add_argument("net", nargs="?", help="a net file (or --zoo)")
    t.add_argument("--zoo", help="a shape zoo file: every shape as a one-layer net")
    t.add_argument("--arch", default="native")
    t.add_argument("--threads", type=_int_in(1, 4096), default=None, help="OpenMP threads (default: all cores)")
    t.add_argument("--batch", type=_int_in(1, 1 << 20), default=16, help="minibatch the kernels are timed at")
    t.add_argument("--candidates", type=_int_in(2, 6), default=4, help="tiles per kernel, the model's best first")
    t.add_argument("--rounds", type=_int_in(1, 1000), default=15,
                   help="interleaved rounds; candidates are compared on the median of per-round ratios")
    t.add_argument("--repeats", type=_int_in(1, 1000), default=1,
                   help="timed calls per candidate and round, after a warm-up call (median)")
    t.add_argument("--budget", type=_seconds, default=None, metavar="SECONDS",
                   help="stop measuring after this long (kernels not reached keep the model's tile)")
    t.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16: tune the kernels of the net's bf16 build (on a CPU with AVX512_BF16)")
    t.add_argument("--force", action="store_true", help="measure kernels that already have an entry again")
    t.add_argument("--json", help="write the measurements as JSON")
    _max_memory_option(t)
    t.set_defaults(func=_tune)

    ca = sub.add_parser("cache", help="the kernel cache: its size (info), prune it least recently used first, or "
                                      "clear it (the tuning database is kept)")
    ca.add_argument("action", nargs="?", choices=("info", "prune", "clear"), default="info")
    ca.add_argument("--max-size", type=_size("--max-size"), metavar="SIZE",
                    help="prune: remove the least recently used entries until the cache takes at most SIZE (e.g. 2G)")
    ca.add_argument("--older-than", type=_days, metavar="DAYS", help="prune: remove entries unused for more than DAYS")
    ca.add_argument("--dry-run", action="store_true", help="prune, clear: say what would go, remove nothing")
    ca.set_defaults(func=_cache)

    pl = sub.add_parser("plan", help="predict multi-node scaling and choose data / model / hybrid parallelism per layer")
    pl.add_argument("net")
    pl.add_argument("--machine", required=True,
                    help="cori-haswell, aws-c4, local (measured now) or a machine JSON file")
    pl.add_argument("--nodes", default="1,2,4,8,16", help="comma-separated node counts (default 1,2,4,8,16)")
    pl.add_argument("--batch", type=_int_in(1, 2 ** 31 - 1), required=True, help="global minibatch")
    pl.add_argument("--threshold", type=_fraction, default=0.8,
                    help="parallel efficiency for the minimum per-node minibatch column (default 0.8)")
    pl.add_argument("--arch", default="native", help="--machine local: the ISA whose FMA peak is measured")
    pl.add_argument("--threads", type=_int_in(1, 4096), default=1, help="--machine local: threads per rank (a node)")
    pl.add_argument("--bench-json", default=None,
                    help="--machine local: kernel efficiencies from `pcldnn-gen bench NET --json` of this net")
    pl.add_argument("--epoch-images", type=_int_in(1, 10 ** 12), default=None, metavar="N",
                    help="also print the time of one epoch of N images (ImageNet-1K: 1281167)")
    pl.add_argument("--epochs", type=_int_in(1, 10 ** 6), default=1,
                    help="with --epoch-images: the time of this many epochs (default 1)")
    pl.add_argument("--gradient-exchange", choices=("fp32", "bf16"), default="fp32",
                    help="weight gradients part-reduced and broadcast as fp32 (default) or bf16, as `train` sends them")
    pl.add_argument("--sync-batchnorm", action="store_true",
                    help="batchnorm statistics over every node's shard: two allgathers per batchnorm layer a step")
    pl.add_argument("--json", help="write the plans as JSON")
    pl.add_argument("--plot", help="write predicted speedup against nodes (PNG)")
    pl.add_argument("--timeline", help="write the simulated timeline of one iteration at the largest node count (PNG)")
    _max_memory_option(pl)
    pl.set_defaults(func=_plan)

    im = sub.add_parser("import", help="an ONNX model as a net description (NET.json) and its weights (NET.npz)")
    im.add_argument("model", help="ONNX model file (needs the onnx package)")
    im.add_argument("-o", "--output", help="net description to write (default: MODEL with .json); the weights "
                    "go beside it with .npz")
    im.add_argument("--name", help="the net's name (default: the graph's name)")
    im.set_defaults(func=_import)

    tr = sub.add_parser("train", help="compile a net and train it with SGD on digits, synthetic data, an image "
                        "folder or .npy files (under mpiexec: over the ranks)")
    from .train_cli import add_arguments, run
    add_arguments(tr)
    tr.set_defaults(func=run)
    return ap


def _no_tuning_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-tuning", action="store_true",
                   help="ignore the tuning database (PCLDNN_TUNING_DB, default <cache dir>/tuning.json): model only")


def _max_memory_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-memory", type=_size("--max-memory"), default=None, metavar="SIZE",
                   help="refuse nets that need more memory than SIZE to train at minibatch 1 (e.g. 64G; "
                        "default PCLDNN_MAX_MEMORY or 16G)")


def _size(option: str) -> Any:
    """argparse type: a byte count as `option` takes it (1M to 1024T, K/M/G/T binary)."""
    def parse(text: str) -> int:
        from pcldnn_runtime.limits import parse_bytes
        try:
            return parse_bytes(text, option)
        except PcldnnError as e:
            raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None
    return parse


def _days(text: str) -> float:
    try:
        value = float(text) if len(text) <= 20 else -1.0
    except ValueError:
        value = -1.0
    if not 0 <= value <= 36500:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number of days in [0, 36500], got {text[:40]!r}")
    return value


def _int_in(lo: int, hi: int) -> Any:
    """argparse type: an int in [lo, hi] (thread counts, batch sizes, repeats all have a range)."""
    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 12 else lo - 1
        except ValueError:
            value = lo - 1
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be an int in [{lo}, {hi}], got {text[:40]!r}")
        return value
    return parse


def _int_list(lo: int, hi: int) -> Any:
    """argparse type: comma-separated distinct ints in [lo, hi], at most 16, ascending."""
    one = _int_in(lo, hi)

    def parse(text: str) -> list[int]:
        parts = text.split(",")
        if not 1 <= len(parts) <= 16:
            raise argparse.ArgumentTypeError(f"give 1 to 16 comma-separated values, got {text[:40]!r}")
        return sorted({one(part.strip()) for part in parts})
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text) if len(text) <= 20 else -1.0
    except ValueError:
        value = -1.0
    if not 0 < value <= 7 * 24 * 3600:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, 604800], got {text[:40]!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text[:40]!r}")
    return value


def _warning(message: Any, category: Any, filename: Any, lineno: Any, file: Any = None, line: Any = None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    warnings.showwarning = _warning
    try:
        return args.func(args)
    except PcldnnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `pcldnn-gen inspect ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # an output that became unwritable after its check (disk full, removed folder)
        print(f"error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 2
    except MemoryError:
        print("error: out of memory (the net or its minibatch is too large for this machine)", file=sys.stderr)
        return 2
    except Exception as e:  # a bug, not bad input: one line, the traceback on request
        if os.environ.get("PCLDNN_DEBUG"):
            raise
        print(f"error: internal error ({type(e).__name__}: {e}); please report it "
              "(PCLDNN_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
