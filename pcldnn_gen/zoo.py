"""A shape zoo: layer shapes from published architectures, each benchmarked as a one-layer net
(`pcldnn-gen bench --zoo benchmarks/zoo/zoo.json`). The file is user input like a net: read
strictly, every shape validated as the net it becomes."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pcldnn_runtime.validate import LABEL_RE, NAME_RE, Fields, read_json

from .errors import NetSpecError
from .netspec import NetSpec, parse_netspec

# A convolution of at least this many input channels is timed inside a net in a bf16 bench
# (ZooShape.inner); fewer is a first layer's packed RGB-like input, timed as a net's first layer.
INNER_MIN_CHANNELS = 16


@dataclass(frozen=True)
class ZooShape:
    name: str
    family: str                 # the architecture it comes from
    net: NetSpec                # one conv or fc layer on the shape's input
    # The same layer as inside a net: a convolution between two ReLU layers, so that a bf16
    # build stores its input and output, and their gradients, as bf16 (families.bf16_outputs,
    # bf16_gradients), as a layer between convolutions has them and as oneDNN's bf16 primitives
    # are given them; as a net's first and last layer it would convert an fp32 input and write
    # fp32 (the bf16 bench times this one). A first-layer shape (packed few-channel input) is a
    # net's first layer, its output into a ReLU (stored as bf16, as in a net). fc layers: `net`.
    inner: NetSpec


def load_zoo(path: str | Path, max_memory: int | None = None) -> list[ZooShape]:
    data = read_json(path, NetSpecError)
    f = Fields(str(path), NetSpecError)
    f.obj(data, "", {"name", "shapes"}, {"about"})
    shapes, seen = [], set()
    for i, raw in enumerate(f.array(data["shapes"], "shapes", 1, 10_000)):
        at = f"shapes[{i}]"
        f.obj(raw, at, {"name", "family", "input", "layer"})
        name = f.string(raw["name"], f"{at}.name", NAME_RE, "a layer name")
        if name in seen:
            f.fail(f"{at}.name", f"{name} appears twice")
        seen.add(name)
        family = f.string(raw["family"], f"{at}.family", LABEL_RE, "letters, digits, '_', '.', '+', '-'")
        shape = f.array(raw["input"], f"{at}.input", 3, 3)
        layer = f.obj(raw["layer"], f"{at}.layer", {"type"},
                      {"out_channels", "out_features", "kernel", "stride", "pad", "groups"})
        f.choice(layer["type"], f"{at}.layer.type", ("conv", "fc"))
        net = {"name": name, "input": {"channels": shape[0], "height": shape[1], "width": shape[2]},
               "layers": [{"name": name, **layer}]}
        spec = parse_netspec(net, f"{path}: {at}", max_memory)
        inner = spec
        if layer["type"] == "conv":
            before, after = ("relu_before", "relu_after") if name not in ("relu_before", "relu_after") else \
                ("relu_in", "relu_out")
            first = spec.layers[0].in_shape[0] < INNER_MIN_CHANNELS
            inner = parse_netspec({**net, "layers": [*([] if first else [{"name": before, "type": "relu"}]),
                                                     *net["layers"], {"name": after, "type": "relu"}]},
                                  f"{path}: {at}", max_memory)
        shapes.append(ZooShape(name, family, spec, inner))
    return shapes
