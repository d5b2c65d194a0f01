#!/usr/bin/env bash
# Install (cached) and run the main job: GSPO on a tiny Qwen3-MoE-shaped model, 2 CPU ranks
# (EP=2), embedded rollout engine, toy task. Extra args go to megatron_gspo.train (--set k=v).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/env.sh")
cd "$root"
# OMP_NUM_THREADS set here keeps torchrun from printing its banner about it.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore OMP_NUM_THREADS=1
py="$venv/bin/python"
"$py" tools/make_tiny_toy.py --out runs/tiny_toy
"$py" -m torch.distributed.run --nproc_per_node 2 -m megatron_gspo.train \
  --config examples/tiny_moe_cpu.yaml "$@"
"$py" tools/plot_metrics.py runs/tiny_moe_cpu/metrics.jsonl --out runs/tiny_moe_cpu/reward.png
"$py" tools/reward_summary.py runs/tiny_moe_cpu/metrics.jsonl
