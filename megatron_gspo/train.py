"""GSPO training: `torchrun --nproc_per_node N -m megatron_gspo.train --config FILE [--set k=v]`.

One step: rollout (rank 0: G responses per prompt with the engine's log-probs) -> rewards ->
group advantages -> broadcast -> mini-batch updates on Megatron (every rank) -> push the new
weights to the engines -> log -> checkpoint. Algorithm choice lives in the config only.
"""

from __future__ import annotations

import signal
import sys
import time

import torch

from megatron_gspo.config import parse_cli
from megatron_gspo.metrics_log import MetricsLogger
from megatron_gspo.trainer import (
    Policy,
    broadcast,
    finite_metrics,
    init_distributed,
    load_checkpoint,
    make_rollout,
    rank,
    save_checkpoint,
)
from megatron_gspo.weights.sync import make_weight_sync


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_cli(argv)
    init_distributed()
    policy = Policy.build(cfg)
    rollout = sync = log = None
    try:  # whatever fails, engines and reward workers are shut down
        rollout = make_rollout(cfg) if rank() == 0 else None
        sync = make_weight_sync(
            policy.bridge,
            rollout.engine if rollout else [],
            cfg.rollout.weight_sync,
            fp8=cfg.rollout.precision == "fp8",
            bucket_mb=cfg.rollout.bucket_mb,
            disk_dir=f"{cfg.logging.dir}/weights",
            verify_every=cfg.rollout.verify_weights_every,
        )
        start = load_checkpoint(policy, rollout) if cfg.checkpoint.resume else 0
        stop = {"now": False}
        signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
        log = MetricsLogger.from_config(
            cfg.logging, total_steps=cfg.train.steps, config=cfg, rank=rank(), start_step=start
        )
        _loop(cfg, policy, rollout, sync, log, start, stop)
    finally:
        for part in (log, rollout, sync):
            if part is not None:
                part.close()
    torch.distributed.destroy_process_group()


def _loop(cfg, policy, rollout, sync, log, start, stop) -> None:  # noqa: ANN001
    sync.push(policy.model)  # the engines serve exactly the trainer's weights from step 0
    for step in range(start, cfg.train.steps):
        t0 = time.perf_counter()
        seqs, metrics = rollout.collect() if rollout else (None, None)
        seqs, metrics = broadcast((seqs, metrics))
        t1 = time.perf_counter()
        if rollout and cfg.rollout.colocated:
            rollout.engine.release_memory()  # the trainer gets the devices while it updates
        metrics |= policy.update(seqs, step)
        t2 = time.perf_counter()
        if rollout and cfg.rollout.colocated:
            rollout.engine.resume_memory()
        pushed = sync.push(policy.model)
        metrics |= {
            "weights/version": pushed.version,
            "weights/verified": float(pushed.verified),
            "weights/gb_per_s": pushed.gb_per_s,
        }
        metrics |= {
            "time/train_s": t2 - t1,
            "time/sync_s": time.perf_counter() - t2,
            "time/step_s": time.perf_counter() - t0,
            "perf/tokens_per_s": sum(s.length for s in seqs) / (t2 - t1),
        }
        log.log(step + 1, finite_metrics(metrics))
        every = cfg.checkpoint.save_every
        if stop["now"] or (every and (step + 1) % every == 0) or step + 1 == cfg.train.steps:
            save_checkpoint(policy, rollout, step + 1)
        if broadcast(stop["now"]):
            print(f"[train] SIGTERM: checkpoint written at step {step + 1}", file=sys.stderr)
            return
    if cfg.checkpoint.export_hf_at_end:
        policy.bridge.save_hf_pretrained(policy.model, f"{cfg.checkpoint.dir}/hf_final")


def cli() -> None:
    main(sys.argv[1:])


if __name__ == "__main__":
    cli()
