"""What the documents promise runs: every module of both packages imports alone in a fresh
interpreter, every script that README.md, benchmarks/RESULTS.md and docs/ name runs at a tiny
size here or in the test file named for it, and every `pcldnn-gen` command line they write
parses (both lists are read from the documents, so a new one cannot be left out)."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import MPIEXEC, REPO, RUNNABLE_ISAS, TRAIN_LAYERS, runs

ISA = RUNNABLE_ISAS[-1]
DOCUMENTS = [REPO / "README.md", REPO / "benchmarks" / "RESULTS.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPT = re.compile(r"\b((?:benchmarks|examples)/[A-Za-z0-9_]+\.py)\b")
HAS_TORCH = importlib.util.find_spec("torch") is not None

# Scripts another test file already runs from its command line (the file must name the script).
TESTED_ELSEWHERE = {
    "benchmarks/dot_emulation.py": "test_dot_emulation.py",
    "examples/train.py": "test_training.py",
}
# The others, at a tiny size: arguments ({isa}, {tmp}, {net}: a small net.json, {res}: a small
# residual one, {build}: the small net's build), and what they need beyond the suite's own.
TINY = {
    "benchmarks/activations.py": (["--threads", "1", "--batch", "2", "--rounds", "1", "--repeats", "1", "--arch",
                                   "{isa}", "--shapes", "16x6x6"], ("torch",)),
    "benchmarks/ab.py": (["{build}", "{build}", "--batch", "2", "--threads", "1", "--rounds", "1", "--repeats", "1"], ()),
    "benchmarks/api_overhead.py": (["--arch", "{isa}", "--net", "{net}", "--layer", "conv1", "--batch", "2",
                                    "--rounds", "1", "--calls", "10"], ()),
    "benchmarks/bf16_targets.py": (["--out", "{tmp}/bf16", "--arch", "zen5", "--dry-run"], ()),
    "benchmarks/data_pipeline.py": (["--arch", "{isa}", "--threads", "1", "--workers", "1", "--batch", "8", "--steps",
                                     "7", "--gigabytes", "0.002", "--pngs", "64", "--workdir", "{tmp}/data"], ()),
    "benchmarks/dump_c.py": (["{tmp}/c", "--nets", "digits", "--targets", "scalar:fp32,avx512:bf16"], ()),
    "benchmarks/finite_checks.py": (["--nets", "digits", "--batch", "8", "--rounds", "2", "--threads", "1",
                                     "--arch", "{isa}"], ()),
    "benchmarks/fusion.py": (["{res}", "--batch", "2", "--threads", "1", "--arch", "{isa}", "--rounds", "1"], ()),
    "benchmarks/kernel_profile.py": (["{net}", "--arch", "avx2", "--layers", "conv1,fc1", "--batch", "1", "--fc-batch",
                                      "4", "--repeats", "1"], ("avx2", "valgrind", "llvm-mca")),
    "benchmarks/paper_scaling.py": ([], ()),
    "benchmarks/random_nets.py": (["--seeds", "0:1", "--mode", "fp32"], ()),
    "benchmarks/scaling.py": (["--nets", "cifar_small", "--arch", "{isa}", "--batch", "8", "--steps", "2", "--repeats", "1",
                               "--json", "{tmp}/scaling.json"], ("mpiexec",)),
    "benchmarks/spill_scan.py": (["--arch", "avx2", "--layers", "alexnet_conv1", "--json", "{tmp}/spill.json"], ()),
    "benchmarks/step_breakdown.py": (["{build}", "--batch", "4", "--threads", "1", "--steps", "2"], ()),
    "benchmarks/summarize.py": (["{tmp}/bench.json"], ()),
    "benchmarks/thread_division.py": (["--net", "{net}", "--batch", "1,2", "--arch", "{isa}", "--rounds", "1"], ()),
    "benchmarks/tile_microbench.py": (["--isa", "avx2", "--repeats", "1", "--tiles", "2x2"], ("avx2",)),
    "benchmarks/train_throughput.py": (["--net", "{net}", "--arch", "{isa}", "--no-tuning", "--batch", "4",
                                        "--threads", "1", "--steps", "2"], ("torch",)),
    "benchmarks/tune_summary.py": (["{tmp}/tune.json"], ()),
    "examples/demo.py": (["--net", "{net}", "--arch", "{isa}", "--batch", "2", "--threads", "1", "--repeats", "1"], ()),
    "examples/make_modern_nets.py": (["--out", "{tmp}/nets"], ("torch",)),
}
RESIDUAL = [
    {"name": "c0", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "bias": False},
    {"name": "b0", "type": "batchnorm", "activation": "relu"},
    {"name": "c1", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "bias": False},
    {"name": "b1", "type": "batchnorm"},
    {"name": "sum", "type": "add", "inputs": ["b1", "b0"], "activation": "relu"},
    {"name": "gap", "type": "global_avgpool"},
    {"name": "fc", "type": "fc", "out_features": 5},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


def named_scripts() -> set[str]:
    return {m for doc in DOCUMENTS for m in SCRIPT.findall(doc.read_text())}


def test_every_script_the_documents_name_is_covered():
    named = named_scripts()
    assert "benchmarks/scaling.py" in named and "examples/train.py" in named  # the reader reads
    missing = named - TINY.keys() - TESTED_ELSEWHERE.keys()
    assert not missing, f"named in the documents but run by no test: {sorted(missing)} (add them to TINY)"
    for script in named | TINY.keys():
        assert (REPO / script).is_file(), f"the documents name {script}, which does not exist"
    for script, test in TESTED_ELSEWHERE.items():
        assert Path(script).name in (REPO / "tests" / test).read_text(), (script, test)


def _modules() -> list[str]:
    names = []
    for package, folder in (("pcldnn_gen", REPO / "pcldnn_gen"), ("pcldnn_runtime", REPO / "runtime")):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            names.append(".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return names


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """An import cycle hides when a module is always reached through another (the manifest and
    the kernel families were): each module first, alone, in its own interpreter."""
    modules = _modules()
    assert "pcldnn_runtime.manifest" in modules and "pcldnn_runtime.families.base" in modules

    def imports(name: str) -> str | None:
        out = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=120)
        return None if out.returncode == 0 else f"{name}: {out.stderr.strip().splitlines()[-1]}"

    with ThreadPoolExecutor(4) as pool:
        failures = [f for f in pool.map(imports, modules) if f]
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small net and its build for the ISA this CPU runs widest."""
    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import parse_netspec
    tmp = tmp_path_factory.mktemp("docs")
    doc = {"name": "small", "input": {"channels": 3, "height": 8, "width": 8}, "layers": TRAIN_LAYERS}
    (tmp / "small.json").write_text(json.dumps(doc))
    (tmp / "res.json").write_text(json.dumps({"name": "res", "input": {"channels": 3, "height": 8, "width": 8},
                                              "layers": RESIDUAL}))
    build(parse_netspec(doc), get_arch(ISA), tmp / "build")
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(TINY))
def test_a_script_the_documents_name_runs_at_a_tiny_size(script, small, tmp_path):
    args, needs = TINY[script]
    if "torch" in needs and not HAS_TORCH:
        pytest.skip(f"{script} needs torch (make test-extras installs its CPU build)")
    if "mpiexec" in needs and MPIEXEC is None:
        pytest.skip(f"{script} needs mpiexec (the mpich wheel provides one)")
    if "avx2" in needs and not runs("avx2"):
        pytest.skip(f"needs ISA avx2: {script} runs AVX2 kernels")
    for tool in ("valgrind", "llvm-mca"):
        if tool in needs and shutil.which(tool) is None:
            pytest.skip(f"{script} needs {tool}")
    from pcldnn_gen.cli import main
    if script == "benchmarks/tune_summary.py":  # it reads what `tune --json` writes
        assert main(["tune", str(small / "small.json"), "--arch", ISA, "--batch", "2", "--threads", "1",
                     "--candidates", "2", "--json", str(tmp_path / "tune.json")]) == 0
    if script == "benchmarks/summarize.py":  # and this what `bench --json` writes
        assert main(["bench", str(small / "small.json"), "--arch", ISA, "--batch", "2", "--threads", "1",
                     "--repeats", "1", "--json", str(tmp_path / "bench.json")]) == 0
    values = {"isa": ISA, "tmp": str(tmp_path), "net": str(small / "small.json"), "res": str(small / "res.json"),
              "build": str(small / "build")}
    out = subprocess.run([sys.executable, str(REPO / script), *(a.format(**values) for a in args)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{script}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{script} printed nothing"
    if script == "examples/make_modern_nets.py":  # the nets in examples/ are what it makes
        for made in sorted((tmp_path / "nets").glob("*.json")):
            assert made.read_text() == (REPO / "examples" / "nets" / made.name).read_text(), made.name


COMMAND = re.compile(r"(?:pcldnn-gen|python -m pcldnn_gen) ((?:compile|inspect|peak|bench|tune|plan|import|train|cache)\b"
                     r"[^`|#;\n]*)")
# What the documents write for "a value of your choice", as a value the parser takes
PLACEHOLDERS = {"ISA": "avx2", "T": "1", "B": "16", "NET": "net.json", "OUT.json": "out.json"}


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every `pcldnn-gen VERB ...` the documents write, as argv up to the first token that is
    prose rather than a value (an optional part in brackets, a {a,b} choice, an ellipsis)."""
    found = []
    for doc in DOCUMENTS:
        for match in COMMAND.finditer(doc.read_text()):
            argv = []
            for token in match[1].split():
                if token == "/" or any(mark in token for mark in ("[", "{", "...", "\\", "<")):
                    break
                argv.append(PLACEHOLDERS.get(token, token))
            if len(argv) > 1:  # a verb alone: the document naming it, not a command
                found.append((f"{doc.name}: pcldnn-gen {match[1].strip()}", argv))
    return found


def test_every_pcldnn_gen_command_the_documents_write_parses():
    """Each documented command line names a verb and options the CLI has, with values it
    takes (the line is parsed, not run: the README's blocks run in test_readme.py)."""
    from pcldnn_gen.cli import parser
    commands = documented_commands()
    assert len(commands) >= 40 and {argv[0] for _, argv in commands} >= {"compile", "bench", "train", "plan", "tune"}
    def refusal(argv: list[str]) -> str | None:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser().parse_args(argv)
        except SystemExit:
            return err.getvalue().strip().splitlines()[-1]
        return None

    bad = []
    for where, argv in commands:
        why = refusal(argv)
        if why and "expected one argument" in why and refusal(argv[:-1]) is None:
            continue  # an option last on a line, its value on the next (an inline span wrapped in the text)
        if why:
            bad.append(f"{where}: {why}")
    assert not bad, "documented commands the CLI refuses:\n" + "\n".join(bad)
