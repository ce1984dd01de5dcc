"""Fixtures and test-run set-up: a persistent kernel cache for the test suite, the ISA fixture.
Shared helpers live in helpers.py."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# Tests never touch the user's cache. Their own cache persists between runs (the key covers the
# source, the compiler and the flags, so a stale entry cannot be served): a warm run compiles
# nothing. PCLDNN_TEST_CACHE moves it.
REPO = Path(__file__).resolve().parent.parent
os.environ["PCLDNN_CACHE_DIR"] = os.environ.get("PCLDNN_TEST_CACHE", str(REPO / "build" / "test-kernel-cache"))
# Nor the user's tuning database: builds in tests follow the model unless a test points
# PCLDNN_TUNING_DB at a database of its own.
os.environ["PCLDNN_TUNING_DB"] = os.path.join(tempfile.mkdtemp(prefix="pcldnn-test-tuning-"), "tuning.json")
sys.path.insert(0, str(Path(__file__).parent))

from helpers import ISA_PARAMS  # noqa: E402


@pytest.fixture(params=ISA_PARAMS)
def isa(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _bf16_kernels(request, monkeypatch):
    """A test marked bf16_kernels runs on real AVX512_BF16, else on emulated instructions."""
    from bf16_emulation import CAN_EMULATE, HAS_BF16, WHY_NOT, emulate
    if request.node.get_closest_marker("bf16_kernels") is None or HAS_BF16:
        return
    if not CAN_EMULATE:
        pytest.skip(WHY_NOT)
    emulate(monkeypatch)


def pytest_report_header(config) -> str | None:
    from bf16_emulation import CAN_EMULATE
    if CAN_EMULATE:
        return "bf16: this CPU lacks AVX512_BF16; tests marked bf16_kernels run the vdpbf16ps kernels emulated in AVX-512F"
    return None
