#!/usr/bin/env bash
# Install (cached) and run the main job: GSPO on a tiny Qwen3-MoE-shaped model, 2 CPU ranks
# (EP=2), embedded rollout engine, toy task. Extra args go to megatron_gspo.train (--set k=v).
#
#   --engine sglang   (first argument) roll out on the real SGLang 0.5.23 server on CPU instead:
#                     a bf16 engine against the fp32 trainer, so train/inference mismatch is
#                     real; builds its venv once (scripts/engine_env.sh) and writes
#                     runs/tiny_moe_cpu_sglang/.
#   --eval            (first argument) the same job with held-out evaluation every 5 steps
#                     (examples/tiny_moe_cpu_eval.yaml): prints the held-out curve and plots it
#                     in runs/tiny_moe_cpu_eval/reward.png.
#   --example agent   (first argument) an agent written against the OpenAI API learns to
#                     use its calculator tool (megatron_gspo/agents/calculator.py through the
#                     job's token-exact endpoint, examples/tiny_moe_agent_cpu.yaml), then the
#                     same task through the Env interface (examples/tiny_moe_agent_env_cpu.yaml);
#                     prints both runs' reward and tool-call-rate curves, and exits 1 unless
#                     both rose. Extra args go to both runs.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/env.sh")
cd "$root"
run=runs/tiny_moe_cpu
config=examples/tiny_moe_cpu.yaml
engine_sets=()
held_out=false
if [ "${1:-}" = "--example" ]; then
  example=${2:-}; shift 2 || shift
  if [ "$example" != agent ]; then
    echo "scripts/main.sh: --example takes agent, not '$example'" >&2; exit 2
  fi
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore OMP_NUM_THREADS=1
  py="$venv/bin/python"
  cd "$root"
  "$py" tools/make_tiny_toy.py --out runs/tiny_toy_agent --ops add --max-len 3 --chat
  status=0
  for run in tiny_moe_agent_cpu tiny_moe_agent_env_cpu; do
    "$py" -m megatron_gspo.torchrun --nproc_per_node 2 -m megatron_gspo.train \
      --config "examples/$run.yaml" --overwrite "$@"
    "$py" tools/plot_metrics.py "runs/$run/metrics.jsonl" --out "runs/$run/reward.png"
  done
  for run in tiny_moe_agent_cpu tiny_moe_agent_env_cpu; do
    echo "== runs/$run"
    "$py" tools/reward_summary.py "runs/$run/metrics.jsonl" --curve reward/mean
    "$py" tools/reward_summary.py "runs/$run/metrics.jsonl" --curve env/tool_call_rate
    "$py" tools/reward_summary.py "runs/$run/metrics.jsonl" || status=1
    "$py" tools/reward_summary.py "runs/$run/metrics.jsonl" --key env/tool_call_rate || status=1
  done
  exit $status
fi
if [ "${1:-}" = "--eval" ]; then
  shift; held_out=true; config=examples/tiny_moe_cpu_eval.yaml; run=runs/tiny_moe_cpu_eval
fi
if [ "${1:-}" = "--engine" ] || [[ "${1:-}" == --engine=* ]]; then
  if [ "$1" = "--engine" ]; then engine=${2:-}; shift 2 || shift; else engine=${1#--engine=}; shift; fi
  case "$engine" in
    embedded) ;;
    sglang)
      engine_python="$(bash "$root/scripts/engine_env.sh")/bin/python"
      run=runs/tiny_moe_cpu_sglang
      # weights.dtype follows the engine's bf16 by default (config.py); verification stays on.
      engine_sets=(--set rollout.launch.backend=sglang --set rollout.launch.device=cpu
        --set "rollout.launch.python=$engine_python"
        --set "logging.dir=$run" --set "checkpoint.dir=$run/ckpt") ;;
    *) echo "scripts/main.sh: --engine takes embedded or sglang, not '$engine'" >&2; exit 2 ;;
  esac
fi
# OMP_NUM_THREADS set here keeps torchrun from printing its banner about it.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore OMP_NUM_THREADS=1
py="$venv/bin/python"
"$py" tools/make_tiny_toy.py --out runs/tiny_toy
if $held_out; then  # held out: the ten 2-digit copies ending in 7, none left in training
  "$py" tools/make_held_out.py runs/tiny_toy/toy.jsonl --train runs/tiny_toy/toy_train.jsonl \
    --held-out runs/tiny_toy/toy_eval.jsonl --suffix 7
fi
# The main job is a fresh run each time (the toy is regenerated): replace the previous one,
# unless the caller continues it with --resume.
fresh=(--overwrite)
for arg in "$@"; do
  case "$arg" in --resume|--overwrite|--dump|*checkpoint.resume=true*) fresh=() ;; esac
done
# megatron_gspo.torchrun: torchrun, with bad input refused in one line and exit code 2
"$py" -m megatron_gspo.torchrun --nproc_per_node 2 -m megatron_gspo.train \
  --config "$config" ${engine_sets[@]+"${engine_sets[@]}"} \
  ${fresh[@]+"${fresh[@]}"} "$@"
"$py" tools/plot_metrics.py "$run/metrics.jsonl" --out "$run/reward.png"
if $held_out; then
  for key in eval/reward_mean eval/pass@1 eval/pass@4; do
    "$py" tools/reward_summary.py "$run/metrics.jsonl" --curve "$key"
  done
fi
"$py" tools/reward_summary.py "$run/metrics.jsonl"
