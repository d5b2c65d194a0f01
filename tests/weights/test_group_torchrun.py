"""The trainer's weight-update group forms when the trainer runs under torchrun.

torchrun sets TORCHELASTIC_USE_AGENT_STORE=True in every worker's environment, which makes
torch's `rendezvous("tcp://...")` a client on every rank (torchrun's agent is assumed to host
the store). Rank 0 (the trainer) must host the weight-update store itself, or the trainer and
the engines (which SGLang joins as clients through `rendezvous`) wait on each other until the
timeout: the hang the 235B recipe rehearsal showed.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.dist import free_port
from megatron_gspo.engines.weight_group import init_weight_update_group
from tests.plan.rehearsal_engine import join_gloo_rank


def _engine_side(port: int, out: dict) -> None:
    """An engine TP rank joining as SGLang's `init_custom_process_group` does (same keys)."""
    try:
        pg = join_gloo_rank("127.0.0.1", port, 2, 1, "wug", timeout=timedelta(seconds=30))
        t = torch.zeros(4)
        pg.broadcast(t, 0).wait()
        out["got"] = t
    except Exception as e:  # noqa: BLE001 - reported by the test
        out["error"] = e


def test_group_forms_under_torchrun_agent_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what torchrun's workers see
    port = free_port()
    out: dict = {}
    engine = threading.Thread(target=_engine_side, args=(port, out), daemon=True)
    engine.start()
    pg = init_weight_update_group(
        master_address="127.0.0.1",
        master_port=port,
        world_size=2,
        group_name="wug",
        backend="gloo",
        timeout_s=30,
    )
    sent = torch.arange(4, dtype=torch.float32) + 1
    dist.broadcast(sent, src=0, group=pg)
    engine.join(timeout=30)
    assert "error" not in out, out.get("error")
    assert torch.equal(out["got"], sent)
    dist.destroy_process_group(pg)
