"""What a process knows of an MPI job before MPI is initialised: the environment variables
through which launchers (MPICH / Intel MPI hydra and PMI, Open MPI, MVAPICH) announce the job's
size, this process's rank and the ranks on its node, and where `mpiexec` is. No MPI import: the
core runtime (timelines, default thread counts) reads these; the cluster layer
(`mpi_safety`, `distributed`) builds on them."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

WORLD_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
WORLD_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK")
LOCAL_SIZE_ENV = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def launcher_value(names: tuple[str, ...], default: int) -> int:
    """The first of the launcher's variables `names` that holds a plain number, else `default`."""
    for name in names:
        text = os.environ.get(name, "")
        if text.isdigit() and len(text) < 9:
            return int(text)
    return default


def launched() -> bool:
    """Whether a launcher announced a job of more than one rank."""
    return launcher_value(WORLD_SIZE_ENV, 1) > 1


def local_ranks() -> int | None:
    """Ranks on this node as the launcher announced them (None: it did not say)."""
    ranks = launcher_value(LOCAL_SIZE_ENV, 0)
    return ranks if ranks >= 1 else None


def mpiexec() -> str | None:
    """The MPI launcher: the one installed beside this Python (the mpich wheel's), else PATH's."""
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
