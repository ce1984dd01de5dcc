"""fc_tiles: fully-connected layers on bf16 tiles of the weights, on AMX (fc_tiles_amx) or, on
CPUs without AMX, with vdpbf16ps on the same layouts (fc_tiles_vdpbf16): templates fc_tiles,
fc_tiles_bwd_weights; planner/amx.py. The weights are the layer's two bf16 tile copies
(geometry.FcTileGeometry, made by its layout library's fc_weight_tiles once after each change of
the weights), the activations copied into scratch; a slice of output blocks as fc_gemm."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..geometry import fc_tile_geometry
from .base import Calls, Engine, Family, Part

if TYPE_CHECKING:
    from ..layers import WeightedLayer


def _scratch(layer: WeightedLayer, pass_name: str, batch: int) -> np.ndarray:
    geometry = fc_tile_geometry(layer.in_shape, layer.out_shape[0], layer.vector_floats)
    return layer.scratch16(geometry.scratch_values(pass_name, batch))


def _forward(layer: WeightedLayer, xb: np.ndarray, yb: np.ndarray, part: Part, batch: int, team: int) -> None:
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    assert part is not None
    tiles, _ = layer.weight_tiles(part)
    layer.kernels["fwd"](p(xb), p(tiles), layer.bias_ptr, p(yb), p(_scratch(layer, "fwd", batch)), batch, team, *part)


def _backward_weights(layer: WeightedLayer, xb: np.ndarray, dyb: np.ndarray, mask: np.ndarray | None,
                      dw: np.ndarray, db: np.ndarray, part: Part, batch: int, threads: int) -> bool:
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    assert part is not None
    scratch = _scratch(layer, "bwd_weights", batch)
    layer.kernels["bwd_weights"](p(xb), p(dyb), p(mask), p(scratch), p(dw), p(db), batch, threads, *part)
    return True  # dy masked in place


def _backward_data(layer: WeightedLayer, dyb: np.ndarray, mask: np.ndarray | None, dxb: np.ndarray, part: Part,
                   batch: int, threads: int) -> None:
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    assert part is not None
    _, tiles = layer.weight_tiles(part)
    layer.kernels["bwd_data"](p(dyb), p(mask), p(tiles), p(_scratch(layer, "bwd_data", batch)), p(dxb), batch, threads, *part)


CALLS = Calls(_forward, _backward_weights, _backward_data)


def _signatures(suffix: str) -> dict[str, str]:
    return {
        f"fc_fwd_{suffix}": "const float *in, const unsigned short *wt, const float *bias, float *out, "
                            "unsigned short *scratch, int batch, int nthreads, int ocb_lo, int ocb_hi",
        f"fc_bwd_data_{suffix}": "float *dy, const float *out, const unsigned short *wt, unsigned short *scratch, "
                                 "float *dx, int batch, int nthreads, int ocb_lo, int ocb_hi",
        f"fc_bwd_weights_{suffix}": "const float *in, float *dy, const float *out, unsigned short *scratch, "
                                    "float *dwt, float *dbias, int batch, int nthreads, int ocb_lo, int ocb_hi",
    }


AMX = Family("fc_tiles_amx", Engine.AMX, ("fc",), calls=CALLS, signatures=_signatures("amx"))
VDPBF16 = Family("fc_tiles_vdpbf16", Engine.VDPBF16, ("fc",), calls=CALLS, signatures=_signatures("bf16"))
FAMILIES = (AMX, VDPBF16)
