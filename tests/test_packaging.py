"""A wheel built from the repo works on its own: installed in a fresh venv, it finds its templates."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import NETS, REPO

PACKAGED = ["pyproject.toml", "README.md", "pcldnn_gen", "runtime", "templates"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_in_fresh_venv_compiles_cifar_small(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in PACKAGED:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "-w", str(dist), str(src)], check=True, timeout=300)
    wheel = next(dist.glob("pcldnn_gen-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
                   check=True, timeout=600)
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run([str(venv / "bin" / "pcldnn-gen"), "compile", str(NETS / "cifar_small.json"),
                          "--arch", "scalar", "-o", "out"], cwd=work, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PCLDNN_CACHE_DIR": str(tmp_path / "cache"),
                              "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    check = subprocess.run([str(py), "-c", (
        "import numpy as np, pcldnn_gen, pcldnn_runtime as pr\n"
        "print(pcldnn_gen.__file__)\n"
        "print(pr.load('out').forward(np.zeros((2, 3, 32, 32), np.float32)).shape)\n")],
        cwd=work, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    location, shape = check.stdout.split("\n")[:2]
    assert Path(location).is_relative_to(venv) and shape == "(2, 10)"
    # A plain install brings no launcher (a cluster's own MPI must win); the mpich extra brings
    # one, so a fresh machine needs no system MPI.
    assert not (venv / "bin" / "mpiexec").exists()
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"{wheel}[mpich]"],
                   check=True, timeout=600)
    assert (venv / "bin" / "mpiexec").exists()
