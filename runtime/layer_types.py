"""The layer types a build holds and the passes each has: a leaf module (it imports nothing of
the package), so the kernel families, the manifest reader and the generator all read one table
without importing each other."""
from __future__ import annotations

PASSES = ("fwd", "bwd_data", "bwd_weights")
# The passes each layer type has; every layer also has its "layout" conversions.
LAYER_PASSES: dict[str, tuple[str, ...]] = {
    "conv": PASSES, "fc": PASSES,
    "maxpool": ("fwd", "bwd_data"), "avgpool": ("fwd", "bwd_data"),
    "relu": ("fwd", "bwd_data"), "relu6": ("fwd", "bwd_data"), "dropout": ("fwd", "bwd_data"), "batchnorm": PASSES,
    "add": ("fwd", "bwd_data"), "concat": ("fwd", "bwd_data"),
    "softmax_cross_entropy": ("fwd", "bwd_data"),
}
WEIGHTED = ("conv", "fc")
WINDOWED = ("conv", "maxpool", "avgpool")
JOINS = ("add", "concat")  # the layers that read several
