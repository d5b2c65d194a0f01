"""Launch planner: does this config fit N nodes x G GPUs of M GB, before anything is allocated?

    python -m megatron_gspo.plan --config FILE --nodes N --gpus-per-node G --gpu-mem-gb M \
        [--rollout-nodes R] [--hf-config DIR] [--json OUT] [--emit-launch DIR --hosts h1,h2,..]

1. The layout is checked by `Layout.validate` (the trainer's own check: world size, experts per
   EP rank, heads per TP rank, layers per stage) plus the engine layout; an invalid case exits 2
   with a message naming the config key to change.
2. Parameters per rank come from megatron-core itself: the model of each pipeline stage is built
   on the `meta` device (no memory) inside a fake process group of the real world size, through
   the same megatron-bridge provider as the trainer (`megatron/model.make_provider`).
3. Per-GPU memory is estimated from those counts with the formula printed under the table
   (`memory_formula()`), and the weight-sync bytes per step at a stated bandwidth.
   Steps 2-3's counting and arithmetic live in `plan/memory.py`; this module checks, decides and
   prints.

Exit codes: 0 fits, 1 does not fit (the verdict says what), 2 invalid config or layout, a
topology refusal (`megatron_gspo.plan.topology`: printed as `topology: REFUSED: ...`), or, with
`--emit-launch`, a launch refusal (`plan/launch.py`: weights missing, an engine interpreter
without SGLang, no interpreter with the router, driver vs CUDA build, NCCL versions);
PLAN_FORCE overrides neither, and no launch files are written.
`--emit-launch DIR` also writes what the Slurm scripts start (NUL-separated argv files for each
engine and the router, the trainer's `--set` overrides), so SGLang flags have one source:
`engines.launch.engine_command`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_gspo.config import Config, ConfigError, load_config
from megatron_gspo.config_io import require
from megatron_gspo.engines.launch import (
    LaunchConfig,
    engine_command,
    engine_gpu_ids,
    router_command,
)
from megatron_gspo.engines.sglang_rules import (
    DEFAULT_MEM_FRACTION,
    check_engine_layout,
    default_launch,
    serves_sglang,
)
from megatron_gspo.layout import HFConfig, HFConfigLike, Layout
from megatron_gspo.plan.launch import launch_check
from megatron_gspo.plan.memory import (
    RELEASED_ENGINE_GB,
    EngineEstimate,
    GiB,
    MemoryEstimate,
    StageParams,
    _micro_batches,
    cached_count_params,
    count_params,
    engine_estimate,
    memory_formula,
    sync_estimate,
    trainer_memory,
)
from megatron_gspo.plan.topology import Placement, topology_problems

__all__ = [
    "GiB",
    "MemoryEstimate",
    "Plan",
    "StageParams",
    "count_params",
    "make_plan",
    "memory_formula",
    "main",
]


@dataclass
class Plan:
    """Everything the planner decided; `to_json()` is what `--json` writes."""

    nodes: int
    gpus_per_node: int
    gpu_mem_gb: float
    rollout_nodes: int
    trainer_world: int
    layout: dict[str, Any]
    dp: int
    expert_dp: int
    stages: list[StageParams]
    total_params: int
    memory: MemoryEstimate
    micro_batches: int
    in_flight: float
    engine: dict[str, Any]
    sync: dict[str, float]
    problems: list[str] = field(default_factory=list)
    topology: list[str] = field(default_factory=list)
    """Topology refusals (`megatron_gspo.plan.topology`): the job cannot start as configured."""

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stages"] = [dict(dataclasses.asdict(s), dense=s.dense) for s in self.stages]
        m = self.memory
        d["memory_gb"] = {
            k: v / GiB
            for k, v in dict(
                dataclasses.asdict(m),
                trainer_static=m.trainer_static,
                train_peak=m.train_peak,
                rollout_peak=m.rollout_peak,
            ).items()
        }
        del d["memory"]
        d["fits"] = self.fits
        return d


# ---------------------------------------------------------------------------------------------
# the plan


def _hf_config(path: str | Path) -> HFConfig:
    """config.json as attributes (plain JSON: the checks and formulas need no transformers)."""
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot read config.json from model.hf_path={path} ({e}); set model.hf_path or "
            "pass --hf-config DIR"
        ) from None
    data.setdefault("tie_word_embeddings", False)
    return types.SimpleNamespace(**data)


def make_plan(
    cfg: Config,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_mem_gb: float,
    rollout_nodes: int = 0,
    hf_dir: str | Path | None = None,
    engines_external: bool = False,
    counts_cache: str | Path | None = None,
    sync_gb_per_s: float = 25.0,
    prompt_tokens: int | None = None,
    moe_imbalance: float = 1.0,
    check_ports: bool = False,
) -> Plan:
    """Check `cfg` on `nodes` x `gpus_per_node` GPUs and estimate memory; ConfigError if the
    layout is invalid (the message names the key)."""
    require(nodes >= 1 and gpus_per_node >= 1, "--nodes and --gpus-per-node must be >= 1")
    require(
        0 <= rollout_nodes < nodes,
        f"--rollout-nodes={rollout_nodes} must leave at least one of --nodes={nodes} to train",
    )
    # the layout on the trainer's GPUs, checked as the trainer checks it
    hf_dir = hf_dir or cfg.model.hf_path
    hf = _hf_config(hf_dir)
    layout = cfg.parallel
    world = (nodes - rollout_nodes) * gpus_per_node
    dp = layout.validate(world, hf)
    edp = world // (layout.expert_tp * layout.ep * layout.pp)
    launch = cfg.rollout.launch or default_launch()
    if cfg.rollout.launch is not None:
        check_engine_layout(launch, hf, gpus_per_node)
    # the estimates: the most loaded trainer stage, the engines, one weight sync
    stages = cached_count_params(hf_dir, layout, world, counts_cache)
    mem_bytes = gpu_mem_gb * GiB
    colocated = rollout_nodes == 0 and launch.colocated
    prompt = prompt_tokens or cfg.data.max_prompt_tokens or 1024
    mbs = _micro_batches(cfg, dp, prompt)
    engine_train, engine_rollout = _colocated_engine_bytes(
        launch, mem_bytes, colocated=colocated, engines_external=engines_external
    )
    worst, in_flight = trainer_memory(
        cfg, hf, stages, dp=dp, expert_dp=edp, micro_batches=mbs, moe_imbalance=moe_imbalance,
        engine_train=engine_train, engine_rollout=engine_rollout,
    )  # fmt: skip
    engine = engine_estimate(
        cfg, hf, launch, engine_gpus=(rollout_nodes or nodes) * gpus_per_node,
        gpu_mem_bytes=mem_bytes, prompt_tokens=prompt, colocated=colocated,
    )  # fmt: skip
    # the verdicts: memory, then what the cluster would refuse
    problems = _memory_problems(worst, engine, gpu_mem_gb, launch.tp_size, colocated=colocated)
    # the transport the job runs with: the launch files switch separate nodes to distributed
    job_cfg = copy.deepcopy(cfg)
    if rollout_nodes:
        job_cfg.weights.transport = "distributed"
    return Plan(
        topology=plan_topology(
            job_cfg, launch, hf, nodes, gpus_per_node, rollout_nodes, check_ports=check_ports
        ),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu_mem_gb=gpu_mem_gb,
        rollout_nodes=rollout_nodes,
        trainer_world=world,
        layout=layout.to_dict(),
        dp=dp,
        expert_dp=edp,
        stages=stages,
        total_params=engine.params,
        memory=worst,
        micro_batches=mbs,
        in_flight=in_flight,
        engine=engine.table,
        sync=sync_estimate(
            cfg, hf, sync_gb_per_s, gpus_per_node=gpus_per_node, trainer_world=world
        ),
        problems=problems,
    )


def _colocated_engine_bytes(
    launch: LaunchConfig, mem_bytes: float, *, colocated: bool, engines_external: bool
) -> tuple[float, float]:
    """Bytes a colocated engine holds on a trainer GPU (while training, while rolling out):
    its `mem_fraction_static` share during rollouts; during training what a released engine
    keeps, or all of it for engines the trainer cannot release (`--engines-external`)."""
    if not colocated:
        return 0.0, 0.0
    rollout = (launch.mem_fraction_static or DEFAULT_MEM_FRACTION) * mem_bytes
    return (rollout if engines_external else RELEASED_ENGINE_GB * GiB), rollout


def _memory_problems(
    worst: MemoryEstimate,
    engine: EngineEstimate,
    gpu_mem_gb: float,
    tp_size: int,
    *,
    colocated: bool,
) -> list[str]:
    """One line per memory that does not fit a GPU, each naming the keys to change."""
    mem_bytes = gpu_mem_gb * GiB
    frac = engine.table["mem_fraction_static"]
    problems = []
    if worst.train_peak > mem_bytes:
        problems.append(
            f"trainer needs {worst.train_peak / GiB:.1f} GiB per GPU while training "
            f"> {gpu_mem_gb:g}; raise parallel.ep/pp/tp, set model.activation_recompute=full or "
            "lower train.micro_batch_tokens"
        )
    if colocated and worst.rollout_peak > mem_bytes:
        problems.append(
            f"colocated rollout needs {worst.rollout_peak / GiB:.1f} GiB per GPU (trainer state "
            f"{worst.trainer_static / GiB:.1f} + engine {worst.engine_rollout / GiB:.1f} + push "
            f"buffers {worst.send_buffers / GiB:.1f}) > {gpu_mem_gb:g}; lower "
            "rollout.launch.mem_fraction_static or weights.bucket_mb, or use rollout nodes"
        )
    if engine.weights_per_gpu >= frac * mem_bytes:
        problems.append(
            f"engine weights {engine.weights_per_gpu / GiB:.1f} GiB per GPU do not fit "
            f"rollout.launch.mem_fraction_static={frac} of {gpu_mem_gb:g} GiB; raise "
            "rollout.launch.tp_size or use FP8 (rollout.launch.quantization=fp8)"
        )
    if engine.table["num_engines"] < 1:
        problems.append(
            f"rollout.launch.tp_size={tp_size} exceeds the {engine.table['gpus']} engine GPUs"
        )
    return problems


def plan_topology(
    cfg: Config,
    launch: LaunchConfig,
    hf: HFConfigLike,
    nodes: int,
    gpus_per_node: int,
    rollout_nodes: int,
    *,
    check_ports: bool = False,
) -> list[str]:
    """`topology.topology_problems` of `cfg` (the trainer's config as it will run) with the
    engines of `launch` placed on the planned nodes."""
    per_node = max(1, gpus_per_node // launch.tp_size)
    ports = [(f"rollout.launch.base_port+{j}", launch.base_port + j) for j in range(per_node)]
    if launch.base_port == 0:
        ports = []
    if rollout_nodes or launch.router:
        ports.append(("rollout.launch.router_port", launch.router_port))
        ports.append(("rollout.launch.router_metrics_port", launch.router_metrics_port))
    if cfg.weights.transport == "distributed" and cfg.weights.master_port:
        ports.append(("weights.master_port", cfg.weights.master_port))
    placement = Placement(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        rollout_nodes=rollout_nodes,
        ports=tuple(ports),
        check_free=check_ports,
    )
    model_path = launch.model_path or cfg.model.hf_path
    return topology_problems(
        cfg,
        placement,
        hf=vars(hf) if not isinstance(hf, dict) else hf,
        engine_model_path=model_path if serves_sglang(launch) else None,
        engine_tp=launch.tp_size,
        engine_ep=launch.ep_size,
    )


def format_plan(plan: Plan) -> str:
    """The table and verdict printed by the CLI."""
    m = plan.memory
    lay = Layout(**plan.layout)
    rows = [
        (
            "GPUs",
            f"{plan.nodes} nodes x {plan.gpus_per_node} = {plan.nodes * plan.gpus_per_node}"
            f" ({plan.gpu_mem_gb:g} GiB each); trainer {plan.trainer_world}",
        ),
        ("layout", f"{lay.name()} dp{plan.dp} expert-dp{plan.expert_dp} sp={lay.sp}"),
        ("params (model)", f"{plan.total_params / 1e9:.2f} B"),
    ]
    for s in plan.stages:
        rows.append(
            (
                f"params/rank stage {s.stage}",
                f"{s.total / 1e9:.3f} B ({s.expert / 1e9:.3f} B expert)",
            )
        )
    rows += [
        ("weights", f"{m.weights / GiB:.1f} GiB"),
        ("grads", f"{m.grads / GiB:.1f} GiB"),
        ("optimizer", f"{m.optimizer / GiB:.1f} GiB"),
        (
            "activations",
            f"{m.activations / GiB:.1f} GiB ({plan.micro_batches} micro-batches, "
            f"{plan.in_flight:.2f} in flight)",
        ),
        ("overhead", f"{m.overhead / GiB:.1f} GiB"),
        (
            "engine (colocated)",
            f"{m.engine_rollout / GiB:.1f} GiB rollout, {m.engine_train / GiB:.1f} GiB train",
        ),
        ("peak training", f"{m.train_peak / GiB:.1f} GiB"),
        ("peak rollout", f"{m.rollout_peak / GiB:.1f} GiB"),
    ]
    e = plan.engine
    rows += [
        (
            "engines",
            f"{e['num_engines']} x TP{e['tp_size']} on {e['gpus']} GPUs"
            f"{' (colocated)' if e['colocated'] else ''}",
        ),
        (
            "engine weights/GPU",
            f"{e['weights_gb']:.1f} GiB (mem_fraction_static {e['mem_fraction_static']})",
        ),
        (
            "engine KV cache",
            f"{e['kv_cache_tokens']:,} tokens = {e['kv_sequences']} sequences "
            f"of max length per engine; {e['samples_per_engine']:.0f} samples per engine/rollout",
        ),
        (
            "weight sync/step",
            f"{plan.sync['bytes'] / 1e9:.1f} GB "
            f"({'FP8' if plan.sync['fp8'] else 'bf16'}), "
            f"{plan.sync['engine_gpu_bytes'] / 1e9:.1f} GB into each engine GPU = "
            f"{plan.sync['seconds']:.1f} s at {plan.sync['gb_per_s']:g} GB/s; busiest sender "
            f"{plan.sync['sender_bytes'] / 1e9:.1f} GB, {m.send_buffers / GiB:.1f} GiB buffers",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    verdict = "FITS" if plan.fits else "DOES NOT FIT: " + "; ".join(plan.problems)
    topo = "OK" if not plan.topology else "REFUSED: " + "; ".join(plan.topology)
    return "\n".join(lines) + f"\ntopology: {topo}\nverdict: {verdict}\n"


# ---------------------------------------------------------------------------------------------
# launch files for the Slurm scripts


def emit_launch(
    cfg: Config,
    plan: Plan,
    hosts: list[str],
    out_dir: str | Path,
    *,
    engine_python: str | None = None,
    router_python: str | None = None,
    engine_loader: bool = True,
) -> list[str]:
    """Write what the Slurm scripts start: `engine<i>.argv` + `engine<i>.host` (NUL-separated
    argv from `engines.launch.engine_command`), `router.argv` (disaggregated), and
    `trainer.sets` (the trainer's `--set` overrides, NUL-separated), for `hosts` (the job's
    nodes in Slurm order: trainer nodes first, then rollout nodes). Returns the `--set`s.
    engine_loader: the engines can import this package (`LaunchCheck.engine_loader`), so
    their command lines name our expert-slice loader."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    require(
        len(hosts) == plan.nodes,
        f"--hosts lists {len(hosts)} nodes but --nodes={plan.nodes}",
    )
    trainer_hosts = hosts[: plan.nodes - plan.rollout_nodes]
    engine_hosts = hosts[plan.nodes - plan.rollout_nodes :] or trainer_hosts
    launch = copy.deepcopy(cfg.rollout.launch or default_launch())
    launch.model_path = launch.model_path or cfg.model.hf_path
    if plan.rollout_nodes:  # engines on nodes of their own: nothing to release memory to
        launch.colocated = False
    per_node = plan.gpus_per_node // launch.tp_size
    urls, i = [], 0
    for host in engine_hosts:
        node = copy.deepcopy(launch)
        node.host = host
        node.num_engines = per_node
        for j in range(per_node):
            python = engine_python or launch.python or "python3"
            argv = engine_command(node, j, python=python, our_loader=engine_loader)
            (out / f"engine{i}.argv").write_bytes(_nul(argv))
            (out / f"engine{i}.host").write_text(host)
            urls.append(node.engine_url(j))
            i += 1
    sets = [
        "rollout.launch=null",
        f"rollout.client.engine_urls=[{','.join(urls)}]",
        f"rollout.client.engine_tp_sizes=[{','.join([str(launch.tp_size)] * len(urls))}]",
    ]
    if not plan.rollout_nodes:  # colocated: each engine rank fed from its own GPU's rank
        gpus = engine_gpu_ids(launch, [per_node] * len(engine_hosts))
        sets.append(f"rollout.client.engine_gpu_ids={json.dumps(gpus, separators=(',', ':'))}")
    if plan.rollout_nodes:
        router = copy.deepcopy(launch)
        router.host = engine_hosts[0]
        argv = router_command(router, python=router_python or sys.executable, worker_urls=urls)
        (out / "router.argv").write_bytes(_nul(argv))
        (out / "router.host").write_text(router.host)
        (out / "router_url").write_text(f"http://{router.host}:{router.router_port}\n")
        sets.append(f"rollout.client.router_url=http://{router.host}:{router.router_port}")
        # Separate nodes share no memory: weights go over a process group with the engines.
        # No weights.master_address: global rank 0 (the rendezvous host) is only known once
        # torchrun's rendezvous has run, so rank 0 resolves its own address then.
        sets.append("weights.transport=distributed")
    sets.append(f"weights.engine_ep_size={launch.ep_size}")  # rollout.launch=null drops it
    (out / "trainer.sets").write_bytes(_nul(sets))
    (out / "engine_urls").write_text("\n".join(urls) + "\n")
    return sets


def _nul(items: list[str]) -> bytes:
    return b"".join(s.encode() + b"\0" for s in items)


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megatron_gspo.plan", description=__doc__.splitlines()[0]
    )
    p.add_argument("--config", required=True, help="YAML run config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the job (all of them)")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu-mem-gb", type=float, required=True, help="memory per GPU (GiB)")
    p.add_argument(
        "--rollout-nodes",
        type=int,
        default=0,
        help="nodes given to SGLang engines only (disaggregated); 0: colocated",
    )
    p.add_argument("--hf-config", help="directory with config.json (default: model.hf_path)")
    p.add_argument(
        "--engines-external",
        action="store_true",
        help="colocated engines started outside the trainer (not released)",
    )
    p.add_argument(
        "--sync-gb-per-s",
        type=float,
        default=25.0,
        help="weight-sync bandwidth (default 25 GB/s: one 400 Gb/s NIC at ~50%%)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="longest prompt (default data.max_prompt_tokens, else 1024)",
    )
    p.add_argument(
        "--moe-imbalance",
        type=float,
        default=1.0,
        help="most loaded expert rank / mean (routed activations)",
    )
    p.add_argument("--counts-cache", help="JSON file memoising the parameter counts")
    p.add_argument("--json", help="also write the plan as JSON here")
    p.add_argument("--emit-launch", metavar="DIR", help="write engine/router/trainer launch files")
    p.add_argument("--hosts", help="comma-separated node names (with --emit-launch)")
    p.add_argument(
        "--engine-python",
        help="interpreter of the SGLang engines (with --emit-launch; default "
        "rollout.launch.python; checked: it must hold SGLang and its kernels)",
    )
    p.add_argument("--quiet", action="store_true", help="no table (verdicts only)")
    p.add_argument(
        "--check-ports", action="store_true", help="refuse ports in use here (the first node)"
    )
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        plan = make_plan(
            cfg,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_mem_gb=args.gpu_mem_gb,
            rollout_nodes=args.rollout_nodes,
            hf_dir=args.hf_config,
            engines_external=args.engines_external,
            counts_cache=args.counts_cache,
            sync_gb_per_s=args.sync_gb_per_s,
            prompt_tokens=args.prompt_tokens,
            moe_imbalance=args.moe_imbalance,
            check_ports=args.check_ports,
        )
        refused: list[str] = []
        if args.emit_launch and not plan.topology:
            check = launch_check(
                cfg, engine_python=args.engine_python, rollout_nodes=args.rollout_nodes
            )
            refused = check.problems
        if args.emit_launch and not plan.topology and not refused:
            hosts = [h for h in (args.hosts or "").split(",") if h]
            sets = emit_launch(
                cfg, plan, hosts, args.emit_launch, engine_python=args.engine_python,
                router_python=check.router_python, engine_loader=check.engine_loader,
            )  # fmt: skip
            for note in check.notes:
                print(f"plan: {note}", file=sys.stderr)
            # the topology of the trainer's config as the job runs it (the emitted overrides on
            # top), with the engines as the launch files start them
            final = load_config(args.config, args.overrides + sets)
            plan.topology = plan_topology(
                final,
                cfg.rollout.launch or default_launch(),
                _hf_config(args.hf_config or cfg.model.hf_path),
                args.nodes,
                args.gpus_per_node,
                args.rollout_nodes,
            )
    except ConfigError as e:
        print(f"plan: invalid config: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_json(), indent=1))
    if args.quiet:
        print("\n".join(format_plan(plan).splitlines()[-2:]))
    else:
        print(format_plan(plan) + "\n" + memory_formula())
    if plan.topology or refused:
        for line in plan.topology + refused:  # launch refusals: nothing was written
            print(f"plan: refused: {line}", file=sys.stderr)
        return 2
    return 0 if plan.fits else 1
