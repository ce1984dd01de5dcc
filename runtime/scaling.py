"""The communication model of synchronous SGD on p nodes (the paper's RQ2), closed form and
simulated: which layers go data, model or hybrid parallel, and what an iteration costs.

Per layer and global minibatch B on p nodes, with a group size g (1: data parallel; p: model
parallel; in between: hybrid, model parallel within groups of g nodes and data parallel
across the p/g groups):

- compute, per pass: max(FLOPs / (peak x efficiency of that kernel), bytes / memory
  bandwidth): each node computes B g / p rows for 1/g of the layer's outputs. The memory term
  is what makes a small-minibatch fc layer slow: its weights are read once per pass.
- data-parallel communication (hidden behind the backward pass of the layers below when the
  machine overlaps): part-reduce (reduce-scatter) and part-broadcast (all-gather) of the
  node's 1/g of the weights over the p/g groups.
- model-parallel communication (on the critical path), within the group: the input gathered
  and the output exchanged all-to-all in the forward pass; the output gradient exchanged and
  the input gradient reduce-scattered in the backward pass.

Collective costs are the alpha-beta-gamma models of Thakur, Rabenseifner and Gropp (2005),
for ring or recursive halving/doubling algorithms. A batchnorm layer is modelled as memory
bound (its bytes at the memory bandwidth: the forward pass reads its input twice, for the
statistics and to normalize; each backward pass reads input and output gradient and writes
one): in a ResNet it is a real share of a step, and its scale and shift are communicated like
any weights. A depthwise convolution does 1/C of a dense one's FLOPs on the same bytes: the
memory term decides it. The other memory-bound layers (pooling, ReLU, add, concat, dropout,
the loss) and the SGD update are not modelled: a few per cent of a step here.

The iteration time, layers 1..n bottom to top, b_L the backward time of layer L (model-parallel
exchanges included) and c_L its data-parallel communication, issued when its backward ends and
served in that order by one network link per node:

    T = F + max(sum_L b_L, max_L (sum_{j >= L} b_j + sum_{j <= L} c_j))      (overlap)
    T = F + sum_L b_L + sum_L c_L                                             (no overlap)

`simulate` replays the same iteration event by event on p nodes (where model-parallel
exchanges also wait for the link), as the closed form's check and for timelines.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import PcldnnError
from .validate import LABEL_RE, Fields, read_json

KINDS = ("conv_fwd", "conv_bwd_data", "conv_bwd_weights", "fc_fwd", "fc_bwd_data", "fc_bwd_weights")
ALGORITHMS = ("ring", "rhd")


@dataclass(frozen=True)
class Machine:
    name: str
    nodes_note: str          # what one node is
    peak_gflops: float       # FP32 FMA peak of one node
    efficiency: dict         # fraction of the peak each kernel kind reaches (KINDS)
    memory_gbs: float        # sustained memory bandwidth of one node
    latency_us: float        # alpha: one message
    bandwidth_gbs: float     # 1 / beta: one node's link
    reduce_gbs: float        # 1 / gamma: summing received data
    algorithm: str = "rhd"   # ring | rhd (recursive halving / doubling)
    overlap: bool = True     # data-parallel communication runs behind the backward pass
    source: str = ""
    cores: int = 1           # threads one node's kernels share their parallel loops among
    arch: str = ""           # the generator's CPU preset whose plans give those loops ("": not modelled)
    step_cv: float = 0.0     # coefficient of variation of a node's compute time per step (stragglers)
    # Measured efficiency against the per-node minibatch, per kind: ((minibatch, fraction), ...)
    # ascending; where given it replaces `efficiency` (interpolated in log minibatch, clamped).
    efficiency_curve: dict = field(default_factory=dict)
    # What the peak and the efficiencies describe: fp32 kernels (FMAs), or bf16 ones (AMX tiles or
    # vdpbf16ps), whose activations are stored in 2 bytes (docs/precision.md)
    precision: str = "fp32"

    def to_json(self) -> dict:
        return asdict(self)

    def efficiency_at(self, kind: str, rows: float) -> float:
        """Fraction of the peak a `kind` kernel reaches at a per-node minibatch of `rows`."""
        curve = self.efficiency_curve.get(kind)
        if not curve:
            return self.efficiency[kind]
        if rows <= curve[0][0]:
            return curve[0][1]
        for (b0, e0), (b1, e1) in itertools.pairwise(curve):
            if rows <= b1:
                t = math.log(rows / b0) / math.log(b1 / b0)
                return e0 + t * (e1 - e0)
        return curve[-1][1]


@dataclass(frozen=True)
class ParallelLoop:
    """The work items a kernel's parallel loop shares among a node's threads at minibatch
    rows: per_rows x ceil(rows / rows_per_item) when per_rows > 0, else `fixed` (loops over
    weight tiles or K blocks do not depend on the minibatch). From the generator's plans
    (pcldnn_gen.planner.parallel)."""
    per_rows: int
    rows_per_item: int
    fixed: int

    def items(self, rows: float) -> int:
        return self.per_rows * math.ceil(rows / self.rows_per_item) if self.per_rows else self.fixed


def division_efficiency(items: int, threads: int) -> float:
    """Share of the threads' time spent working when `items` equal items go round-robin to
    `threads` threads (a static schedule): the last round leaves threads idle."""
    if items <= 0 or threads <= 1:
        return 1.0
    return items / (threads * math.ceil(items / threads))


@functools.lru_cache(maxsize=4096)
def expected_max_normal(p: int) -> float:
    """E[max of p independent standard normal variables] (0 for p = 1), by quadrature of
    p x phi(x) Phi(x)^(p-1) x over [-12, 12] (error below 1e-6 for any p up to 1e6)."""
    if p <= 1:
        return 0.0
    n, lo, hi = 6000, -12.0, 12.0
    h = (hi - lo) / n
    total = 0.0
    for i in range(n + 1):
        x = lo + i * h
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        density = math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        w = 0.5 if i in (0, n) else 1.0
        total += w * x * p * density * cdf ** (p - 1)
    return total * h


def straggler_factor(p: int, cv: float) -> float:
    """Expected slowest-of-p compute time over the mean, per-node times normal with deviation
    cv x mean: a synchronous iteration waits for the slowest node."""
    return 1.0 + cv * expected_max_normal(p)


def _eff(conv: tuple[float, float, float], fc: tuple[float, float, float]) -> dict:
    return dict(zip(KINDS, conv + fc))


# Per-node compute time of a step varies (other processes, memory and frequency effects); a
# synchronous iteration waits for the slowest node. The presets assume the coefficient of
# variation measured by benchmarks/scaling.py on this project's machine: median 3.9% over 24
# rank runs of cifar_small and VGG-A at 64x64 (range 1.0-67%; `benchmarks/scaling.py --arch
# native --repeats 3`, docs/scaling.md "Stragglers"). No per-node figure is published for the
# paper's clusters.
STEP_CV = 0.039

PRESETS: dict[str, Machine] = {
    # NERSC Cori phase 1 (the paper's cluster): 2x Xeon E5-2698 v3, 16 Haswell cores each at
    # 2.3 GHz, 2 AVX2 FMA units: 32 x 2.3 GHz x 32 FLOP/cycle = 2355 GFLOP/s. DDR4-2133, 8
    # channels: 136 GB/s peak, ~110 sustained (STREAM). Cray Aries dragonfly: ~8 GB/s MPI
    # bandwidth per node and ~2 us latency (NERSC's published MPI figures); Cray MPICH reduces
    # with recursive halving / doubling. Efficiencies: the paper's single-node claims (~90% of
    # peak on convolutions, ~70% on fc), taken a little lower for the backward passes.
    "cori-haswell": Machine("cori-haswell", "2x Xeon E5-2698 v3 (32 Haswell cores, 2.3 GHz), Cray Aries",
                            2355.2, _eff((0.85, 0.80, 0.80), (0.70, 0.65, 0.65)), 110.0, 2.0, 8.0, 35.0,
                            "rhd", True, "Das et al. 2016 section 5; NERSC Cori phase 1 configuration",
                            cores=32, arch="haswell", step_cv=STEP_CV),
    # AWS c4.8xlarge: 36 vCPUs = 18 Haswell cores (Xeon E5-2666 v3) at 2.9 GHz:
    # 18 x 2.9 GHz x 32 = 1670 GFLOP/s; ~80 GB/s memory; 10 Gigabit Ethernet (1.25 GB/s line
    # rate, ~1.1 GB/s through TCP) with ~50 us MPI latency in a placement group; ring
    # collectives (Open MPI over TCP for large messages). Same kernel efficiencies as Cori.
    "aws-c4": Machine("aws-c4", "c4.8xlarge (18 Haswell cores, 2.9 GHz), 10 GbE",
                      1670.4, _eff((0.85, 0.80, 0.80), (0.70, 0.65, 0.65)), 80.0, 50.0, 1.1, 25.0,
                      "ring", True, "Das et al. 2016 section 6; AWS c4 instance specifications",
                      cores=18, arch="haswell", step_cv=STEP_CV),
    # MLPerf Training v3.0, Intel's closed-division ResNet-50 (88.2 minutes; system
    # 16-nodes-SPR-pytorch, mlcommons/training_results_v3.0 Intel/systems/16-nodes-SPR-pytorch.json
    # and benchmarks/resnet/implementations/pytorch-cpu/run_benchmark.sh): 16 nodes of 2 Xeon
    # Platinum 8480+ (56 cores, 2.00 GHz), 16 x 64 GB DDR5-4800 per socket, Intel E810-C QSFP
    # Ethernet with RDMA (irdma, PSM3; oneCCL over two NIC ports per rank, CCL_MNIC_COUNT=2),
    # Rabenseifner allreduce; run as 32 ranks (`mpiexec -np 32 -ppn 2`, one per socket), global
    # minibatch 3264, bf16 (AMX). A node here is one rank: one socket.
    # - peak: 56 cores x 2.00 GHz x 1024 bf16 FLOP per cycle (tdpbf16ps: a 16x32 by 32x16 tile
    #   product, 16384 FLOP, one per 16 cycles) = 114.7 TFLOP/s, at the listed base clock;
    # - efficiency: this project's AMX kernels on ResNet-50 (bf16, minibatch 16) against 16x the
    #   fp32 FMA peak measured in the same run on one core of the project's Sapphire-Rapids-class
    #   Xeon VM (`benchmarks/step_breakdown.py` with PCLDNN_VERBOSE: conv forward 0.215,
    #   backward-data 0.229, backward-weights 0.137; fc 0.034-0.045): measured, not fitted;
    # - memory: 8 channels x 4800 MT/s x 8 bytes = 307 GB/s peak, 81% sustained (the STREAM /
    #   peak ratio of the Cori preset: an assumption, no STREAM figure is published with the run);
    # - link: two 100 GbE ports a node (4 irdma devices, two dual-port E810-C cards of 100 Gb/s
    #   each) shared by its two ranks: 12.5 GB/s a rank at line rate; 5 us a message (RDMA over
    #   Ethernet, assumed); sums at a third of the memory bandwidth (two reads and a write a value).
    "mlperf-v3-spr": Machine("mlperf-v3-spr", "one socket of a 2x Xeon Platinum 8480+ node (56 cores, 2.0 GHz, AMX), "
                             "E810-C 100 GbE RDMA", 56 * 2.0 * 1024,
                             _eff((0.215, 0.229, 0.137), (0.034, 0.045, 0.045)), 0.81 * 307.2, 5.0, 12.5,
                             0.81 * 307.2 / 3, "rhd", True,
                             "MLPerf Training v3.0 Intel 16-nodes-SPR-pytorch system description and run script; "
                             "Intel Xeon Platinum 8480+ specifications; AMX tdpbf16ps throughput; efficiencies "
                             "measured by benchmarks/step_breakdown.py (runtime/scaling.py PRESETS)",
                             cores=56, arch="sapphirerapids", step_cv=STEP_CV, precision="bf16"),
}

# The machine parallel="auto" plans for when PCLDNN_MACHINE names none: Ethernet-class links,
# where choosing badly costs most.
DEFAULT_MACHINE = "aws-c4"


def get_machine(spec: str) -> Machine:
    """A preset name or the path of a machine JSON file (Machine's fields)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        return machine_from_file(path)
    raise PcldnnError(f"unknown machine {spec!r}: use one of {', '.join(PRESETS)}, local, or a machine JSON file")


def machine_from_file(path: Path) -> Machine:
    return machine_from_dict(read_json(path), str(path))


# Physical ranges of a machine description's numbers (one node, its link).
MACHINE_RANGES = {"peak_gflops": (1e-3, 1e7), "memory_gbs": (1e-3, 1e5), "latency_us": (1e-6, 1e7),
                  "bandwidth_gbs": (1e-6, 1e5), "reduce_gbs": (1e-3, 1e5)}


def machine_from_dict(data: Any, origin: str) -> Machine:
    f = Fields(origin)
    optional = {"algorithm", "overlap", "source", "nodes_note", "cores", "arch", "step_cv", "efficiency_curve",
                "precision"}
    f.obj(data, "", {fld.name for fld in fields(Machine)} - optional, optional)
    values: dict[str, Any] = {name: f.number_in(data[name], name, lo, hi) for name, (lo, hi) in MACHINE_RANGES.items()}
    eff = f.obj(data["efficiency"], "efficiency", KINDS)
    values["efficiency"] = {k: f.number_in(eff[k], f"efficiency.{k}", 0, 1, open_lo=True) for k in KINDS}
    values["name"] = f.string(data["name"], "name", LABEL_RE, "a machine label")
    values["algorithm"] = f.choice(data.get("algorithm", "rhd"), "algorithm", ALGORITHMS)
    values["overlap"] = f.boolean(data.get("overlap", True), "overlap")
    values["source"] = f.text(data.get("source", ""), "source")
    values["nodes_note"] = f.text(data.get("nodes_note", origin[-200:]), "nodes_note")
    values["cores"] = f.int_in(data.get("cores", 1), "cores", 1, 1 << 16)
    values["arch"] = f.string(data["arch"], "arch", LABEL_RE, "an arch preset name") if data.get("arch", "") else ""
    values["step_cv"] = f.number_in(data.get("step_cv", 0.0), "step_cv", 0, 1)
    values["precision"] = f.choice(data.get("precision", "fp32"), "precision", ("fp32", "bf16"))
    curves = f.obj(data.get("efficiency_curve", {}), "efficiency_curve", set(), KINDS)
    values["efficiency_curve"] = {}
    for kind, raw in curves.items():
        points = f.array(raw, f"efficiency_curve.{kind}", 1, 64)
        curve = []
        for i, point in enumerate(points):
            where = f"efficiency_curve.{kind}[{i}]"
            pair = f.array(point, where, 2, 2)
            curve.append((f.int_in(pair[0], f"{where}[0]", 1, 1 << 20),
                          f.number_in(pair[1], f"{where}[1]", 0, 1, open_lo=True)))
        if [b for b, _ in curve] != sorted({b for b, _ in curve}):
            f.fail(f"efficiency_curve.{kind}", "minibatches must be distinct and ascending")
        values["efficiency_curve"][kind] = tuple(curve)
    return Machine(**values)


def machine_from_env() -> Machine:
    """PCLDNN_MACHINE (a preset or JSON file), else DEFAULT_MACHINE: the one "auto" plans for."""
    return get_machine(os.environ.get("PCLDNN_MACHINE", DEFAULT_MACHINE))


# -- collectives (Thakur, Rabenseifner, Gropp 2005) ------------------------------------------
def collective_time(op: str, nbytes: float, q: int, m: Machine) -> float:
    """Seconds for `op` among q nodes. reduce_scatter / allgather / allreduce: nbytes is the
    whole vector; alltoall: the bytes each node holds and redistributes."""
    if q <= 1 or nbytes <= 0:
        return 0.0
    alpha, beta, gamma = m.latency_us * 1e-6, 1 / (m.bandwidth_gbs * 1e9), 1 / (m.reduce_gbs * 1e9)
    steps = q - 1 if m.algorithm == "ring" else math.ceil(math.log2(q))
    share = (q - 1) / q * nbytes
    if op == "reduce_scatter":
        return steps * alpha + share * (beta + gamma)
    if op == "allgather":
        return steps * alpha + share * beta
    if op == "allreduce":
        return collective_time("reduce_scatter", nbytes, q, m) + collective_time("allgather", nbytes, q, m)
    if op == "alltoall":  # pairwise exchange: q - 1 rounds whatever the algorithm
        return (q - 1) * alpha + share * beta
    raise ValueError(op)


# -- layers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerLoad:
    """What the model needs of one weighted layer; per image unless said."""
    name: str
    type: str            # conv | fc | batchnorm (memory bound)
    flops: float         # one pass (forward; each backward pass does as many)
    weight_bytes: float
    in_bytes: float
    out_bytes: float
    first: bool          # the first layer: no backward-data pass (nothing below needs it)
    # Per pass, how its kernel's parallel loop divides among a node's threads (absent: evenly).
    loops: dict = field(default_factory=dict, compare=False)
    exchange: float = 1.0  # bytes sent per weight byte in the part-reduce and -broadcast (bf16 gradients: 0.5)
    sync_values: int = 0   # sync_batchnorm: float64 values each node adds to the statistics' allgathers (2C + 1)

    @staticmethod
    def from_shapes(name: str, type_: str, in_shape: Any, out_shape: Any, kernel: Any, first: bool,
                    groups: int = 1, activation_bytes: float = 4.0, exchange: float = 1.0) -> LayerLoad:
        """A conv (`groups` > 1: each output channel reads IC / groups input channels) or fc layer."""
        ic, ih, iw = in_shape
        oc, oh, ow = out_shape
        kh, kw = kernel
        macs = oc * oh * ow * (ic // groups) * kh * kw
        return LayerLoad(name, type_, 2.0 * macs, 4.0 * (oc * (ic // groups) * kh * kw + oc),
                         activation_bytes * ic * ih * iw, activation_bytes * oc * oh * ow, first, exchange=exchange)

    @staticmethod
    def batchnorm(name: str, shape: Any, activation_bytes: float = 4.0, sync: bool = False,
                  exchange: float = 1.0) -> LayerLoad:
        """A batchnorm: a few FLOPs a value, its input read twice by the forward pass; under
        sync_batchnorm each pass allgathers every node's 2C + 1 statistics (count, two per channel)."""
        c, h, w = shape
        return LayerLoad(name, "batchnorm", 4.0 * c * h * w, 4.0 * 2 * c, 2 * activation_bytes * c * h * w,
                         activation_bytes * c * h * w, False, exchange=exchange, sync_values=2 * c + 1 if sync else 0)


def loads_of(layers: Any, precision: str = "fp32", gradient_exchange: str = "fp32",
             sync_batchnorm: bool = False) -> list[LayerLoad]:
    """LayerLoads of the conv, fc and batchnorm layers among `layers` (objects with name, type,
    in_shape, out_shape, kernel and groups: the generator's LayerSpec or a runtime Layer), bottom
    to top. precision bf16: activations of 2 bytes; gradient_exchange bf16: the weight
    gradients sent as bf16 (`Trainer(..., gradient_exchange="bf16")`); sync_batchnorm: the
    batchnorms' statistics allgathered in both passes (`Trainer(..., sync_batchnorm=True)`)."""
    act = 2.0 if precision == "bf16" else 4.0
    exchange = 0.5 if gradient_exchange == "bf16" else 1.0
    out: list[LayerLoad] = []
    for layer in layers:
        if layer.type in ("conv", "fc"):
            out.append(LayerLoad.from_shapes(layer.name, layer.type, layer.in_shape, layer.out_shape,
                                             tuple(layer.kernel), not out, getattr(layer, "groups", 1), act, exchange))
        elif layer.type == "batchnorm":
            out.append(LayerLoad.batchnorm(layer.name, layer.out_shape, act, sync_batchnorm, exchange))
    return out


@dataclass(frozen=True)
class LayerCost:
    layer: str
    group: int           # 1: data parallel; p: model parallel; else hybrid
    fwd: float           # seconds: forward compute
    bwd: float           # backward compute (data + weights)
    mp_fwd: float        # model-parallel exchanges, forward (critical path)
    mp_bwd: float        # model-parallel exchanges, backward (critical path)
    dp: float            # part-reduce + part-broadcast (overlappable)
    sync: float = 0.0    # sync_batchnorm: each pass's allgather of the statistics, all nodes (critical path)

    @property
    def mode(self) -> str:
        return "data" if self.group == 1 else f"model:{self.group}"


def _compute(load: LayerLoad, kind: str, rows: float, share: float, m: Machine) -> float:
    """One pass on one node: the larger of its FLOPs at the kernel's efficiency for `rows`
    images (thread division included) and its bytes at the memory bandwidth."""
    flops = load.flops * rows * share
    nbytes = load.weight_bytes * share + rows * (load.in_bytes + load.out_bytes * share)
    if load.type == "batchnorm":
        return nbytes / (m.memory_gbs * 1e9)
    efficiency = m.efficiency_at(f"{load.type}_{kind}", rows) * division(load, kind, rows, share, m.cores)
    return max(flops / (m.peak_gflops * 1e9 * efficiency), nbytes / (m.memory_gbs * 1e9))


def division(load: LayerLoad, kind: str, rows: float, share: float, threads: int) -> float:
    """division_efficiency of the pass's parallel loop at `rows` images (the largest shard: a
    node of an uneven split computes ceil(rows)); a model-parallel share of an fc layer's
    outputs has that share of the output groups."""
    loop = load.loops.get(kind)
    if loop is None:
        return 1.0
    items = loop.items(math.ceil(rows - 1e-9))
    if load.type == "fc" and kind != "bwd_data" and share < 1:
        items = max(1, math.ceil(items * share))
    return division_efficiency(items, threads)


def layer_cost(load: LayerLoad, group: int, p: int, batch: int, m: Machine) -> LayerCost:
    """Times of one layer per iteration on p nodes with global minibatch `batch`, model
    parallel within groups of `group` nodes (1: data parallel)."""
    if p % group:
        raise PcldnnError(f"group size {group} does not divide {p} nodes")
    rows = batch * group / p          # rows a group computes (each node: all of them, 1/group of the outputs)
    share = 1.0 / group
    fwd = _compute(load, "fwd", rows, share, m)
    bwd = _compute(load, "bwd_weights", rows, share, m)
    if not load.first:
        bwd += _compute(load, "bwd_data", rows, share, m)
    sent = load.weight_bytes * load.exchange * share
    dp = collective_time("reduce_scatter", sent, p // group, m) + collective_time("allgather", sent, p // group, m)
    sync = collective_time("allgather", 8.0 * load.sync_values * p, p, m)  # (a row of doubles from each node)
    mp_fwd = mp_bwd = 0.0
    if group > 1:
        exchange = collective_time("alltoall", rows * load.out_bytes * share, group, m)
        mp_fwd = collective_time("allgather", rows * load.in_bytes, group, m) + exchange
        mp_bwd = exchange + (0.0 if load.first else collective_time("reduce_scatter", rows * load.in_bytes, group, m))
    return LayerCost(load.name, group, fwd, bwd, mp_fwd, mp_bwd, dp, sync)


def iteration_time(costs: list[LayerCost], overlap: bool, compute_scale: float = 1.0) -> float:
    """The closed form of the module docstring; costs bottom to top. compute_scale: the
    straggler factor on the compute (the slowest node's over the mean)."""
    forward = sum(c.fwd * compute_scale + c.mp_fwd + c.sync for c in costs)
    back = [c.bwd * compute_scale + c.mp_bwd + c.sync for c in costs]
    if not overlap:
        return forward + sum(back) + sum(c.dp for c in costs)
    above = finish = 0.0
    for i in range(len(costs) - 1, -1, -1):  # released when the backward of layers >= i is done
        above += back[i]
        finish = max(finish, above) + costs[i].dp
    return forward + max(above, finish)


def group_sizes(load: LayerLoad, p: int) -> list[int]:
    """Candidate group sizes: data parallel for every layer; for fc layers also every divisor
    of p (the runtime splits only fc layers by output features)."""
    if load.type != "fc":
        return [1]
    return [g for g in range(1, p + 1) if p % g == 0]


@dataclass
class Strategy:
    """The per-layer parallel modes for p nodes at one global minibatch, with the predicted times."""
    nodes: int
    batch: int
    costs: list[LayerCost]
    time: float          # predicted seconds per iteration
    single: float        # one node, same global minibatch

    @property
    def images_per_s(self) -> float:
        return self.batch / self.time

    @property
    def speedup(self) -> float:
        return self.single / self.time

    @property
    def efficiency(self) -> float:
        return self.speedup / self.nodes

    def modes(self) -> dict[str, str]:
        return {c.layer: c.mode for c in self.costs}

    def to_json(self) -> dict:
        return {"nodes": self.nodes, "batch": self.batch, "time_s": self.time, "images_per_s": self.images_per_s,
                "speedup": self.speedup, "efficiency": self.efficiency,
                "layers": [asdict(c) | {"mode": c.mode} for c in self.costs]}


def best_strategy(loads: list[LayerLoad], p: int, batch: int, m: Machine) -> Strategy:
    """The per-layer choice that minimises the iteration time: coordinate descent from all
    data parallel (each layer in turn takes its best group size given the others) until no
    layer changes; the layers interact only through the overlap term, so this settles in a
    few rounds."""
    if p < 1:
        raise PcldnnError(f"nodes must be positive, got {p}")
    if batch < p:
        raise PcldnnError(f"global minibatch {batch} is smaller than {p} nodes: a node would get no images")
    options = [{g: layer_cost(load, g, p, batch, m) for g in group_sizes(load, p)} for load in loads]
    chosen = [opts[1] for opts in options]
    slowest = straggler_factor(p, m.step_cv)
    best = iteration_time(chosen, m.overlap, slowest)
    for _ in range(10):
        changed = False
        for i, opts in enumerate(options):
            for cost in opts.values():
                trial = chosen[:i] + [cost] + chosen[i + 1:]
                t = iteration_time(trial, m.overlap, slowest)
                if t < best * (1 - 1e-9):
                    chosen, best, changed = trial, t, True
        if not changed:
            break
    single = iteration_time([layer_cost(load, 1, 1, batch, m) for load in loads], m.overlap)
    return Strategy(p, batch, chosen, best, single)


def min_batch_per_node(loads: list[LayerLoad], p: int, m: Machine, threshold: float, limit: int = 4096) -> int | None:
    """The smallest per-node minibatch at which p nodes reach `threshold` parallel efficiency
    (against one node with the same global minibatch); None if none up to `limit`."""
    if p == 1:
        return 1
    lo, hi = 1, limit
    if best_strategy(loads, p, hi * p, m).efficiency < threshold:
        return None
    while lo < hi:  # efficiency grows with the per-node minibatch (compute grows, weight traffic does not)
        mid = (lo + hi) // 2
        if best_strategy(loads, p, mid * p, m).efficiency >= threshold:
            hi = mid
        else:
            lo = mid + 1
    return lo


# -- event-level simulation ------------------------------------------------------------------
def simulate(costs: list[LayerCost], p: int, overlap: bool, jitter: list[float] | None = None) -> dict:
    """One iteration on p nodes, event by event: each node has a compute unit and one network
    link; a collective starts when every participant has issued it and their links are free,
    and holds all those links; model-parallel exchanges also hold compute (the layer waits
    for them), data-parallel ones are issued as each layer's backward ends and run behind
    the layers below (without overlap: after the whole backward pass). `jitter[n]` scales node
    n's compute times (stragglers). Returns {"time", "events": node 0's (name, kind, start, end)}."""
    scale = jitter or [1.0] * p
    busy = [0.0] * p   # compute free at
    link = [0.0] * p   # network free at
    events: list[tuple[str, str, float, float]] = []

    def compute(name: str, seconds: float) -> None:
        for n in range(p):
            start = busy[n]
            busy[n] = start + seconds * scale[n]
            if n == 0:
                events.append((name, "compute", start, busy[n]))

    def collective(name: str, seconds: float, groups: list[list[int]], blocking: bool) -> None:
        if seconds <= 0:
            return
        for members in groups:
            start = max(max(busy[n], link[n]) for n in members)
            for n in members:
                link[n] = start + seconds
                if blocking:
                    busy[n] = start + seconds
            if 0 in members:
                events.append((name, "comm", start, start + seconds))

    def groups_of(cost: LayerCost) -> tuple[list[list[int]], list[list[int]]]:
        g = cost.group
        within = [list(range(s, s + g)) for s in range(0, p, g)]
        across = [list(range(r, p, g)) for r in range(g)]
        return within, across

    for c in costs:
        within, _ = groups_of(c)
        collective(f"sync_batchnorm fwd {c.layer}", c.sync, [list(range(p))], True)
        compute(f"fwd {c.layer}", c.fwd)
        collective(f"model-parallel fwd {c.layer}", c.mp_fwd, within, True)
    pending = []
    for c in reversed(costs):
        within, across = groups_of(c)
        collective(f"model-parallel bwd {c.layer}", c.mp_bwd, within, True)
        compute(f"bwd {c.layer}", c.bwd)
        collective(f"sync_batchnorm bwd {c.layer}", c.sync, [list(range(p))], True)
        if overlap:
            collective(f"part-reduce+broadcast {c.layer}", c.dp, across, False)
        else:
            pending.append((c, across))
    for c, across in pending:
        collective(f"part-reduce+broadcast {c.layer}", c.dp, across, False)
    return {"time": max(max(busy), max(link)), "events": events}


def simulate_stragglers(costs: list[LayerCost], p: int, m: Machine, draws: int = 16, seed: int = 0) -> float:
    """Mean iteration time of `simulate` over `draws` draws of per-node compute scales
    1 + step_cv x z (z standard normal, floored at 0.05): the stragglers of the closed form's
    straggler_factor, replayed event by event."""
    if m.step_cv == 0 or p == 1:
        return simulate(costs, p, m.overlap)["time"]
    rng = random.Random(seed)
    total = 0.0
    for _ in range(draws):
        jitter = [max(0.05, 1.0 + m.step_cv * rng.gauss(0.0, 1.0)) for _ in range(p)]
        total += simulate(costs, p, m.overlap, jitter)["time"]
    return total / draws
