"""Launch helpers: command lines checked by SGLang's and the router's own parsers; a
subprocess engine that dies mid-batch loses and duplicates no sample; no orphans."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from megatron_gspo.dist import free_port
from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.launch import LaunchConfig, ServerGroup, engine_command, router_command
from megatron_gspo.engines.types import SamplingParams

pytestmark = pytest.mark.timeout(300)  # a hung server must fail, not stall CI


def test_sglang_command_lines_parse_with_sglang(tmp_path):
    from sglang.srt.server_args import prepare_server_args

    cfg = LaunchConfig(
        model_path=str(tmp_path),
        backend="sglang",
        num_engines=2,
        base_port=31000,
        tp_size=4,
        ep_size=4,
        quantization="fp8",
        kv_cache_dtype="fp8_e4m3",
        mem_fraction_static=0.6,
        colocated=True,
        weights_cpu_backup=True,
        deterministic=True,
        fp32_lm_head=False,
        weight_version="step-0",
    )
    cmd = engine_command(cfg, 1, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    args = prepare_server_args(cmd[3:])
    assert (args.port, args.host, args.tp_size, args.ep_size) == (31001, "127.0.0.1", 4, 4)
    assert args.base_gpu_id == 4 and args.kv_cache_dtype == "fp8_e4m3"
    assert args.enable_memory_saver and args.enable_weights_cpu_backup
    assert args.enable_deterministic_inference and args.skip_tokenizer_init
    assert not args.enable_fp32_lm_head  # SGLang's bf16 logits, when asked for
    assert (args.dtype, args.quantization, args.weight_version) == ("bfloat16", "fp8", "step-0")
    sglang = LaunchConfig(model_path="m", backend="sglang")
    plain = prepare_server_args(engine_command(sglang, 0)[3:])
    assert not plain.enable_memory_saver and not plain.enable_deterministic_inference
    assert plain.enable_fp32_lm_head  # the default: fp32 logits (docs/evidence.md)


def test_router_command_parses_with_the_router():
    from sglang_router.launch_router import parse_router_args

    cfg = LaunchConfig(
        model_path="m", backend="sglang", num_engines=2, base_port=32000, router=True
    )
    cmd = router_command(cfg, python="python")
    assert cmd[:3] == ["python", "-m", "sglang_router.launch_router"]
    args = parse_router_args(cmd[3:])
    assert args.worker_urls == ["http://127.0.0.1:32000", "http://127.0.0.1:32001"]
    assert args.policy == "round_robin" and args.host == "127.0.0.1"
    # its metrics port is ours to plan (sglang-router's default is one fixed port per host)
    assert args.prometheus_port == cfg.router_metrics_port == 29000


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def subprocess_engine(ckpt_a, tmp_path_factory):
    """One embedded engine in its own process, started by `ServerGroup` (killed by a test)."""
    cfg = LaunchConfig(
        model_path=ckpt_a,
        backend="embedded",
        base_port=free_port(),
        startup_timeout_s=240,
        log_dir=str(tmp_path_factory.mktemp("engine_logs")),
    )
    group = ServerGroup(cfg)
    try:
        group.start()
        yield group
    finally:
        group.shutdown()
    for p in group.engines:
        assert p.poll() is not None and not _alive(p.pid), "orphan engine process"


def test_tensor_push_crosses_processes(subprocess_engine, ckpt_a, weights_b):
    """CPU tensors reach an engine in another process (shared memory, `file_system`)."""
    from megatron_gspo.engines.wire import tensor_checksum

    client = SGLangClient(ClientConfig(engine_urls=subprocess_engine.cfg.engine_urls))
    with client.weight_update_session(weight_version="xproc-1"):
        client.update_weights_from_tensor(sorted(weights_b.items()))
    (info,) = client.weights_checksum().values()
    sums = info["ranks"][0]["checksums"]
    assert sums["lm_head.weight"] == tensor_checksum(weights_b["lm_head.weight"])
    assert set(client.weight_version().values()) == {"xproc-1"}
    client.update_weights_from_disk(ckpt_a, weight_version="default")


def test_engine_killed_mid_batch_loses_and_duplicates_nothing(subprocess_engine, engine_a):
    group, cfg = subprocess_engine, subprocess_engine.cfg
    victim = group.engines[0]
    client = SGLangClient(
        ClientConfig(
            engine_urls=[cfg.engine_url(0), engine_a.url],
            max_batch_per_request=2,
            max_inflight_per_engine=2,
            backoff_s=0.05,
            engine_cooldown_s=60.0,
        )
    )
    assert client.health() == {cfg.engine_url(0): True, engine_a.url: True}
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True, seed=5)
    prompts = [[1, 10 + i] for i in range(12)]
    out: dict = {}
    worker = threading.Thread(
        target=lambda: out.update(res=client.generate(prompts, sp, n=2)), daemon=True
    )
    worker.start()
    # Kill once the victim has a request in flight (the client registers each request as
    # running just before it sends it), so that at least that one is lost with the engine:
    # whatever the load on the machine, not after the victim has served its share.
    deadline = time.monotonic() + 120
    while cfg.engine_url(0) not in tuple(client.lineage.running.values()):
        assert time.monotonic() < deadline and worker.is_alive(), "no request reached engine 0"
        time.sleep(0.002)
    group.kill_engine(0)
    worker.join(timeout=180)
    assert not worker.is_alive()
    res = out["res"]
    keys = [s.key for s in res.samples]
    assert keys == [(i, j) for i in range(12) for j in range(2)]  # none lost, none twice
    assert res.stats.num_retries >= 1
    assert all(len(s.response_ids) == 24 for s in res.samples)
    # A retried sample is the same sample: seeds are per (prompt, sample), not per engine.
    again = client.generate(prompts[:1], sp, n=2)
    assert [s.response_ids for s in again.samples] == [s.response_ids for s in res.samples[:2]]
    victim.wait(timeout=10)
    assert not _alive(victim.pid)


def test_dp_and_gpu_placement_parse_with_sglang():
    """`dp_size` lands as `--dp-size`; engine i starts at base_gpu_id + i * tp * dp, so engines
    tile the node's GPUs without overlap (colocated: from 0, the trainer's GPUs; dedicated:
    after the trainer's)."""
    from sglang.srt.server_args import prepare_server_args

    cfg = LaunchConfig(
        model_path="m", backend="sglang", num_engines=3, tp_size=2, dp_size=2, base_gpu_id=4
    )
    assert cfg.gpus_per_engine == 4
    parsed = [prepare_server_args(engine_command(cfg, i, python="python")[3:]) for i in range(3)]
    assert [a.base_gpu_id for a in parsed] == [4, 8, 12]
    assert {(a.tp_size, a.dp_size) for a in parsed} == {(2, 2)}
    plain = prepare_server_args(
        engine_command(LaunchConfig(model_path="m", backend="sglang"), 0)[3:]
    )
    assert (plain.dp_size, plain.base_gpu_id) == (1, 0)
    # On CPU the id is a NUMA node: every engine stays on node 0 whatever base_gpu_id says.
    cpu = LaunchConfig(model_path="m", backend="sglang", device="cpu", base_gpu_id=3)
    cmd = engine_command(cpu, 1)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "0"


def test_engines_do_not_inherit_the_trainer_ranks_rendezvous(tmp_path, monkeypatch):
    """An engine launched from torchrun's rank 0 starts without RANK/WORLD_SIZE/MASTER_* (and
    TORCHELASTIC_*): SGLang's own process group must not take the trainer's for its own."""
    from megatron_gspo.engines.launch import TORCHRUN_VARS

    for k in TORCHRUN_VARS:
        monkeypatch.setenv(k, "7")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("MGSPO_KEEP_ME", "1")
    out = tmp_path / "env.json"
    cfg = LaunchConfig(model_path="m", backend="embedded", log_dir=str(tmp_path))
    group = ServerGroup(cfg)
    dump = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    group._spawn([sys.executable, "-c", dump], "envdump").wait(timeout=60)
    group.shutdown()
    env = json.loads(out.read_text())
    assert env["MGSPO_KEEP_ME"] == "1"
    assert not [k for k in env if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC")]


@pytest.mark.parametrize(
    "bad",
    [
        dict(backend="vllm"),
        dict(num_engines=0),
        dict(dp_size=0),
        dict(tp_size=0),
        dict(base_gpu_id=-1),
    ],
)
def test_launch_config_validates(bad):
    with pytest.raises(ValueError):
        LaunchConfig(model_path="m", **bad)


def test_a_server_started_from_a_passing_thread_outlives_that_thread():
    """PR_SET_PDEATHSIG follows the forking THREAD: a server spawned on behalf of a short-lived
    thread (an engine restart from a rollout worker) must live on after that thread ends, and
    still die with this process."""
    import subprocess

    from megatron_gspo.engines.launch import spawn_dying_with_us

    box: list[subprocess.Popen] = []
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    t = threading.Thread(target=lambda: box.append(spawn_dying_with_us(cmd)))
    t.start()
    t.join()
    (proc,) = box
    try:
        time.sleep(1.0)  # a SIGTERM at the thread's exit would have ended it by now
        assert proc.poll() is None, f"the server died with its thread (exit {proc.returncode})"
    finally:
        proc.kill()
        proc.wait()


def test_an_engine_that_dies_at_startup_says_why(tmp_path):
    """The error carries the end of the engine's log: CI once saw only 'exited with 3'
    (uvicorn's bind failure) and could not tell a taken port from a bad checkpoint."""
    import subprocess

    cfg = LaunchConfig(model_path=str(tmp_path), backend="embedded", log_dir=str(tmp_path))
    g = ServerGroup(cfg)
    script = "import sys; print('one'); print('[Errno 98] address already in use'); sys.exit(3)"
    with open(tmp_path / "engine0.log", "wb") as log:
        g.engines.append(subprocess.Popen([sys.executable, "-c", script], stdout=log))
    g.engines[0].wait()
    with pytest.raises(RuntimeError) as e:
        g.wait_healthy(cfg.engine_urls, timeout_s=5)
    msg = str(e.value)
    assert "exited with 3" in msg and msg.endswith("[Errno 98] address already in use")
    assert str(tmp_path / "engine0.log") in msg
