"""The activation functions, one row each: everything the net description, the generator, the
runtime and the framework bridges need to know of one (docs/design.md, "Activations"). A leaf
module (it imports nothing of the package): a new activation is a row here, its vector C in
templates/_activation.c.j2 (where its backward reads its input) and, where ONNX writes it as
several operators, their form in onnx_conventions.py and its fold in onnx_frontend.py.

An activation is a layer type of its own (`{"type": "silu"}`) and, where `fuses_into` says, the
`activation` field of another layer, applied by that layer's kernel as its output is stored.
Its backward pass reads one of two things:
- "output": the derivative is 0 or 1, decided from the forward output (a mask: ReLU, ReLU6),
  so a fused activation costs the backward nothing but a compare;
- "input": the derivative is computed from the forward input (sigmoid, SiLU, GELU). A standalone layer's
  kernel reads its input; a fused one recomputes the pre-activation value (a batchnorm's from
  its input and its scale and shift).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Activation:
    name: str                   # the net.json spelling: a layer type, and an `activation` value
    formula: str                # what it computes, for people (plans, headers, docs)
    derivative: str             # its backward's factor, for people
    backward: str               # "output" (a 0/1 mask from the output) or "input" (f'(x) from the input)
    fuses_into: frozenset[str]  # the layer types whose kernels may apply it to their output
    # C, {x}: the input, {y}: the output: the forward value, and the backward's factor (a
    # condition on {y} where backward is "output": scalar C; f'({x}) where it is "input": calls of
    # the functions templates/_activation.c.j2 writes for the target's vector type)
    c_forward: str
    c_backward: str
    torch_modules: tuple[str, ...]    # torch.nn classes (by name) that compute it
    torch_functions: tuple[str, ...]  # torch.nn.functional / torch functions and tensor methods
    onnx_op: str                # the one ONNX operator computing it ("": several, onnx_conventions.activation_nodes)

    @property
    def from_input(self) -> bool:
        """Its backward reads the forward input (else the forward output, as a mask)."""
        return self.backward == "input"

    def forward_c(self, x: str) -> str:
        return self.c_forward.format(x=x)

    def backward_c(self, operand: str) -> str:
        """The backward's factor for the operand it reads (`backward`: the output or the input)."""
        return self.c_backward.format(y=operand, x=operand)


ACTIVATIONS: dict[str, Activation] = {a.name: a for a in (
    Activation("relu", "max(x, 0)", "(y > 0)", "output", frozenset({"conv", "fc", "batchnorm", "add"}),
               "{x} > 0.0f ? {x} : 0.0f", "{y} > 0.0f",
               ("ReLU",), ("relu", "relu_"), "Relu"),
    Activation("relu6", "min(max(x, 0), 6)", "(0 < y < 6)", "output", frozenset({"batchnorm"}),
               "{x} > 0.0f ? ({x} < 6.0f ? {x} : 6.0f) : 0.0f", "{y} > 0.0f && {y} < 6.0f",
               ("ReLU6",), ("relu6",), ""),
    Activation("sigmoid", "1 / (1 + exp(-x))", "s (1 - s), s = sigmoid(x)", "input", frozenset({"batchnorm"}),
               "sigmoid_forward({x})", "sigmoid_derivative({x})",
               ("Sigmoid",), ("sigmoid",), "Sigmoid"),
    Activation("silu", "x sigmoid(x) = x / (1 + exp(-x))", "s (1 + x (1 - s)), s = sigmoid(x)", "input", frozenset({"batchnorm"}),
               "silu_forward({x})", "silu_derivative({x})",
               ("SiLU",), ("silu",), ""),
    Activation("gelu", "x Phi(x) = x (1 + erf(x / sqrt 2)) / 2", "Phi(x) + x phi(x)", "input", frozenset({"batchnorm"}),
               "gelu_forward({x})", "gelu_derivative({x})",
               ("GELU",), ("gelu",), ""),
)}


def activation(name: str | None) -> Activation | None:
    """The row of an activation name (None: no activation). A name outside the table is a
    programming error: net.json and manifests are checked against ACTIVATIONS when read."""
    return None if name is None else ACTIVATIONS[name]
