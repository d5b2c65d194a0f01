"""Start N rollout servers (SGLang or the embedded CPU engine) and optionally `sglang-router`.

Command lines are built from `LaunchConfig` (tested against SGLang's own argument parser),
each server runs in its own process group so shutdown reaches its children (SGLang forks a
scheduler and a detokenizer per server), and `wait_healthy` polls `/health_generate`, which
makes the server run a one-token generation, so "healthy" means "can generate".
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from megatron_gspo.config_io import port, positive, require
from megatron_gspo.engines.sglang_loader import LOADER
from megatron_gspo.run.stop import popen_from_lasting_thread


@dataclasses.dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """Rollout servers of one job; flags map 1:1 to `sglang.launch_server` options."""

    model_path: str = ""
    """HF checkpoint directory (the engine loads it once; later weights arrive by sync). Empty
    in a run config: model.hf_path."""
    num_engines: int = 1
    """Independent servers (data parallelism; each gets `gpus_per_engine` GPUs)."""
    backend: Literal["embedded", "sglang"] = "embedded"
    """`sglang` (the real server) or `embedded` (the CPU engine of this package)."""
    host: str = "127.0.0.1"
    """Address the engines bind to and are reached at."""
    base_port: int = 30000
    """Engine i listens on `base_port + i`; 0: the job picks free ports when it launches."""
    tp_size: int = 1
    """Tensor parallel size of each engine (`--tp-size`; GPUs per engine)."""
    ep_size: int = 1
    """Expert parallel size inside each engine (`--ep-size`)."""
    dp_size: int = 1
    """Data parallel replicas inside each engine (`--dp-size`; GPUs per engine: tp x dp).
    SGLang 0.5.23 refuses tensor and distributed weight updates unless it is 1, so with weight
    sync scale rollouts with num_engines instead."""
    base_gpu_id: int = 0
    """First GPU of engine 0 (`--base-gpu-id`); engine i starts at base_gpu_id + i x tp x dp.
    0 when colocated (the engines share the trainer's GPUs); on a node where the trainer holds
    GPUs 0..k-1 and the engines the rest, k."""
    dtype: str = "bfloat16"
    """Activation/weight dtype (`--dtype`)."""
    quantization: str | None = None
    """`fp8` for FP8 weights (`--quantization`); block-FP8 checkpoints are detected without it
    by SGLang. With backend=embedded, `fp8` makes the CPU engine emulate block-FP8 inference
    (engines/embedded/fp8_emulation.py) and needs weights.fp8=true; None: off."""
    kv_cache_dtype: str = "auto"
    """`--kv-cache-dtype` (auto, fp8_e4m3, fp8_e5m2, bf16, ...)."""
    fp32_lm_head: bool = True
    """`--enable-fp32-lm-head` (backend=sglang): the engine's logits, hence its log-probs (GSPO's
    pi_old), in fp32 instead of bf16. On by default because of the evidence study (issue 22,
    docs/evidence.md): once training sharpens the policy, rounding the logits to bf16 is ~80% of
    the engine/trainer mismatch (real SGLang server, step 60: 9.5e-3 -> 2.0e-3 per token), and
    with it 62% of 256-token sequences (75% of the study's 32-token ones) fall outside GSPO's band
    from mismatch alone, against none with fp32 logits. On CUDA SGLang computes it as the same
    bf16 GEMM with an fp32 output (no fp32 weight copy). false: SGLang's own bf16 logits. The
    embedded engine's logits are fp32 already; there it changes nothing."""
    mem_fraction_static: float | None = None
    """`--mem-fraction-static`: share of GPU memory for weights + KV cache (None: SGLang's)."""
    colocated: bool = False
    """Trainer shares the GPUs: adds `--enable-memory-saver` so memory can be released."""
    offload_trainer: bool = True
    """With colocated: the trainer's parameters, gradients and optimizer state move to host
    memory while the engines generate (megatron/offload.py)."""
    weights_cpu_backup: bool = False
    """`--enable-weights-cpu-backup`: keep weights across release/resume."""
    deterministic: bool = False
    """`--enable-deterministic-inference` (batch-invariant kernels, ~1.3x slower)."""
    weight_version: str = "default"
    """Version label the engines report before the first weight sync."""
    extra_args: list[str] = dataclasses.field(default_factory=list)
    """Further `sglang.launch_server` flags, passed through verbatim."""
    router: bool = False
    """Also start `sglang_router.launch_router` in front of the engines."""
    router_port: int = 29999
    """Port of the router (rollout.launch.router=true)."""
    router_metrics_port: int = 29000
    """Port of the router's Prometheus metrics (`--prometheus-port`; sglang-router binds it
    whether or not anything scrapes it, and a second router on the host with the same port
    fails to start). Each job on a node gets a free one from here on, like `router_port`."""
    router_policy: str = "round_robin"
    """sglang-router load-balancing policy."""
    max_restarts: int = 2
    """Restarts of each launched engine after it was dropped (killed, hung, failing); the
    restarted engine gets the current weights at the next weight sync before it generates
    again (`engines/pool.py`). 0: a dropped engine stays down."""
    startup_timeout_s: float = 900.0
    """How long to wait for every engine to answer /health_generate."""
    log_dir: str | None = None
    """Where each process writes `<name>.log`; None inherits the parent's stdout/stderr."""
    device: str | None = None
    """`--device` of the real server; `cpu` runs SGLang's torch-native CPU path (flags, env and
    the test-only `sgl_kernel` stand-in it needs: `cpu_engine_env`). None: SGLang's default."""
    python: str | None = None
    """Interpreter that runs the real server, e.g. the engine venv's `bin/python`
    (scripts/engine_env.sh: SGLang pins its own torch); None: this process's interpreter."""
    max_total_tokens: int | None = None
    """`--max-total-tokens` (KV cache size in tokens). On CPU None means 4096: SGLang would
    otherwise size the cache from free RAM (~15 GB for a tiny model)."""
    sleep_on_idle: bool | None = None
    """`--sleep-on-idle` (an idle scheduler sleeps instead of spinning a core); None: on for
    CPU, off otherwise."""
    api_key: str | None = None
    """`--api-key` of every engine (both backends): requests without `Authorization: Bearer
    <key>` get 401, weight pushes included (health probes stay open, as in SGLang). The job's
    client sends it (rollout.client.api_key, which it defaults)."""

    def __post_init__(self) -> None:
        c = "rollout.launch"
        positive(c, startup_timeout_s=self.startup_timeout_s,
                 max_total_tokens=self.max_total_tokens,
                 mem_fraction_static=self.mem_fraction_static)  # fmt: skip
        require(
            self.mem_fraction_static is None or self.mem_fraction_static <= 1,
            f"{c}.mem_fraction_static={self.mem_fraction_static} is a share of GPU memory: "
            f"in (0, 1]; change {c}.mem_fraction_static",
        )
        port(c, base_port=self.base_port, router_port=self.router_port,
             router_metrics_port=self.router_metrics_port)  # fmt: skip
        positive(c, router_port=self.router_port, router_metrics_port=self.router_metrics_port)
        require(
            self.backend in ("sglang", "embedded"),
            f"rollout.launch.backend={self.backend!r} must be sglang or embedded",
        )
        require(
            self.backend == "sglang" or self.quantization in (None, "fp8"),
            f"rollout.launch.quantization={self.quantization!r}: the embedded engine emulates "
            "fp8 only; set it to fp8 or null, or rollout.launch.backend=sglang",
        )
        require(
            self.num_engines >= 1,
            f"rollout.launch.num_engines={self.num_engines} must be >= 1",
        )
        for name in ("tp_size", "ep_size", "dp_size"):
            v = getattr(self, name)
            require(v >= 1, f"rollout.launch.{name}={v} must be >= 1")
        require(
            self.base_gpu_id >= 0, f"rollout.launch.base_gpu_id={self.base_gpu_id} must be >= 0"
        )
        require(
            self.max_restarts >= 0,
            f"rollout.launch.max_restarts={self.max_restarts} must be >= 0",
        )

    @property
    def gpus_per_engine(self) -> int:
        return self.tp_size * self.dp_size

    def engine_url(self, i: int) -> str:
        return f"http://{self.host}:{self.base_port + i}"

    @property
    def engine_urls(self) -> list[str]:
        return [self.engine_url(i) for i in range(self.num_engines)]

    @property
    def router_url(self) -> str | None:
        return f"http://{self.host}:{self.router_port}" if self.router else None


CPU_DEFAULT_MAX_TOTAL_TOKENS = 4096


def engine_gpu_ids(launch: LaunchConfig, per_node: list[int]) -> list[list[int]]:
    """Per engine of the job (node by node), the GPU of each TP rank on its node, as
    `engine_command` places them: engine i of a node at `base_gpu_id` + i x tp
    x dp, its ranks one GPU apart (SGLang's default `--gpu-id-step` 1)."""
    first = [launch.base_gpu_id + i * launch.gpus_per_engine for n in per_node for i in range(n)]
    return [[g + r for r in range(launch.tp_size)] for g in first]


def engine_command(
    cfg: LaunchConfig, i: int, python: str | None = None, *, our_loader: bool = True
) -> list[str]:
    """The command line of engine `i` (interpreter: `python`, else `cfg.python`, else ours).
    our_loader: SGLang gets our expert-slice loader (`--custom-weight-loader`); False where
    its interpreter cannot import this package (the planner probes it)."""
    python = python or (cfg.python if cfg.backend == "sglang" else None) or sys.executable
    port = str(cfg.base_port + i)
    if cfg.backend == "embedded":
        cmd = [python, "-m", "megatron_gspo.engines.embedded.cli"]
        cmd += ["--model-path", cfg.model_path]
        cmd += ["--port", port, "--weight-version", cfg.weight_version]
        if cfg.api_key:
            cmd += ["--api-key", cfg.api_key]
        if cfg.quantization:
            cmd += ["--quantization", cfg.quantization]
        return cmd + list(cfg.extra_args)
    cmd = [python, "-m", "sglang.launch_server", "--model-path", cfg.model_path]
    cmd += ["--host", cfg.host, "--port", port]
    # On CPU the "GPU id" is a NUMA node index (sglang/srt/utils/numa_utils.py): co-located
    # engines all use node 0 rather than asserting on nodes the machine lacks.
    base_id = 0 if cfg.device == "cpu" else cfg.base_gpu_id + i * cfg.gpus_per_engine
    cmd += ["--tp-size", str(cfg.tp_size), "--base-gpu-id", str(base_id)]
    if cfg.dp_size > 1:
        cmd += ["--dp-size", str(cfg.dp_size)]
    if cfg.device:
        cmd += ["--device", cfg.device]
    max_tokens = cfg.max_total_tokens
    if max_tokens is None and cfg.device == "cpu":
        max_tokens = CPU_DEFAULT_MAX_TOTAL_TOKENS
    if max_tokens is not None:
        cmd += ["--max-total-tokens", str(max_tokens)]
    if cfg.sleep_on_idle or (cfg.sleep_on_idle is None and cfg.device == "cpu"):
        cmd += ["--sleep-on-idle"]
    if cfg.ep_size > 1:
        cmd += ["--ep-size", str(cfg.ep_size)]
    cmd += ["--dtype", cfg.dtype, "--kv-cache-dtype", cfg.kv_cache_dtype]
    # Token ids in, token ids out: no tokenizer round trip that could change the ids.
    cmd += ["--skip-tokenizer-init", "--weight-version", cfg.weight_version]
    if cfg.quantization:
        cmd += ["--quantization", cfg.quantization]
    if cfg.fp32_lm_head:
        cmd += ["--enable-fp32-lm-head"]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.colocated:
        cmd += ["--enable-memory-saver"]
    if cfg.weights_cpu_backup:
        cmd += ["--enable-weights-cpu-backup"]
    if cfg.deterministic:
        cmd += ["--enable-deterministic-inference"]
    if cfg.api_key:
        cmd += ["--api-key", cfg.api_key]
    extra = list(cfg.extra_args)
    # Expert slices from several senders (`engines.sglang_loader`); only where the engine's
    # interpreter can import this package (the launcher puts it on PYTHONPATH).
    return cmd + (_with_our_loader(extra) if our_loader else extra)


def _with_our_loader(extra: list[str]) -> list[str]:
    """`extra` with our expert-slice loader (`engines.sglang_loader`) among SGLang's
    `--custom-weight-loader` paths: added to the user's own list when there is one (the flag
    takes several paths, and a second flag would replace the first)."""
    flag = "--custom-weight-loader"
    if flag not in extra:
        return [flag, LOADER, *extra]
    at = extra.index(flag) + 1
    return [*extra[:at], LOADER, *extra[at:]]


# What torchrun gives each trainer rank. The job launches engines from rank 0, and an engine
# (SGLang runs torch.distributed of its own, one process per TP rank) must not see the
# trainer's rank, world size or rendezvous as its own.
TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def server_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the trainer rank's torchrun variables (TORCHRUN_VARS, TORCHELASTIC_*)."""
    return {
        k: v for k, v in env.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC")
    }


def cpu_engine_env(env: dict[str, str], tp_size: int = 1) -> dict[str, str]:
    """`env` for a real SGLang server on CPU: its CPU engine switched on and our test-only
    `sgl_kernel` stand-in first on PYTHONPATH (see megatron_gspo/engines/sgl_kernel_cpu);
    with `tp_size` > 1, what SGLang 0.5.23 needs to start its ranks (`cpu_tp_env`)."""
    from megatron_gspo.engines.sgl_kernel_cpu import STUB_DIR

    out = dict(env)
    out["SGLANG_USE_CPU_ENGINE"] = "1"
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUB_DIR), env.get("PYTHONPATH")) if p)
    return cpu_tp_env(out, tp_size) if tp_size > 1 else out


def cpu_tp_env(env: dict[str, str], tp_size: int) -> dict[str, str]:
    """`env` for a real SGLang 0.5.23 server on CPU with `--tp-size` > 1 (measured: without
    these it does not start on a 1-NUMA-node host with PyPI's CUDA build of torch); values
    already in `env` are kept:

    - `SGLANG_CPU_OMP_THREADS_BIND`: SGLang asserts TP ranks <= NUMA nodes unless each rank's
      cores are given (`srt/utils/numa_utils.py` `init_threads_binding`); this host's cores
      are split into `tp_size` contiguous groups (shared round-robin when fewer cores).
    - `SGLANG_NCCL_SO_PATH` pointing nowhere: the engine venv's torch is the CUDA build, so
      SGLang finds `libnccl.so.2` and builds a `PyNcclCommunicator` for the TP group, which
      asks `torch.cuda.device(cpu)` ("Expected a cuda device"); without the library it is
      disabled (`available = False`), as on a CPU build of torch, and the TP all-reduces run
      on the gloo group.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= tp_size:
        per = len(cores) // tp_size
        groups = [cores[r * per : (r + 1) * per] for r in range(tp_size)]
    else:
        groups = [[cores[r % len(cores)]] for r in range(tp_size)]
    out = dict(env)
    out.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, g)) for g in groups))
    out.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
    return out


def router_command(
    cfg: LaunchConfig,
    python: str = sys.executable,
    worker_urls: Sequence[str] | None = None,
) -> list[str]:
    """The `sglang-router` command line (round robin over the engines by default)."""
    return [
        python,
        "-m",
        "sglang_router.launch_router",
        "--host",
        cfg.host,
        "--port",
        str(cfg.router_port),
        "--prometheus-port",
        str(cfg.router_metrics_port),
        "--policy",
        cfg.router_policy,
        "--worker-urls",
        *(worker_urls or cfg.engine_urls),
    ]


def _get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


class ServerGroup:
    """The processes of one `LaunchConfig`; a context manager that always shuts them down."""

    def __init__(self, cfg: LaunchConfig, *, env: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.env = env
        self.engines: list[subprocess.Popen] = []
        self.router: subprocess.Popen | None = None
        self._logs: list = []
        self.restarts: dict[int, int] = {}
        """Restarts per engine index."""

    def _spawn(self, cmd: list[str], name: str, *, cpu_engine: bool = False) -> subprocess.Popen:
        env = server_env(os.environ if self.env is None else self.env)
        # The embedded engine must import this package even from an uninstalled checkout.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if cpu_engine:
            env = cpu_engine_env(env, self.cfg.tp_size)
        out = None
        if self.cfg.log_dir:
            Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(self.cfg.log_dir) / f"{name}.log", "ab")  # noqa: SIM115
            self._logs.append(out)
        return spawn_dying_with_us(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # own process group: killpg reaches forked children
        )  # fmt: skip

    def _spawn_engine(self, i: int) -> subprocess.Popen:
        cpu = self.cfg.backend == "sglang" and self.cfg.device == "cpu"
        return self._spawn(engine_command(self.cfg, i), f"engine{i}", cpu_engine=cpu)

    def start(self, *, wait: bool = True) -> ServerGroup:
        """Spawn the engines; by default wait until they can generate (`wait_ready`: the
        router, when configured, starts then). `wait=False` returns at once, so the caller can
        build its model while the engines import and load theirs; call `wait_ready` after."""
        for i in range(self.cfg.num_engines):
            self.engines.append(self._spawn_engine(i))
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Wait until every engine can generate, then start the router (when configured) in
        front of them and wait until it sees them all healthy."""
        self.wait_healthy(self.cfg.engine_urls)
        if self.cfg.router and self.router is None:
            self.start_router(wait=True)

    def start_router(self, worker_urls: Sequence[str] | None = None, *, wait: bool = True) -> str:
        """Spawn `sglang-router` in front of `worker_urls` (default: this group's engines)."""
        workers = list(worker_urls or self.cfg.engine_urls)
        self.router = self._spawn(router_command(self.cfg, worker_urls=workers), "router")
        url = f"http://{self.cfg.host}:{self.cfg.router_port}"
        if wait:
            self.wait_healthy([url], route="/health")
            self._wait_router_workers(url, len(workers))
        return url

    def _wait_router_workers(self, url: str, count: int, timeout_s: float = 60.0) -> None:
        # The router answers /health before it has probed its workers; until then every
        # /generate is a 503 "no available workers".
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/workers", timeout=5) as resp:
                    workers = json.loads(resp.read()).get("workers", [])
                if len(workers) >= count and all(w.get("is_healthy") for w in workers):
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"router {url} did not report {count} healthy workers")

    def wait_healthy(
        self,
        urls: Sequence[str],
        *,
        route: str = "/health_generate",
        timeout_s: float | None = None,
    ) -> None:
        """Poll until every URL answers 200, failing fast if a process died."""
        deadline = time.monotonic() + (timeout_s or self.cfg.startup_timeout_s)
        pending = list(urls)
        while pending:
            for p in [*self.engines, *([self.router] if self.router else [])]:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"rollout process {p.args[:4]} exited with {p.returncode}"  # type: ignore[index,str-bytes-safe]
                        + self._log_tail(p)
                    )
            pending = [u for u in pending if _get(u + route, timeout=30) != 200]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout servers not healthy: {pending}")
            time.sleep(0.5)

    def _log_tail(self, p: subprocess.Popen, lines: int = 15) -> str:
        """The last lines of `p`'s log (why it died: a taken port, a bad checkpoint), or ''."""
        if not self.cfg.log_dir:
            return ""
        name = "router" if p is self.router else f"engine{self.engines.index(p)}"
        path = Path(self.cfg.log_dir) / f"{name}.log"
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"; the end of {path}:\n" + "\n".join(tail)

    def kill_engine(self, i: int) -> None:
        """SIGKILL engine `i` and its children (tests: an engine dying mid-batch)."""
        _killpg(self.engines[i], signal.SIGKILL)

    def restart_engine(self, url: str, reason: str) -> bool:
        """Kill what is left of the engine at `url` (a hung one too) and start it again,
        without waiting for it: it joins a weight sync once it answers (`EnginePool`). False
        when it is not ours or has used up `max_restarts`. Fits `EnginePool.restart`."""
        urls = self.cfg.engine_urls
        if url not in urls:
            return False
        i = urls.index(url)
        done = self.restarts.get(i, 0)
        if done >= self.cfg.max_restarts:
            print(
                f"[rollout] engine {url} not restarted: rollout.launch.max_restarts="
                f"{self.cfg.max_restarts} used up",
                file=sys.stderr,
                flush=True,
            )
            return False
        _killpg(self.engines[i], signal.SIGKILL)
        self.engines[i].wait()
        self.engines[i] = self._spawn_engine(i)
        self.restarts[i] = done + 1
        print(
            f"[rollout] engine {url} restarting ({done + 1} of rollout.launch.max_restarts="
            f"{self.cfg.max_restarts}) after: {reason}",
            file=sys.stderr,
            flush=True,
        )
        return True

    def shutdown(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every process group, then SIGKILL what is left; leaves no orphans."""
        procs = [*([self.router] if self.router else []), *self.engines]
        for p in procs:
            _killpg(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _killpg(p, signal.SIGKILL)
            p.wait()
        for f in self._logs:
            f.close()

    def __enter__(self) -> ServerGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def spawn_dying_with_us(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **popen)` of a process that gets SIGTERM when this process dies
    (Linux), forked from a thread that outlives every caller (`stop.popen_from_lasting_thread`)."""
    return popen_from_lasting_thread(cmd, preexec_fn=_die_with_parent, **popen)


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the process that launched it dies, even by SIGKILL,
    so a crashed trainer never leaves engines holding ports and memory."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _killpg(p: subprocess.Popen, sig: int) -> None:
    # The process group may hold children even after the leader exited, so signal the group.
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch(
    cfg: LaunchConfig, *, env: dict[str, str] | None = None, wait: bool = True
) -> ServerGroup:
    """Start the servers of `cfg`; by default wait until they can generate (else the caller
    calls `ServerGroup.wait_ready`)."""
    return ServerGroup(cfg, env=env).start(wait=wait)
