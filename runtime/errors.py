"""Exception types shared by the generator and the runtime.

They live in the runtime because the generator may import the runtime but never the
reverse; every user-facing error is a `PcldnnError`, so the CLI can print it in one line.
"""


class PcldnnError(Exception):
    """Base of every error caused by user input or the environment (not by a bug)."""


class ArchError(PcldnnError):
    """Unknown or malformed CPU description, or an ISA this CPU cannot run."""


class BuildDirError(PcldnnError):
    """A build directory that is missing, of another format, or corrupt."""


class CheckpointError(PcldnnError):
    """A checkpoint that is missing, corrupt, of another net, or of another format."""


class NonFiniteError(PcldnnError):
    """NaN or infinity in a training input, a gradient or the weights: training stops at that
    step, naming the layer, instead of carrying on with weights that are no longer numbers.
    `step`: the training step, where the raiser knows it (the trainer adds it otherwise)."""

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message if step is None else f"step {step}: {message}")
        self.message, self.step = message, step
