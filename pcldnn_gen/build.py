"""NetSpec + Arch → build directory: plan, render, compile, then write manifest.json.

The directory is assembled in a staging folder beside the target and swapped in under a
lock, so a failed or concurrent build never leaves a half-written build directory behind.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from filelock import FileLock

from pcldnn_runtime import cpu
from pcldnn_runtime.families import Engine, bf16_gradients, bf16_outputs, choose, sides
from pcldnn_runtime.families.fusion import plan_fusions
from pcldnn_runtime.manifest import FORMAT, FORMAT_FAMILY, MANIFEST, WEIGHTS_FILE, file_sha256
from pcldnn_runtime.state_io import check_state, expected_state
from pcldnn_runtime.validate import check_writable

from . import __version__
from .arch import Arch, slow_bf16_reason
from .codegen import peak_flops_per_iteration, render_kernel, render_layout, render_peak, render_sgd
from .compiler import Source, compile_all, compile_source
from .errors import ArchError, BuildDirError, SlowBuildWarning
from .netspec import LayerSpec, NetSpec
from .planner import LAYER_PASSES, Fusion, KernelPlan, plan_layer

if TYPE_CHECKING:
    from .tuning import TuningDB


@dataclass(frozen=True)
class BuildResult:
    directory: Path
    compiled: int
    cached: int
    plans: dict[tuple[str, str], KernelPlan]


def default_build_dir(net: NetSpec, arch: Arch, precision: str = "fp32", fusion: bool = True) -> Path:
    """build/<net>-<arch>[-bf16][-nofusion]: a name that says which build it is, so that two
    different builds of one net never replace each other unasked. <arch> is the preset's name
    (`--arch avx2` -> build/vgg_a-avx2, as docs/design.md §4), native-<isa>[-amx] for this
    CPU's own figures, or an arch file's name."""
    where = f"native-{arch.isa}" + ("-amx" if arch.amx else "") if arch.name.startswith("native") else arch.name
    return Path("build") / (f"{net.name}-{where}" + ("" if precision == "fp32" else f"-{precision}")
                            + ("" if fusion else "-nofusion"))


def check_precision(precision: str, arch: Arch) -> None:
    """A precision the generator has kernels for on `arch`'s ISA, or an ArchError."""
    if precision not in cpu.PRECISIONS:
        raise ArchError(f"unknown precision {precision[:40]!r}: use one of {', '.join(cpu.PRECISIONS)}")
    if arch.isa not in cpu.PRECISION_ISAS[precision]:
        raise ArchError(f"--precision {precision} needs an AVX-512 arch ({precision} kernels use AVX512_BF16), "
                         f"got {arch.name} ({arch.isa})")


def plan_net(net: NetSpec, arch: Arch, tuning: TuningDB | None = None,
             choices: Mapping[tuple[str, str], tuple[int, int]] | None = None,
             precision: str = "fp32", fusion: bool = True) -> dict[tuple[str, str], KernelPlan]:
    """Every (layer, pass) plan: the model's, the tuning database's measured tile where an
    entry matches (bf16 kernels too: `tune --precision bf16`), or a forced candidate tile from
    `choices` (the tuner's trial builds). Each plan is of the family that computes the pass
    (families.choose: the one decision the manifest reader and the runtime make alike), on the
    bf16 activations and gradients the net stores (bf16_outputs, bf16_gradients), and does the
    work of the layers fused into it (families.fusion, unless `fusion` is False)."""
    plans = {}
    activations, gradients = net_activations(net, arch, precision), net_gradients(net, arch, precision)
    for layer in net.layers:
        for p in LAYER_PASSES[layer.type]:
            plans[(layer.name, p)] = plan_kernel(layer, p, arch, tuning, (choices or {}).get((layer.name, p)),
                                                 precision, activations[layer.name], gradients[layer.name])
    return fuse_plans(net, arch, precision, plans) if fusion else plans


def fuse_plans(net: NetSpec, arch: Arch, precision: str,
               plans: dict[tuple[str, str], KernelPlan]) -> dict[tuple[str, str], KernelPlan]:
    """`plans` (all or some of a net's) with the work of the layers fused into them (families.fusion)."""
    fusions = plan_fusions(net.layers, arch.target(precision))
    fused: list[tuple[tuple[str, str], Fusion]] = [
        ((net.layers[conv].name, "fwd"), Fusion(kind="statistics", layer=net.layers[norm].name))
        for conv, norm in fusions.statistics.items()]
    for norm, add in fusions.residual.items():
        joined = Fusion(kind="residual", layer=net.layers[add].name, activation=net.layers[add].activation)
        fused += [((net.layers[norm].name, p), joined) for p in LAYER_PASSES["batchnorm"]]
    out = dict(plans)
    for key, fusion in fused:
        if key in out:
            out[key] = replace(out[key], fusion=fusion)
    return out


def computed_by(net: NetSpec, arch: Arch, precision: str, layer: str) -> str | None:
    """The layer whose kernels do `layer`'s work (a residual fusion's add: its batchnorm), or None."""
    fusions = plan_fusions(net.layers, arch.target(precision))
    return next((net.layers[norm].name for norm, add in fusions.residual.items() if net.layers[add].name == layer),
                None)


def net_activations(net: NetSpec, arch: Arch, precision: str) -> dict[str, tuple[bool, bool]]:
    """Per layer, whether its (input, output) activations are stored as bf16 (families.bf16_outputs)."""
    outputs = bf16_outputs(precision, arch.amx, arch.vector_floats, net.layers)
    return {layer.name: pair for layer, pair in zip(net.layers, sides(outputs), strict=True)}


def net_gradients(net: NetSpec, arch: Arch, precision: str) -> dict[str, tuple[bool, bool]]:
    """Per layer, whether the gradients of its (input, output) are stored as bf16 (families.bf16_gradients)."""
    grads = bf16_gradients(precision, arch.amx, arch.vector_floats, net.layers)
    return {layer.name: pair for layer, pair in zip(net.layers, sides(grads), strict=True)}


def pass_gradients(gradients: tuple[bool, bool], pass_name: str) -> tuple[bool, bool]:
    """Which of a layer's (input, output) bf16 gradients a pass touches: backward-data reads dy
    and writes dx, backward-weights reads dy, the forward pass neither."""
    return {"fwd": (False, False), "bwd_data": gradients, "bwd_weights": (False, gradients[1])}[pass_name]


def pass_activations(activations: tuple[bool, bool], pass_name: str, layer_type: str) -> tuple[bool, bool]:
    """Which of a layer's (input, output) bf16 activations a pass touches: backward-data reads
    no input (only the output, as a fused ReLU's mask), so an fp32 backward-data kernel may sit
    beside a bf16 forward (a few-channel convolution's); a batchnorm's reads its input (x-hat)."""
    return (False, activations[1]) if pass_name == "bwd_data" and layer_type != "batchnorm" else activations


def plan_kernel(layer: LayerSpec, pass_name: str, arch: Arch, tuning: TuningDB | None = None,
                choice: tuple[int, int] | None = None, precision: str = "fp32",
                activations: tuple[bool, bool] = (False, False),
                gradients: tuple[bool, bool] = (False, False)) -> KernelPlan:
    """One kernel's plan by plan_net's rule (compile, `inspect` and `tune` alike): a forced tile,
    else the database's measured one, else the model's (`activations`, `gradients`:
    net_activations and net_gradients of the layer; AMX kernels have no register tile to tune)."""
    has_pass = pass_name in LAYER_PASSES[layer.type]  # else plan_layer says which passes the layer has
    engine = choose(layer, pass_name, arch.target(precision))[1].engine if has_pass else Engine.FP32
    bf16, amx = engine is not Engine.FP32, engine is Engine.AMX
    activations, gradients = pass_activations(activations, pass_name, layer.type), pass_gradients(gradients, pass_name)
    if choice or tuning is None:
        return plan_layer(layer, pass_name, arch, choice, bf16, amx, activations, gradients)
    return tuning.plan(layer, pass_name, arch, bf16, amx, activations, gradients)


def build(net: NetSpec, arch: Arch, out_dir: Path | None = None, jobs: int | None = None,
          tuning: TuningDB | None = None, choices: Mapping[tuple[str, str], tuple[int, int]] | None = None,
          weights: Mapping[str, np.ndarray] | None = None, weights_origin: str = "weights",
          precision: str = "fp32", fusion: bool = True) -> BuildResult:
    """Plan (through `tuning` when given; see plan_net), render, compile, write the directory.
    `weights` (canonical layouts, every weighted layer's `.weight` and `.bias`) are checked
    here and recorded in the build: `pr.load` starts from them instead of random ones.
    `precision` bf16: the kernels of families.bf16_passes read bf16 copies (docs/design.md §2).
    `fusion` False: every layer's kernels compute its own work only (families.fusion)."""
    check_precision(precision, arch)
    if precision == "bf16" and (slow := slow_bf16_reason(arch)) is not None:
        warnings.warn(slow, SlowBuildWarning, stacklevel=2)  # not silently slower than fp32 (the CLI prints it)
    out_dir = Path(out_dir) if out_dir is not None else default_build_dir(net, arch, precision, fusion)
    initial = None
    if weights is not None:
        initial, _ = check_state(expected_state(net.layers), weights, weights_origin)
    plans = plan_net(net, arch, tuning, choices, precision, fusion)
    sources: list[tuple[LayerSpec | None, str, Source]] = []
    activations = net_activations(net, arch, precision)
    for layer in net.layers:
        for p in LAYER_PASSES[layer.type]:
            sources.append((layer, p, render_kernel(layer, plans[(layer.name, p)], arch)))
        sources.append((layer, "layout", render_layout(layer, arch, precision, activations[layer.name])))
    # the build's own kernels of no layer: the FMA peak (PCLDNN_VERBOSE's % of peak), the SGD update
    sources += [(None, "peak", render_peak(arch)), (None, "sgd", render_sgd())]
    _check_replaceable(out_dir)
    check_writable(out_dir, "build directory", BuildDirError, directory=True)  # before the compiles, not after
    results = compile_all([s for _, _, s in sources], arch, jobs)

    try:
        _write_build(net, arch, out_dir, sources, results, plans, initial, precision, fusion)
    except OSError as e:
        raise BuildDirError(f"{out_dir}: cannot write the build directory: {e.strerror or e}") from None
    compiled = sum(r.compiled for r in results)
    return BuildResult(out_dir, compiled, len(results) - compiled, plans)


def _write_build(net: NetSpec, arch: Arch, out_dir: Path, sources: list[tuple[LayerSpec | None, str, Source]],
                 results: Any, plans: Any, initial: dict[str, np.ndarray] | None, precision: str,
                 fusion: bool = True) -> None:
    """Sources, libraries and manifest into a staging folder, swapped in under a lock. A source
    of no layer is one of the build's own kernels ("peak", "sgd")."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir.parent / f".{out_dir.name}.lock"), timeout=900):
        _check_replaceable(out_dir)
        _sweep_stages(out_dir)
        stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
        try:
            (stage / "src").mkdir()
            (stage / "lib").mkdir()
            kernels: dict[str, dict] = {}
            own: dict[str, dict] = {}
            for (layer, p, src), res in zip(sources, results):
                (stage / "src" / src.filename).write_text(src.text)
                lib_name = f"lib/{Path(src.filename).stem}.so"
                try:
                    shutil.copyfile(res.library, stage / lib_name)
                except FileNotFoundError:  # pruned (`pcldnn-gen cache prune`) since it was compiled
                    shutil.copyfile(compile_source(src, arch).library, stage / lib_name)
                entry = {"library": lib_name, "sha256": file_sha256(stage / lib_name),
                         "source": f"src/{src.filename}", "symbols": src.symbols}
                if layer is None:  # the peak's entry also says its FLOPs per loop iteration
                    own[p] = entry | ({"flops_per_iteration": peak_flops_per_iteration(arch)} if p == "peak" else {})
                    continue
                if p != "layout":
                    entry["plan"] = plans[(layer.name, p)].to_json()
                kernels.setdefault(layer.name, {})[p] = entry
            manifest = _manifest(net, arch, kernels, precision) | own | {"precision": precision, "fusion": fusion}
            if initial is not None:
                np.savez(stage / WEIGHTS_FILE, **initial)  # type: ignore[arg-type]
                manifest["weights"] = {"file": WEIGHTS_FILE, "sha256": file_sha256(stage / WEIGHTS_FILE)}
            (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            _swap_in(stage, out_dir)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise


def _sweep_stages(out_dir: Path) -> None:
    """Staging and old-build folders of earlier builds of out_dir that died mid-way: under the
    build lock no live build of out_dir has one."""
    for prefix in (f".{out_dir.name}.staging-", f".{out_dir.name}.old-"):
        for path in out_dir.parent.glob(glob.escape(prefix) + "*"):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)


def _manifest(net: NetSpec, arch: Arch, kernels: dict[str, dict], precision: str) -> dict:
    """The build's manifest.json (runtime/manifest.py reads it); a layer whose output activation
    is stored as bf16 (families.bf16_outputs) says `"output": "bf16"`, one whose output's gradient
    is (families.bf16_gradients) `"gradient": "bf16"`."""
    layers = []
    activations, gradients = net_activations(net, arch, precision), net_gradients(net, arch, precision)
    previous = "input"
    for layer in net.layers:
        layers.append({
            "name": layer.name, "type": layer.type,
            "in_shape": list(layer.in_shape), "out_shape": list(layer.out_shape),
            "kernel": list(layer.kernel), "stride": list(layer.stride), "pad": list(layer.pad),
            "rate": layer.rate,
            "weight_shape": list(layer.weight_shape) if layer.weight_shape else None,
            "kernels": kernels.get(layer.name, {}),
            **({} if layer.bias else {"bias": False}),
            **({"groups": layer.groups} if layer.groups != 1 else {}),
            **({"eps": layer.eps, "momentum": layer.momentum} if layer.normalizes else {}),
            **({"activation": layer.activation} if layer.activation else {}),
            **({"init": layer.init} if layer.init != "pytorch" else {}),
            **({"inputs": list(layer.inputs)} if layer.inputs != (previous,) else {}),
            **({"output": "bf16"} if activations[layer.name][1] else {}),
            **({"gradient": "bf16"} if gradients[layer.name][1] else {}),
        })
        previous = layer.name
    return {
        "format": FORMAT, "generator": f"pcldnn-gen {__version__}",
        "net": {"name": net.name, "input": list(net.input), "classes": net.classes,
                "hash": net.source_hash},
        "arch": arch.to_json(),
        "layers": layers,
    }


def _check_replaceable(out_dir: Path) -> None:
    """Refuse to overwrite a directory that is not ours (e.g. `-o .` or `-o ~`)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise BuildDirError(f"{out_dir}: exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    try:
        fmt = json.loads((out_dir / MANIFEST).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        fmt = None
    if not (isinstance(fmt, str) and fmt.startswith(FORMAT_FAMILY)):  # any version of ours may be replaced
        raise BuildDirError(f"{out_dir}: exists and is not a pcldnn-gen build directory; "
                            "refusing to overwrite it (choose another -o)")


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two directories (Linux renameat2 with RENAME_EXCHANGE), so that a
    reader of either path finds the old or the new one, never neither. False where the C
    library, kernel or file system cannot; then the caller renames twice."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(stage: Path, out_dir: Path) -> None:
    """The staged build replaces out_dir: in one step where the system allows (a process
    loading the build meanwhile reads the old or the new one), else by two renames."""
    if out_dir.exists() and _exchange(stage, out_dir):
        shutil.rmtree(stage, ignore_errors=True)  # the old build, now under the staging name
        return
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rmdir(old)
        os.rename(out_dir, old)
    os.rename(stage, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
