"""The layering docs/design.md states, checked on the import statements (module level and
inside functions): the runtime's core loads and runs kernels without MPI or the scaling model,
and the generator's compile path depends on the shared contract only, not on the runtime's
internals."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE = ("net", "layers", "kernels", "optim", "data", "npyfile", "observe", "launcher", "families", "geometry",
        "limits", "manifest", "validate", "cpu", "abi", "errors", "state_io", "onnx_export", "partition",
        "layer_types", "activations", "onnx_conventions")
CLUSTER = {"mpi_safety", "distributed", "model_parallel", "layer_modes", "scaling", "mpi4py"}
# What generator and runtime share: the layer types, the activations' table and ONNX's
# conventions, the manifest schema, ranges, the kernel ABI, the kernel families and their geometry,
# CPU flags, the user-file reader, weights by name, error types.
CONTRACT = {"layer_types", "activations", "onnx_conventions", "cpu", "limits", "manifest", "families", "geometry",
            "abi", "validate", "state_io", "errors"}
COMPILE_PATH = ("netspec.py", "arch.py", "codegen.py", "compiler.py", "build.py", "tuning.py", "frontend.py",
                "onnx_frontend.py", "torch_frontend.py", "planner/__init__.py", "planner/conv.py", "planner/fc.py",
                "planner/amx.py", "planner/memory.py", "planner/plans.py", "planner/tiles.py", "planner/explain.py")
# (planner/parallel.py feeds the communication model of `pcldnn-gen plan` its thread division: it
# is the generator's side of the cluster layer, not on the path from net.json to a build.)


def _imports(path: Path, package: str) -> set[str]:
    """Modules of `package` (and top-level third-party names) a file imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                found.add(parts[1] if parts[0] == package and len(parts) > 1 else parts[0])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from . import x / from .x import y
                found |= {module.split(".")[0]} if module else {a.name for a in node.names}
            elif module.startswith(package + ".") or module == package:
                rest = module[len(package) + 1:]
                found |= {rest.split(".")[0]} if rest else {a.name for a in node.names}
            else:
                found.add(module.split(".")[0])
    return found


def _files(module: str) -> list[Path]:
    """A runtime module's file, or a package's files."""
    package = REPO / "runtime" / module
    return sorted(package.glob("*.py")) if package.is_dir() else [REPO / "runtime" / f"{module}.py"]


@pytest.mark.parametrize("module", CORE)
def test_the_runtime_core_imports_no_mpi_and_no_scaling_model(module):
    files = _files(module)
    assert files and all(f.exists() for f in files)
    for path in files:
        assert not _imports(path, "pcldnn_runtime") & CLUSTER, path.name


def _runtime_modules(path: Path) -> set[str]:
    """The pcldnn_runtime modules a generator file imports (`from pcldnn_runtime.x import ...`,
    `from pcldnn_runtime import x`), anywhere in it."""
    modules = {p.stem for p in (REPO / "runtime").glob("*.py")} - {"__init__"} | {"families"}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pcldnn_runtime"):
            rest = node.module[len("pcldnn_runtime"):].lstrip(".")
            found |= {rest.split(".")[0]} if rest else {a.name for a in node.names if a.name in modules}
    return found


@pytest.mark.parametrize("module", COMPILE_PATH)
def test_the_compile_path_depends_on_the_shared_contract_only(module):
    assert _runtime_modules(REPO / "pcldnn_gen" / module) <= CONTRACT


def test_the_check_sees_what_it_checks():
    """The parser finds the imports it must: distributed's of mpi_safety, and the MPI import."""
    found = _imports(REPO / "runtime" / "distributed.py", "pcldnn_runtime")
    assert {"mpi_safety", "layer_modes"} <= found
    assert "mpi_safety" in _imports(REPO / "runtime" / "__init__.py", "pcldnn_runtime")
    assert "scaling" in _runtime_modules(REPO / "pcldnn_gen" / "planner" / "parallel.py")  # outside the contract
