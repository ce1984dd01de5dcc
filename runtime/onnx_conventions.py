"""Where our layers and ONNX's operators differ by a convention, said once for both directions:
the export (onnx_export.py) and the import (pcldnn_gen/onnx_frontend.py) read each other's
files through these. A leaf module (only numpy and the activations' table): the onnx package is
passed in where nodes are made, so nothing here needs it installed."""
from __future__ import annotations

from typing import Any

import numpy as np

from .activations import ACTIVATIONS, Activation

OPSET = 17  # what the export writes

# The operators an activation is read from, by the activation they compute: its one operator
# (Activation.onnx_op), a pattern of several that the import folds into one node of the name
# given here, or opset 20's Gelu (ReLU6, a Clip with bounds, is read by the Clip reader)
ONNX_ACTIVATIONS = {**{a.onnx_op: a.name for a in ACTIVATIONS.values() if a.onnx_op},
                    "Sigmoid*Mul": "silu", "Erf-GELU": "gelu", "Gelu": "gelu"}


def momentum_to_onnx(momentum: float) -> float:
    """ONNX's BatchNormalization momentum weighs the running statistic (0.9), PyTorch's and ours
    the new batch statistic (0.1)."""
    return 1.0 - momentum


def momentum_from_onnx(value: np.float32) -> float:
    """Ours from ONNX's, a float32 attribute in the file: as a decimal of that precision."""
    return float(f"{float(1.0 - value):.7g}")


def pads_to_onnx(pad: tuple[int, int]) -> list[int]:
    """ONNX's pads: [top, left, bottom, right]; ours are symmetric (h, w)."""
    return [pad[0], pad[1], pad[0], pad[1]]


def pads_from_onnx(pads: list[int]) -> tuple[int, int] | None:
    """Ours from ONNX's pads (none: zero); None where they are not symmetric."""
    pads = pads or [0, 0, 0, 0]
    return (pads[0], pads[1]) if len(pads) == 4 and pads[:2] == pads[2:] else None


def activation_nodes(act: Activation, helper: Any, numpy_helper: Any, inits: list, x: str, out: str, name: str) -> list:
    """The nodes of an activation from x to out (opset 17 has no SiLU or GELU operator: their
    defining forms, which the import folds back into one: ONNX_ACTIVATIONS)."""
    def constant(key: str, value: float) -> str:
        inits.append(numpy_helper.from_array(np.array(value, np.float32), f"{name}.{key}"))
        return f"{name}.{key}"

    if act.name == "relu6":  # a Clip to [0, 6], its bounds as initializers (opset 11 and later)
        return [helper.make_node("Clip", [x, constant("min", 0.0), constant("max", 6.0)], [out], name=name)]
    if act.name == "silu":  # x sigmoid(x)
        return [helper.make_node("Sigmoid", [x], [f"{name}.sigmoid"], name=f"{name}.sigmoid"),
                helper.make_node("Mul", [x, f"{name}.sigmoid"], [out], name=name)]
    if act.name == "gelu":  # x (1 + erf(x / sqrt 2)) / 2, as torch.onnx writes it
        steps = (("Div", [x, constant("sqrt2", float(np.sqrt(2.0)))], "scaled"), ("Erf", [f"{name}.scaled"], "erf"),
                 ("Add", [f"{name}.erf", constant("one", 1.0)], "sum"), ("Mul", [x, f"{name}.sum"], "product"),
                 ("Mul", [f"{name}.product", constant("half", 0.5)], None))
        return [helper.make_node(op, ins, [out if step is None else f"{name}.{step}"],
                                 name=name if step is None else f"{name}.{step}") for op, ins, step in steps]
    assert act.onnx_op, f"{act.name}: no ONNX form"
    return [helper.make_node(act.onnx_op, [x], [out], name=name)]
