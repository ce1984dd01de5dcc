"""Reading a build directory's manifest.json: the contract between generator and runtime."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import BuildDirError

FORMAT = "pcldnn-build/1"
MANIFEST = "manifest.json"


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
