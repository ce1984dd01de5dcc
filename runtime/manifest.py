"""Reading a build directory's manifest.json (the contract between generator and runtime), and
the other JSON files users hand the tools (arch and machine descriptions)."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from .errors import BuildDirError, PcldnnError

FORMAT = "pcldnn-build/1"
MANIFEST = "manifest.json"


def read_json(path: Path, error: type[PcldnnError] = PcldnnError) -> Any:
    """A user's JSON file, or `error` naming the file and the line and column of the problem."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def checked_fields(data: Any, cls, origin: str, error: type[PcldnnError] = PcldnnError) -> dict:
    """{name: dataclass field} of `cls` after checking that `data` is an object naming no other."""
    if not isinstance(data, dict):
        raise error(f"{origin}: (top level): must be an object")
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known:
            raise error(f"{origin}: {key}: unknown field (allowed: {', '.join(known)})")
    return known


def read_manifest(build_dir: Path) -> dict[str, Any]:
    """Parse and sanity-check `build_dir/manifest.json`."""
    path = Path(build_dir) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BuildDirError(f"{build_dir}: not a build directory (no {MANIFEST}); "
                            "run `pcldnn-gen compile NET.json` first") from None
    except (OSError, json.JSONDecodeError) as e:
        raise BuildDirError(f"{path}: unreadable manifest: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BuildDirError(f"{path}: format is {data.get('format') if isinstance(data, dict) else None!r}, "
                            f"expected {FORMAT!r}; recompile with this version")
    return data


def inside(build_dir: Path, relative: str) -> Path:
    """Resolve a manifest path, refusing any that escapes the build directory."""
    root = Path(build_dir).resolve()
    target = (root / relative).resolve()
    if root not in target.parents:
        raise BuildDirError(f"{build_dir}/{MANIFEST}: path {relative!r} escapes the build directory")
    return target
