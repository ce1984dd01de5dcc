"""Which weighted layers run data parallel and which model parallel (and in groups of how many
ranks), from the user's `parallel` argument or the communication model."""
from __future__ import annotations

import fnmatch
from typing import Any

from .errors import PcldnnError


def layer_modes(net: Any, parallel: Any, p: int, batch: int) -> dict[str, int]:
    """{weighted layer: model-parallel group size} (1: data parallel) for `parallel`:
    "data"; "auto"; or a mapping of layer-name patterns (fnmatch) to "data", "model" (model
    parallel over all p ranks) or "model:G" (hybrid: model parallel within groups of G
    consecutive ranks, data parallel across the p/G groups); unmatched layers are data
    parallel. Only fc layers can be model parallel.

    "auto" asks the communication model (`pcldnn_runtime.scaling.best_strategy`, the one behind
    `pcldnn-gen plan`) for the choice that minimises the iteration time at this global
    minibatch, on the machine PCLDNN_MACHINE names (a preset or a machine JSON file; default
    scaling.DEFAULT_MACHINE)."""
    weighted = [name for name, layer in net.layers.items() if name in net.param_ranges]
    modes = dict.fromkeys(weighted, 1)
    if p == 1 or parallel == "data":
        return modes
    if parallel == "auto":
        from . import scaling
        chosen = scaling.best_strategy(scaling.loads_of(net.layers.values()), p, max(batch, p), scaling.machine_from_env())
        modes.update({c.layer: c.group for c in chosen.costs})
        return modes
    modes.update(mapping_modes(parallel, {name: net.layers[name].type for name in weighted}, p))
    return modes


def mapping_modes(parallel: Any, weighted: dict[str, str], p: int) -> dict[str, int]:
    """{layer: group size} of the layers a mapping of patterns names, checked against the
    weighted layers ({name: type}) and p ranks: what `pcldnn-gen train --parallel` checks
    from the net description before it compiles."""
    if not isinstance(parallel, dict):
        raise PcldnnError(f'parallel={parallel!r}: use "auto", "data" or a mapping like {{"fc*": "model"}}')
    modes: dict[str, int] = {}
    for pattern, how in parallel.items():
        matched = [name for name in weighted if fnmatch.fnmatchcase(name, str(pattern))]
        if not matched:
            raise PcldnnError(f"parallel: pattern {pattern!r} matches no layer with weights "
                              f"(those are: {', '.join(weighted)})")
        group = _group_size(pattern, how, p)
        for name in matched:
            if group > 1 and weighted[name] != "fc":
                raise PcldnnError(f"parallel: layer {name} is {weighted[name]}; only fc layers can be model parallel")
            modes[name] = group
    return modes


def _group_size(pattern: Any, how: Any, p: int) -> int:
    if how == "data":
        return 1
    if how == "model":
        return p
    if isinstance(how, str) and how.startswith("model:") and how[6:].isdigit():
        g = int(how[6:])
        if g >= 1 and p % g == 0:
            return g
        raise PcldnnError(f"parallel: {pattern!r}: {how!r}: the group size must divide the {p} ranks")
    raise PcldnnError(f'parallel: {pattern!r}: {how!r}: use "data", "model" or "model:G" (groups of G ranks)')
