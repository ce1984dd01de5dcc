"""The README as a newcomer meets it: every shell and Python block, in the page's order, in a
fresh working directory beside the repository's examples, with the virtual environment active.
A block that cannot run here says so just above itself (`<!-- readme-test: skip (why) -->`), or
how it runs (`<!-- readme-test: mpiexec -n 2 -->`); each Python block runs alone in a new
interpreter, so a name it does not define fails it, as it would fail a reader who pastes it."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import MPIEXEC, REPO

README = REPO / "README.md"
FENCE = re.compile(r"^(?P<indent>[ ]*)(?:<!-- readme-test: (?P<directive>[^\n]*?) -->\n[ ]*)?```(?P<lang>\w*)\n"
                   r"(?P<body>.*?)^[ ]*```[ ]*$", re.M | re.S)
RUN = ("sh", "python")  # json fragments and the like are shown, not run


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    body: str
    directive: str | None


def readme_blocks(text: str) -> list[Block]:
    return [Block(text.count("\n", 0, m.start("body")) + 1, m["lang"],
                  textwrap.dedent(re.sub(r"^" + m["indent"], "", m["body"], flags=re.M)), m["directive"])
            for m in FENCE.finditer(text)]


def test_the_block_reader_finds_every_fenced_block():
    text = README.read_text()
    blocks = readme_blocks(text)
    assert len(blocks) == text.count("```") // 2  # every fence opened and closed, none swallowed
    assert sum(b.lang in RUN for b in blocks) >= 10
    for b in blocks:
        assert b.directive is None or b.directive.startswith("skip (") or b.directive == "mpiexec -n 2", b


@pytest.mark.slow
@pytest.mark.needs_isa("avx2")  # the tour builds VGG-A for --arch avx2
def test_every_readme_block_runs_as_written(tmp_path):
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / ".venv").symlink_to(sys.prefix)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               VIRTUAL_ENV=sys.prefix, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    has_torch = importlib.util.find_spec("torch") is not None
    ran, left = [], []
    for n, block in enumerate(b for b in readme_blocks(README.read_text()) if b.lang in RUN):
        where = f"README.md line {block.line}"
        if block.directive and block.directive.startswith("skip ("):
            continue
        if not has_torch and re.search(r"^import .*\btorch\b", block.body, re.M):
            left.append(where)
            continue
        if block.lang == "sh":
            cmd = ["bash", "-euo", "pipefail", "-c", block.body]
        else:
            script = tmp_path / "build" / f".readme-block-{n}.py"
            script.parent.mkdir(exist_ok=True)
            script.write_text(block.body)
            cmd = [sys.executable, str(script)]
            if block.directive == "mpiexec -n 2":
                if MPIEXEC is None:
                    pytest.fail(f"{where}: no mpiexec (the mpich wheel provides one)")
                cmd = [MPIEXEC, "-n", "2", *cmd]
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, f"{where} ({block.lang}) failed:\n{block.body}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        ran.append(where)
    # what the blocks write goes under build/ (ignored by git), nothing into the checkout
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv", "build", "examples"]
    assert len(ran) >= 8, ran
    if left:
        pytest.skip(f"ran {len(ran)} blocks; {', '.join(left)} need torch (make test-extras installs its CPU build)")
