"""Generator error types; the base class lives in the runtime (imports run one way)."""
from pcldnn_runtime.errors import ArchError, BuildDirError, PcldnnError


class NetSpecError(PcldnnError):
    """A net.json that is unreadable, malformed, or describes an impossible net."""


class PlanError(PcldnnError):
    """No kernel plan satisfies the constraints (e.g. too few registers)."""


class ModelImportError(PcldnnError):
    """A PyTorch or ONNX model that the net description cannot express (every node listed)."""


class CompileError(PcldnnError):
    """The C compiler failed; carries its command line, stderr and the source path."""


class SlowBuildWarning(UserWarning):
    """A build that runs, but slower than another precision would on its CPU (a bf16 build whose
    dot products run on a vdpbf16ps slower than the fp32 FMAs there: arch.slow_bf16_reason)."""


class CompilerWarning(UserWarning):
    """The C compiler warned about a generated file (-Wall): a pcldnn-gen bug, the kernel still
    built. The test suite turns it into an error (pyproject.toml), so every kernel it compiles
    is checked."""


__all__ = [
    "ArchError",
    "BuildDirError",
    "CompileError",
    "CompilerWarning",
    "ModelImportError",
    "NetSpecError",
    "PcldnnError",
    "PlanError",
]
