"""Are a model directory's weights there? Checked before any engine or trainer starts.

The recipes' model paths ship only `config.json` (the shapes the planner needs); a launch from
them would start engines that load nothing (SGLang then fails after minutes of start-up) and a
trainer that dies in megatron-bridge. `model_files_problem` says so in one line first. Plain
Python: the planner and the Slurm path call it without torch.

(A minimal check for issue 35; issue 40's start-up validation in `preflight.py` covers the same
ground for the trainer, and the two should become one function.)
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["model_files_problem"]

INDEX = "model.safetensors.index.json"


def _unreadable(f: Path) -> str | None:
    """Why the safetensors file `f` cannot be loaded (missing, empty, unreadable, a header
    that is not one), or None. Reads only the 8-byte length and the JSON header."""
    if not f.is_file():
        return "missing"
    try:
        with f.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return "empty" if not head else "truncated (no safetensors header)"
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20 or n > f.stat().st_size:
                return "not a safetensors file (header length out of range)"
            json.loads(fh.read(n))
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    except ValueError:
        return "not a safetensors file (bad header)"
    return None


def model_files_problem(path: str | Path, key: str = "model.hf_path") -> str | None:
    """One line naming what is wrong with the weights of the Hugging Face model directory
    `path` (`key`: the config key that names it), or None when every weight file is there:
    with `model.safetensors.index.json`, every file its `weight_map` names is present,
    non-empty and has a readable safetensors header; without one, at least one
    `*.safetensors` file does and all present ones do."""
    d = Path(path)
    fix = (
        f"download the checkpoint into it or point {key} at one (the recipes' directories "
        "hold only config.json, for planning)"
    )
    if not d.is_dir():
        return f"{key}={path}: no such directory; {fix}"
    if not (d / "config.json").is_file():
        return f"{key}={path}: no config.json; not a Hugging Face model directory"
    index = d / INDEX
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{index}: unreadable weight_map ({type(e).__name__}); re-download it"
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
        if not files:
            return f"{key}={path}: no *.safetensors weights; {fix}"
    bad = [(f, why) for f in files if (why := _unreadable(d / f)) is not None]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        f, why = bad[0]
        return f"{key}={path}: weight file {f} {why}{more}; {fix}"
    return None
