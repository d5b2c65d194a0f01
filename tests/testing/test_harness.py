"""The multi-rank harness: ranks fork from a forkserver that preloaded megatron, yet each
rank runs with the launcher's environment and working directory of the moment it launched."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from megatron_gspo.testing.harness import spawn_ranks

pytestmark = pytest.mark.multirank


def _probe(rank: int, world: int) -> dict:
    return {
        "preloaded": "megatron.bridge" in sys.modules,  # before this function imported anything
        "env": os.environ.get("MGSPO_HARNESS_PROBE"),
        "cwd": os.getcwd(),
        "threads": threading.active_count(),
        "rank": (int(os.environ["RANK"]), world),
    }


def test_ranks_see_the_launchers_environment_now(tmp_path, monkeypatch):
    first = spawn_ranks(_probe, 2)  # starts the forkserver (if no earlier test did)
    monkeypatch.setenv("MGSPO_HARNESS_PROBE", "set after the forkserver started")
    monkeypatch.chdir(tmp_path)
    second = spawn_ranks(_probe, 2)
    assert [r["rank"] for r in second] == [(0, 2), (1, 2)]
    for a, b in zip(first, second, strict=True):
        assert a["preloaded"] and b["preloaded"]
        assert a["env"] is None and b["env"] == "set after the forkserver started"
        assert b["cwd"] == str(tmp_path)
        assert b["threads"] == 1  # nothing but the rank's own thread was forked
