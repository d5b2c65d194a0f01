#!/usr/bin/env bash
# One node, all its GPUs (or CPU ranks): torchrun starts the ranks; the trainer starts the
# engines of rollout.launch on this node (colocated) or uses rollout.client.engine_urls.
#   NPROC=8 bash examples/torchrun/single_node.sh --config examples/recipes/qwen3_30b_a3b_bf16.yaml
# CPU: NPROC=2 bash examples/torchrun/single_node.sh --config examples/tiny_moe_cpu.yaml
set -euo pipefail
python=${PYTHON:-python3}
# Plan first: an invalid layout or a "does not fit" verdict stops here (exit 2 / 1).
if [[ -n ${GPU_MEM_GB:-} ]]; then
  "$python" -m megatron_gspo.plan --nodes 1 --gpus-per-node "${NPROC:-8}" \
    --gpu-mem-gb "$GPU_MEM_GB" "$@" --quiet
fi
exec "$python" -m megatron_gspo.torchrun --standalone --nproc-per-node "${NPROC:-8}" \
  -m megatron_gspo.train "$@"
