"""Provenance of a measurement written to JSON: commit, dirty flag, command, time, load."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def provenance(argv: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """Commit (full hash), whether tracked code differs from it (data under docs/ aside), the
    exact command line, UTC time, load average and CPU count; `extra` (e.g. the seed) added."""
    argv = sys.argv if argv is None else argv
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": dirty not in ("", "unknown"),
        "command": " ".join(["python", *argv]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        **extra,
    }
