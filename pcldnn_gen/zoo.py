"""A shape zoo: layer shapes from published architectures, each benchmarked as a one-layer net
(`pcldnn-gen bench --zoo benchmarks/zoo/zoo.json`). The file is user input like a net: read
strictly, every shape validated as the net it becomes."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pcldnn_runtime.validate import LABEL_RE, NAME_RE, Fields, read_json

from .errors import NetSpecError
from .netspec import NetSpec, parse_netspec


@dataclass(frozen=True)
class ZooShape:
    name: str
    family: str                 # the architecture it comes from
    net: NetSpec                # one conv or fc layer on the shape's input


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
        layer = f.obj(raw["layer"], f"{at}.layer", {"type"}, {"out_channels", "out_features", "kernel", "stride", "pad"})
        f.choice(layer["type"], f"{at}.layer.type", ("conv", "fc"))
        net = {"name": name, "input": {"channels": shape[0], "height": shape[1], "width": shape[2]},
               "layers": [{"name": name, **layer}]}
        shapes.append(ZooShape(name, family, parse_netspec(net, f"{path}: {at}", max_memory)))
    return shapes
