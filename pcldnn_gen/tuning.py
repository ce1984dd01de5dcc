"""The tuning database (docs/design.md §3): measured register-tile choices that `compile` prefers to the
model's, one entry per (kernel shape, pass, ISA, precision, bf16 activations and gradients, CPU
description, CPU model, compiler, template version).

It lives in the cache directory (`tuning.json`; PCLDNN_TUNING_DB names another file) and is a
user file like any other: read strictly, every field typed and bounded, one error line naming
the file and the JSON path. What it can change is limited to picking one of the planner's own
candidate tiles (`plan_layer(..., choice=)`): an entry whose tile is no longer a candidate is
ignored. Writers merge under a file lock and replace the file atomically.

Format /2 (bf16 tuning) added the key's `activations` and `gradients`; a /1 file, fp32 kernels
only, is read as such and written back as /2."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from jinja2 import meta

from pcldnn_runtime import cpu
from pcldnn_runtime.families import Engine
from pcldnn_runtime.manifest import PASSES
from pcldnn_runtime.validate import Fields, check_writable, read_json

from . import __version__
from .arch import Arch
from .codegen import template_env
from .compiler import c_compiler, cache_dir, compiler_identity
from .errors import PcldnnError, PlanError
from .netspec import LayerSpec
from .planner import KernelPlan, Measured, TileTiming, kernel_layer, plan_layer

FORMAT = "pcldnn-tuning/2"
FORMAT_FP32_ONLY = "pcldnn-tuning/1"  # read: its keys are fp32 kernels on fp32 operands
PRECISIONS = ("fp32", "bf16")
MAX_ENTRIES = 100_000
MAX_CANDIDATES = 16
MAX_DIM = 1 << 20           # channels, pixels, kernel sizes: netspec's own bounds are tighter


class TuningError(PcldnnError):
    """The tuning database is unreadable or malformed."""


def database_path() -> Path:
    return Path(os.environ.get("PCLDNN_TUNING_DB") or cache_dir() / "tuning.json")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@functools.cache
def template_version(template: str) -> str:
    """The family's template, every template it imports or includes (the shared macros) and the
    generator version: an edit to any of them makes old measurements miss."""
    env = template_env()
    names, todo = [], [template]
    while todo:
        name = todo.pop()
        if name not in names:
            names.append(name)
            source = env.loader.get_source(env, name)[0]  # type: ignore[union-attr]
            todo += sorted(n for n in meta.find_referenced_templates(env.parse(source)) if n is not None)
    # the template first, as before imports were followed: an fp32 entry of a template that
    # imports only _common.c.j2 keeps its key
    return _digest(__version__, *(env.loader.get_source(env, n)[0]  # type: ignore[union-attr]
                                  for n in [template, *sorted(names[1:])]))


def kernel_precision(plan: KernelPlan) -> str:
    """bf16 for a kernel that multiplies bf16 operands (vdpbf16ps and AMX kinds: *_bf16, *_amx),
    else fp32; an fp32 kernel of a bf16 build may still read or write bf16 activations or
    gradients, which the key records beside it."""
    return "fp32" if plan.engine is Engine.FP32 else "bf16"


@functools.lru_cache(maxsize=1)
def _machine() -> tuple[str, str]:
    ident = cpu.cpu_identity()
    return (f"{ident.vendor} {ident.family}/{ident.model} {ident.name}".strip()[:200],
            compiler_identity(c_compiler())[:400])


def kernel_key(layer: LayerSpec, pass_name: str, arch: Arch, template: str, precision: str = "fp32",
               activations: tuple[bool, bool] = (False, False),
               gradients: tuple[bool, bool] = (False, False)) -> dict[str, Any]:
    """What a measurement is valid for. The arch enters as a digest of its whole description
    (cache sizes shape the blocks around the tile); the CPU and compiler as this machine's;
    `precision` (kernel_precision) and the (input, output) activations and gradients the kernel
    reads and writes as bf16 (KernelPlan.activations, .gradients) as the plan has them."""
    cpu_model, compiler = _machine()
    return {"type": layer.type, "in_shape": list(layer.in_shape), "out_shape": list(layer.out_shape),
            "kernel": list(layer.kernel), "stride": list(layer.stride), "pad": list(layer.pad),
            "pass": pass_name, "isa": arch.isa, "precision": precision,
            "activations": list(activations), "gradients": list(gradients),
            "arch": _digest(json.dumps(arch.to_json(), sort_keys=True)), "cpu": cpu_model, "compiler": compiler,
            "template": template_version(template)}


def plan_key(layer: LayerSpec, plan: KernelPlan, arch: Arch) -> dict[str, Any]:
    """The key of the kernel `plan` makes: its template, precision and bf16 operands, and the
    layer as the kernel sees it (a 1x1 plane run as one row has that row's shape,
    planner.kernel_layer)."""
    return kernel_key(kernel_layer(layer, plan), plan.pass_name, arch, plan.template, kernel_precision(plan),
                      plan.activations, plan.gradients)


def key_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Entry:
    key: dict[str, Any]
    arch_name: str              # for people reading the file
    choice: tuple[int, int]     # the tile compile uses: the measured best (the model's when within noise)
    measured: Measured

    def to_json(self) -> dict[str, Any]:
        m = self.measured
        return {"key": self.key, "arch_name": self.arch_name, "choice": list(self.choice),
                "model": list(m.model), "batch": m.batch, "threads": m.threads,
                "peak_gflops": round(m.peak_gflops, 3), "flops": m.flops,
                "candidates": [{"tile": [t.width, t.vectors], "predicted": round(t.predicted_efficiency, 4),
                                "ms": round(t.ms, 6)} for t in m.timings]}


class TuningDB:
    """Entries by key. `load` validates; `lookup` answers for one kernel; `merge_into` writes."""

    def __init__(self, path: Path, entries: dict[str, Entry] | None = None):
        self.path = path
        self.entries = entries or {}

    @classmethod
    def load(cls, path: Path | None = None) -> TuningDB:
        path = Path(path) if path is not None else database_path()
        if not path.exists():
            return cls(path)
        return cls(path, _parse(read_json(path, TuningError), str(path)))

    def lookup(self, layer: LayerSpec, pass_name: str, arch: Arch, model: KernelPlan) -> Entry | None:
        if model.tile is None:
            return None
        return self.entries.get(key_id(plan_key(layer, model, arch)))

    def plan(self, layer: LayerSpec, pass_name: str, arch: Arch, bf16: bool = False, amx: bool = False,
             activations: tuple[bool, bool] = (False, False),
             gradients: tuple[bool, bool] = (False, False)) -> KernelPlan:
        """The model's plan, or the plan around the measured tile when an entry matches (the
        arguments after `arch`: plan_layer's)."""
        model = plan_layer(layer, pass_name, arch, None, bf16, amx, activations, gradients)
        entry = self.lookup(layer, pass_name, arch, model)
        if entry is None:
            return model
        try:
            chosen = plan_layer(layer, pass_name, arch, entry.choice, bf16, amx, activations, gradients)
        except PlanError:  # no longer one of the planner's candidates: the model decides
            return model
        return dataclasses.replace(chosen, measured=entry.measured)

    def check_writable(self) -> None:
        """The database and its lock file can be written: checked before any measuring (a
        path under a regular file, or a directory where the lock goes, is one error line)."""
        check_writable(self.path, "tuning database", TuningError, make_parents=True)
        check_writable(self.lock_path, "tuning database lock", TuningError, make_parents=True)

    @property
    def lock_path(self) -> Path:
        return Path(str(self.path) + ".lock")

    def merge_into(self, new: list[Entry]) -> None:
        """Add or replace `new` entries in the file, keeping what other writers added meanwhile."""
        try:
            self._merge(new)
        except OSError as e:
            raise TuningError(f"{self.path}: cannot write the tuning database: {e.strerror or e}") from None
        except Timeout:
            raise TuningError(f"{self.lock_path}: another process holds the tuning database's lock") from None

    def _merge(self, new: list[Entry]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.lock_path), timeout=600):
            current = TuningDB.load(self.path).entries
            current.update({key_id(e.key): e for e in new})
            if len(current) > MAX_ENTRIES:
                raise TuningError(f"{self.path}: more than {MAX_ENTRIES} entries; remove the file to start afresh")
            text = json.dumps({"format": FORMAT, "entries": [e.to_json() for e in current.values()]}, indent=1)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text + "\n")
                os.replace(tmp, self.path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
            self.entries = current


def _parse(data: Any, origin: str) -> dict[str, Entry]:
    f = Fields(origin, TuningError)
    f.obj(data, "", {"format", "entries"})
    fp32_only = f.choice(data["format"], "format", (FORMAT, FORMAT_FP32_ONLY)) == FORMAT_FP32_ONLY
    entries: dict[str, Entry] = {}
    for i, raw in enumerate(f.array(data["entries"], "entries", 0, MAX_ENTRIES)):
        at = f"entries[{i}]"
        f.obj(raw, at, {"key", "arch_name", "choice", "model", "batch", "threads", "peak_gflops", "flops",
                        "candidates"})
        key = _parse_key(f, raw["key"], f"{at}.key", fp32_only)
        arch_name = f.text(raw["arch_name"], f"{at}.arch_name", 64)
        choice, model = (_tile(f, raw[k], f"{at}.{k}") for k in ("choice", "model"))
        timings = []
        for j, c in enumerate(f.array(raw["candidates"], f"{at}.candidates", 1, MAX_CANDIDATES)):
            cat = f"{at}.candidates[{j}]"
            f.obj(c, cat, {"tile", "predicted", "ms"})
            w, v = _tile(f, c["tile"], f"{cat}.tile")
            timings.append(TileTiming(width=w, vectors=v, ms=f.number_in(c["ms"], f"{cat}.ms", 0, 1e7, open_lo=True),
                                      predicted_efficiency=f.number_in(c["predicted"], f"{cat}.predicted", 0, 1)))
        if choice not in {(t.width, t.vectors) for t in timings}:
            f.fail(f"{at}.choice", f"{list(choice)} is not one of the measured candidates")
        measured = Measured(model=model, batch=f.int_in(raw["batch"], f"{at}.batch", 1, 1 << 20),
                            threads=f.int_in(raw["threads"], f"{at}.threads", 1, 4096),
                            peak_gflops=f.number_in(raw["peak_gflops"], f"{at}.peak_gflops", 0, 1e7, open_lo=True),
                            flops=f.int_in(raw["flops"], f"{at}.flops", 1, 1 << 62), timings=tuple(timings))
        entries[key_id(key)] = Entry(key, arch_name, choice, measured)
    return entries


def _tile(f: Fields, value: Any, where: str) -> tuple[int, int]:
    f.array(value, where, 2, 2)
    return (f.int_in(value[0], f"{where}[0]", 1, 64), f.int_in(value[1], f"{where}[1]", 1, 64))


def _parse_key(f: Fields, raw: Any, at: str, fp32_only: bool) -> dict[str, Any]:
    operands = () if fp32_only else ("activations", "gradients")
    f.obj(raw, at, {"type", "in_shape", "out_shape", "kernel", "stride", "pad", "pass", "isa", "precision",
                    "arch", "cpu", "compiler", "template", *operands})
    f.choice(raw["type"], f"{at}.type", ("conv", "fc"))
    for name, length, lo in (("in_shape", 3, 1), ("out_shape", 3, 1), ("kernel", 2, 1), ("stride", 2, 1),
                             ("pad", 2, 0)):
        for k, v in enumerate(f.array(raw[name], f"{at}.{name}", length, length)):
            f.int_in(v, f"{at}.{name}[{k}]", lo, MAX_DIM)
    f.choice(raw["pass"], f"{at}.pass", PASSES)
    f.choice(raw["isa"], f"{at}.isa", tuple(cpu.ISA_FLAGS))
    f.choice(raw["precision"], f"{at}.precision", PRECISIONS[:1] if fp32_only else PRECISIONS)
    for name in operands:
        for k, v in enumerate(f.array(raw[name], f"{at}.{name}", 2, 2)):
            f.boolean(v, f"{at}.{name}[{k}]")
    for name, limit in (("arch", 16), ("template", 16), ("cpu", 200), ("compiler", 400)):
        f.text(raw[name], f"{at}.{name}", limit)
    return raw | ({"activations": [False, False], "gradients": [False, False]} if fp32_only else {})
