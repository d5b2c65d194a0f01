"""Weight sync to TP=2 engines on two "hosts": the trainer's client and transports against SGLang's
own request parsing and scheduler-side weight code (tests/weights/tp_engine.py), over gloo.

Host B is a network namespace joined to this one by a veth pair: its processes cannot reach this
host's 127.0.0.1, only its veth address, exactly like an engine on another node. Engine A (TP 2)
runs here, engine B (TP 2) in the namespace; each TP rank is its own process.

* distributed: one group of 1 + 2 + 2 ranks, engine A's ranks at 1-2 and B's at 3-4 (SGLang's
  `rank_offset + tp_rank`), rendezvous at the default `weights.master_address` (the address that
  routes to B); every rank of both engines holds every tensor bitwise. The old default,
  127.0.0.1, is shown to fail (host B cannot join).
* tensor (same node): a TP 2 engine gets one payload per rank and both ranks decode their own;
  a client that thinks the engine has TP 1 sends one payload, and rank 1 fails.

Needs root (network namespaces); skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.dist import free_port
from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.protocols import EngineError
from megatron_gspo.engines.wire import tensor_checksum
from megatron_gspo.weights import fp8
from megatron_gspo.weights.stream import Bucket
from megatron_gspo.weights.sync import WeightSync, WeightSyncConfig
from megatron_gspo.weights.transports import DistributedTransport, TensorTransport

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # two-host groups: ~10-20 s each

ROOT = Path(__file__).resolve().parents[2]
JOIN_TIMEOUT_S = 15.0


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def host_b():
    """A network namespace ("host B") with a veth link: (ns, our address, its address, ifaces)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    tag = os.getpid() % 100000
    ns, va, vb = f"mgspo{tag}", f"mgva{tag}", f"mgvb{tag}"
    net = f"10.213.{tag % 250}"
    try:
        _sh("ip", "netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace: {e.stderr.decode().strip()}")
    try:
        _sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb, "netns", ns)
        _sh("ip", "addr", "add", f"{net}.1/30", "dev", va)
        _sh("ip", "link", "set", va, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{net}.2/30", "dev", vb)
        _sh("ip", "-n", ns, "link", "set", vb, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "route", "add", "default", "via", f"{net}.1")
        yield ns, f"{net}.1", f"{net}.2", va, vb
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", va], capture_output=True)


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/model_info", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not up:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def engines(host_b, tmp_path_factory: pytest.TempPathFactory):
    """Engine A (TP 2) here and engine B (TP 2) on host B; yields their URLs."""
    ns, addr_a, addr_b, va, vb = host_b
    root = tmp_path_factory.mktemp("tp_engines")
    model = str(save_tiny_hf_checkpoint(root / "hf", seed=0))
    port_a, port_b = free_port(), free_port()
    specs = [
        ([], "127.0.0.1", port_a, va),
        (["ip", "netns", "exec", ns], addr_b, port_b, vb),
    ]
    procs, urls = [], []
    for i, (prefix, host, port, iface) in enumerate(specs):
        env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME=iface)
        cmd = [*prefix, sys.executable, "-m", "tests.weights.tp_engine", "--model-path", model]
        cmd += ["--host", host, "--port", str(port), "--tp-size", "2"]
        cmd += ["--join-timeout-s", str(JOIN_TIMEOUT_S)]
        log = root / f"engine{i}.log"
        out = log.open("wb")
        # Own session: the engine and its forked rank processes go down together (killpg).
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        procs.append((proc, log))
        urls.append(f"http://{host}:{port}")
    try:
        for url, (proc, log) in zip(urls, procs, strict=True):
            _wait(url, proc, log)
        yield urls
    finally:
        for proc, _ in procs:  # nothing to flush: no graceful shutdown to wait for
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _buckets() -> list[Bucket]:
    """Two buckets in the dtypes sync sends: fp32 scales, bf16 weights, e4m3 FP8 weights."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(160, 96, generator=g)
    q, s = fp8.quantise_blockwise(w)
    b1, b2 = Bucket(index=0), Bucket(index=1)
    b1.add("model.layers.0.self_attn.o_proj.weight_scale_inv", s)
    b1.add("model.norm.weight", torch.randn(64, generator=g).to(torch.bfloat16))
    b1.add("model.layers.0.self_attn.o_proj.weight", q)
    b2.add("lm_head.weight", torch.randn(128, 64, generator=g).to(torch.bfloat16))
    return [b1, b2]


def _sent(buckets: list[Bucket]) -> dict[str, str]:
    return {n: tensor_checksum(t) for b in buckets for n, t in b.tensors}


def _push(transport, buckets: list[Bucket], version: str) -> None:
    transport.begin(version)
    for i, b in enumerate(buckets):
        transport.send(b, version=version, last=i == len(buckets) - 1)
    transport.finish(version)


def _ranks(client: SGLangClient) -> dict[str, list[dict]]:
    return {url: info["ranks"] for url, info in client.weights_checksum().items()}


def test_distributed_two_hosts_tp2(engines, host_b) -> None:
    _, addr_a, *_ = host_b
    client = SGLangClient(ClientConfig(engine_urls=engines, engine_tp_sizes=[2, 2]))
    sync = WeightSync(None, client, WeightSyncConfig(transport="distributed", backend="gloo"))
    transport = sync.transport
    assert isinstance(transport, DistributedTransport)
    # The default rendezvous address is the one host B routes to, not loopback.
    assert transport.master_address == addr_a
    buckets = _buckets()
    transport.setup()
    try:
        _push(transport, buckets, "7")
        ranks = _ranks(client)
    finally:
        transport.close()
        client.close()
    expected = _sent(buckets)
    group = {url: [r["group"] for r in rs] for url, rs in ranks.items()}
    assert group == {
        engines[0]: [{"rank": 1, "size": 5}, {"rank": 2, "size": 5}],
        engines[1]: [{"rank": 3, "size": 5}, {"rank": 4, "size": 5}],
    }
    for url, rs in ranks.items():
        assert [r["tp_rank"] for r in rs] == [0, 1]
        for r in rs:
            assert r["checksums"] == expected, (url, r["tp_rank"])
    assert set(SGLangClient(ClientConfig(engine_urls=engines)).weight_version().values()) == {"7"}


def test_tensor_tp2_one_payload_per_rank(engines) -> None:
    client = SGLangClient(ClientConfig(engine_urls=engines[:1], engine_tp_sizes=[2]))
    buckets = _buckets()[::-1]  # other contents than the distributed test left behind
    buckets[0].tensors[0] = ("lm_head.weight", buckets[0].tensors[0][1] * 2)
    try:
        _push(TensorTransport([client]), buckets, "8")
        (ranks,) = _ranks(client).values()
    finally:
        client.close()
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["checksums"] == _sent(buckets), r["tp_rank"]
    # The check can fail: a client told TP 1 sends one payload; rank 1 has none to decode.
    wrong = SGLangClient(ClientConfig(engine_urls=engines[:1], engine_tp_sizes=[1]))
    try:
        wrong.begin_weight_update()
        with pytest.raises(EngineError, match="rank 1: IndexError"):
            wrong.update_weights_from_tensor(buckets[0].tensors)
    finally:
        wrong.end_weight_update()
        wrong.close()


def test_loopback_rendezvous_fails_for_the_other_host(engines) -> None:
    """The old default (127.0.0.1) cannot work: host B's ranks dial their own loopback."""
    client = SGLangClient(ClientConfig(engine_urls=engines, engine_tp_sizes=[2, 2]))
    cfg = WeightSyncConfig(
        transport="distributed", backend="gloo", master_address="127.0.0.1", timeout_s=2
    )
    sync = WeightSync(None, client, cfg)
    try:
        with pytest.raises(RuntimeError, match="did not form"):
            sync.transport.setup()
    finally:
        client.close()
