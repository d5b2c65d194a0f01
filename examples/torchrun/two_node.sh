#!/usr/bin/env bash
# Two nodes, one torchrun each, c10d rendezvous on the first node (run the same line on both;
# start order does not matter). The engines run elsewhere and are passed by URL; weights go
# over a process group with them (weights.transport=distributed); global rank 0 hosts its
# rendezvous and resolves its own address at run time (c10d may make either node rank 0).
#
#   # on both nodes:
#   HEAD=node1 NPROC=8 ENGINES=http://node3:30000,http://node3:30001 \
#     bash examples/torchrun/two_node.sh --config examples/recipes/qwen3_30b_a3b_bf16.yaml
#
# NET_IF selects the network interface (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME). The CPU test
# of this (tests/plan/test_multinode.py) runs two such torchruns on 127.0.0.1 with 1 rank each.
set -euo pipefail
: "${HEAD:?set HEAD to the address of the first node}"
: "${ENGINES:?set ENGINES to the comma-separated engine URLs}"
python=${PYTHON:-python3}
if [[ -n ${NET_IF:-} ]]; then
  export NCCL_SOCKET_IFNAME=$NET_IF GLOO_SOCKET_IFNAME=$NET_IF
fi
exec "$python" -m megatron_gspo.torchrun --nnodes 2 --nproc-per-node "${NPROC:-8}" \
  --rdzv-backend c10d --rdzv-endpoint "$HEAD:${RDZV_PORT:-29500}" \
  --rdzv-id "${RDZV_ID:-mgspo-$HEAD}" \
  -m megatron_gspo.train "$@" \
  --set rollout.launch=null --set "rollout.client.engine_urls=[$ENGINES]" \
  --set weights.transport=distributed
