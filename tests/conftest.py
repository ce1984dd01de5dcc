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

from helpers import ISA_PARAMS, runs  # noqa: E402

from pcldnn_runtime import cpu  # noqa: E402

NEEDS = "needs ISA "  # every ISA skip's reason starts so: the summary counts them per level


@pytest.fixture(params=ISA_PARAMS)
def isa(request) -> str:
    return request.param


def pytest_collection_modifyitems(config, items) -> None:
    """A parameter named `isa` whose value is an ISA level needs that level: marked here, so a
    test cannot run an ISA this CPU lacks because its skip mark was lost on the way (a
    pytest.param nested in another drops its marks)."""
    for item in items:
        value = getattr(item, "callspec", None) and item.callspec.params.get("isa")
        if isinstance(value, str) and value in cpu.ISA_LEVELS:
            item.add_marker(pytest.mark.needs_isa(value))


def pytest_runtest_setup(item) -> None:
    for mark in item.iter_markers("needs_isa"):
        level = mark.args[0]
        if level not in cpu.ISA_LEVELS:
            raise ValueError(f"needs_isa({level!r}): not one of {cpu.ISA_LEVELS}")
        if not runs(level):
            _skip_for_want_of(level)


def _skip_for_want_of(level: str, why: str = "") -> None:
    """Skip with the reason pytest_terminal_summary counts per level."""
    pytest.skip(f"{NEEDS}{level}: {cpu.capped('this CPU')} runs up to {cpu.isa_level()}{why}")


@pytest.fixture(autouse=True)
def _bf16_kernels(request, monkeypatch):
    """A test marked bf16_kernels runs on real AVX512_BF16, else on emulated instructions
    (which need AVX-512F)."""
    from bf16_emulation import emulate
    if request.node.get_closest_marker("bf16_kernels") is None or runs("avx512_bf16"):
        return
    if not runs("avx512"):
        _skip_for_want_of("avx512", ", and vdpbf16ps kernels are emulated in AVX-512F")
    emulate(monkeypatch)


def pytest_report_header(config) -> list[str]:
    lines = [f"ISA: {cpu.capped('this CPU')} runs up to {cpu.isa_level()}"]
    if runs("avx512") and not runs("avx512_bf16"):
        lines.append("bf16: no AVX512_BF16 here; tests marked bf16_kernels run the vdpbf16ps kernels emulated in "
                     "AVX-512F")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """What this run did not exercise for want of an ISA: skipped tests counted per level."""
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith(NEEDS):
            level = reason[len(NEEDS):].split(":")[0]
            counts[level] = counts.get(level, 0) + 1
    where = f"{cpu.capped('this CPU')} runs up to {cpu.isa_level()}"
    terminalreporter.write_sep("-", "ISA coverage")
    if counts:
        shown = ", ".join(f"{level} {counts[level]}" for level in cpu.ISA_LEVELS if level in counts)
        terminalreporter.write_line(f"{where}; tests skipped for want of an ISA: {shown}")
    else:
        terminalreporter.write_line(f"{where}; no test skipped for want of an ISA")
