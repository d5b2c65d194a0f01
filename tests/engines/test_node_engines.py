"""Trainer-launched engines (issue 20, defect 8): every node starts its own share, each from
its local rank 0, on ports reserved for the job until the engines hold them; `free_port` no
longer binds and closes."""

from __future__ import annotations

import socket

import pytest

from megatron_gspo import dist
from megatron_gspo.testing.harness import spawn_ranks
from tests.engines import node_engines_ranks


def _exclusive_bind(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_free_port_stays_reserved_until_its_server_takes_it():
    port = dist.free_port()
    try:
        assert not _exclusive_bind(port)  # another job's probe or bind: refused while held
        with socket.socket() as server:  # the server it was meant for (SO_REUSEADDR, as
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # uvicorn, TCPStore)
            server.bind(("127.0.0.1", port))
            server.listen()
    finally:
        dist.release_port("127.0.0.1", port)
    assert _exclusive_bind(port)


def test_two_jobs_on_one_node_get_distinct_engine_ports():
    with socket.socket() as busy:  # something already listens in the range
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        start = busy.getsockname()[1] - 1
        a = dist.free_ports("127.0.0.1", 3, start)
        b = dist.free_ports("127.0.0.1", 3, start)
        try:
            ports_a, ports_b = set(range(a, a + 3)), set(range(b, b + 3))
            assert not ports_a & ports_b
            assert busy.getsockname()[1] not in ports_a | ports_b
            assert not any(_exclusive_bind(p) for p in ports_a | ports_b)
        finally:
            for p in ports_a | ports_b:
                dist.release_port("127.0.0.1", p)


@pytest.mark.multirank
@pytest.mark.slow  # ~10-20 s: two spawned ranks
def test_each_node_starts_its_own_engines(tmp_path):
    r0, r1 = spawn_ranks(node_engines_ranks.main, 2, 4, str(tmp_path))
    for node, r in enumerate((r0, r1)):
        assert len(r["launched"]) == 1 and r["mine"]  # each node's local rank 0 launched
        got = r["launched"][0]
        assert got["num_engines"] == 2 and all(got["held_while_starting"])
        assert got["log_dir"].endswith(f"node{node}")
        assert r["per_node"] == [2, 2]
    assert r0["urls"] == r1["urls"] == r0["launched"][0]["urls"] + r1["launched"][0]["urls"]
    assert len(set(r0["urls"])) == 4  # both "nodes" share this host here: no port twice
    # 5 engines on 2 nodes: node 0 starts 3, node 1 starts 2; every rank sees all 5, in order
    assert r0["uneven_launched"] == [3] and r1["uneven_launched"] == [2]
    assert r0["uneven_per_node"] == r1["uneven_per_node"] == [3, 2]
    assert r0["uneven_urls"] == r1["uneven_urls"] and len(set(r0["uneven_urls"])) == 5


def test_engines_split_over_nodes_as_evenly_as_they_go():
    from megatron_gspo.engines.nodes import engines_on_node

    for n, nodes in [(1, 2), (4, 2), (5, 2), (3, 4), (7, 3)]:
        shares = [engines_on_node(n, i, nodes) for i in range(nodes)]
        assert sum(shares) == n and max(shares) - min(shares) <= 1
        assert shares == sorted(shares, reverse=True)  # the first nodes take the extra


class _Spawned:
    """A node's engines as `begin_node_engines` sees them: spawned at once, ready later."""

    def __init__(self, events: list[str], fail: str | None) -> None:
        self.events, self.fail = events, fail
        events.append("spawned")

    def wait_ready(self) -> None:
        self.events.append("waited")
        if self.fail:
            raise RuntimeError(self.fail)

    def shutdown(self) -> None:
        self.events.append("shut down")


@pytest.mark.parametrize("fail", [None, "rollout process ['python'] exited with 1"])
def test_engines_start_before_the_model_is_built_and_fail_as_one(tmp_path, monkeypatch, fail):
    """`begin_node_engines` spawns and returns (the trainer builds its model meanwhile), the
    job's ports stay reserved until `wait`, which waits for readiness; an engine that dies
    while starting is one error naming the node, its engines shut down, ports released."""
    from megatron_gspo.engines.client_config import ClientConfig
    from megatron_gspo.engines.launch import LaunchConfig
    from megatron_gspo.engines.nodes import begin_node_engines

    for k in ("GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    events: list[str] = []
    launch = LaunchConfig(backend="embedded", num_engines=2, base_port=0)
    pending = begin_node_engines(
        launch, ClientConfig(), tmp_path, launch_fn=lambda cfg: _Spawned(events, fail)
    )
    assert events == ["spawned"]  # not waited for yet
    ports = [int(u.rsplit(":", 1)[1]) for u in pending.local.engine_urls]
    assert not any(_exclusive_bind(p) for p in ports)  # still reserved for the engines
    if fail is None:
        launched = pending.wait()
        assert events == ["spawned", "waited"] and launched.urls == pending.local.engine_urls
    else:
        with pytest.raises(RuntimeError, match=r"engines did not start: node 0: RuntimeError: "):
            pending.wait()
        assert events == ["spawned", "waited", "shut down"]
    assert all(_exclusive_bind(p) for p in ports)  # released either way
