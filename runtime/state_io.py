"""Weights by name in canonical layouts ({"<layer>.weight": ..., "<layer>.bias": ...}): checking a
user's mapping against a net, and reading one from an .npz file. Shared by Net.load_state_dict,
`pcldnn-gen compile --weights` and `pr.load` of a build that carries initial weights."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import npyfile
from .errors import PcldnnError
from .layer_types import LAYER_TYPES
from .validate import show

MAX_NPZ_BYTES = 1 << 36  # 64 GiB: above any net the memory bound admits


class StateKeys(NamedTuple):
    """What a non-strict load did not match (both empty under strict=True)."""
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def expected_state(layers: Any) -> dict[str, tuple[int, ...]]:
    """{key: canonical shape} of the layers with state (layer_types.LAYER_TYPES' entries), from
    objects with name, type, out_shape, weight_shape and bias (NetSpec layers and manifest entries
    alike): a bias-free layer has no .bias entry, as in PyTorch."""
    out: dict[str, tuple[int, ...]] = {}
    for layer in layers:
        for key, shape in LAYER_TYPES[layer.type].state:
            if key == "bias" and not getattr(layer, "bias", True):
                continue
            out[f"{layer.name}.{key}"] = _entry_shape(layer, shape)
    return out


def _entry_shape(layer: Any, kind: str) -> tuple[int, ...]:
    """A state entry's shape by its kind (layer_types.LayerType.state)."""
    if kind == "weight":
        return tuple(layer.weight_shape)
    return (layer.out_shape[0],) if kind == "channels" else ()


def check_running_stats(arrays: Mapping[str, np.ndarray], origin: str, error: type[PcldnnError] = PcldnnError) -> None:
    """A batchnorm's running variance is never negative and its batch count a whole number in
    [0, 2^24) (exact in float32): what check_state's finite float32 values do not say."""
    for key, array in arrays.items():
        if key.endswith(".running_var") and (array < 0).any():
            raise error(f"{origin}: {key}: holds a negative variance")
        if key.endswith(".num_batches_tracked") and not (0 <= float(array) < 2 ** 24 and float(array).is_integer()):
            raise error(f"{origin}: {key}: must be a whole number of batches, got {float(array)}")


def as_numpy(value: Any, what: str, error: type[PcldnnError] = PcldnnError) -> np.ndarray:
    """A float32 array from a numpy array, a torch tensor (no torch import) or an array-like."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
        value = value.float().numpy() if hasattr(value, "float") else value.numpy()
    try:
        array = np.asarray(value)
        if array.dtype.kind not in "fiu":
            raise TypeError(f"dtype {array.dtype}")
        return np.ascontiguousarray(array, dtype=np.float32).reshape(array.shape)  # (a scalar stays one)
    except (TypeError, ValueError) as e:
        raise error(f"{what}: must be an array of numbers ({e})") from None


def check_state(expected: Mapping[str, tuple[int, ...]], state: Any, origin: str, strict: bool = True,
                error: type[PcldnnError] = PcldnnError) -> tuple[dict[str, np.ndarray], StateKeys]:
    """The entries of `state` that match `expected`, as float32 arrays of the right shapes with
    finite values, and the keys that did not match. Any problem is an error naming `origin`;
    strict: missing and unexpected keys are one, all of them listed."""
    if not hasattr(state, "items"):
        raise error(f"{origin}: expected a mapping of names to arrays, got {type(state).__name__}")
    keys = [str(k) for k in state]
    missing = tuple(k for k in expected if k not in state)
    unexpected = tuple(k for k in keys if k not in expected)
    if strict and (missing or unexpected):
        shown = (k if k.isprintable() and len(k) <= 80 else show(k, 80) for k in unexpected)
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unexpected {', '.join(shown)}"] if unexpected else [])
        raise error(f"{origin}: keys do not match the net: {'; '.join(parts)}")
    out = {}
    for key, value in state.items():
        if key not in expected:
            continue
        array = as_numpy(value, f"{origin}: {key}", error)
        if array.shape != expected[key]:
            raise error(f"{origin}: {key}: shape {array.shape}, expected {expected[key]}")
        if not np.isfinite(array).all():
            raise error(f"{origin}: {key}: holds NaN or infinity")
        out[key] = array
    return out, StateKeys(missing, unexpected)


def read_npz(path: str | Path, error: type[PcldnnError] = PcldnnError,
             sha256: str | None = None) -> dict[str, np.ndarray]:
    """The arrays of an .npz file (no pickled objects; every member's header checked against its
    size and the memory bound before anything is allocated), or one error naming the file. With
    `sha256`, the bytes read are the bytes checked against it."""
    return npyfile.read_npz(path, error, MAX_NPZ_BYTES, sha256)
