# Shared steps of the megatron-gspo sbatch scripts (sourced, not run). Bash 4.4+.
#
# Environment (all optional except CONFIG):
#   CONFIG            run config (YAML), e.g. examples/recipes/qwen3_30b_a3b_bf16.yaml
#   PYTHON            interpreter of the trainer and the planner (default: python3)
#   ENGINE_PYTHON     interpreter of the SGLang servers (default: the venv bash
#                     scripts/engine_env.sh built for this checkout; never $PYTHON, whose sglang
#                     has no GPU kernels: without either the job stops before anything starts).
#                     sglang-router runs from whichever of ENGINE_PYTHON and PYTHON has it (the
#                     planner checks; the trainer's lock has it, the engine's does not)
#   GPUS_PER_NODE     default: $SLURM_GPUS_ON_NODE (set by #SBATCH --gpus-per-node), else 8
#   GPU_MEM_GB        memory per GPU for the planner (GiB). Default: the smallest memory.total
#                     nvidia-smi reports on this node; without nvidia-smi, 140 (an H200:
#                     143771 MiB; the recipes are planned for it)
#   LOG_DIR           default: logs/slurm-$SLURM_JOB_ID (per-node logs, the plan, launch files)
#   RDZV_PORT         torchrun c10d rendezvous port on the first trainer node (default 29500)
#   NET_IF            network interface for NCCL and gloo (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)
#   HEALTH_TIMEOUT_S  how long engines may take to answer /health_generate (default 1800)
#   GRACE_S           after SIGTERM, how long the trainer may take to checkpoint (default 170)
#   KILL_AFTER_S      SIGTERM -> SIGKILL delay when tearing down (default 30)
#   PLAN_FORCE=1      start even if the planner's verdict is "does not fit" (exit 1)
#   PLAN_CACHE        parameter-count cache of the planner (default: $LOG_DIR/../param_counts.json)
#   POLL_S            how often the job checks its processes (default 5)
# Script arguments are extra `--set key=value` overrides for the planner and the trainer.

# Memory per GPU in GiB: the smallest memory.total (MiB) nvidia-smi reports here, else 140.
mgspo_gpu_mem_gb() {
  local mib
  if command -v nvidia-smi >/dev/null 2>&1 &&
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null |
      sort -n | head -n 1) && [[ $mib =~ ^[0-9]+$ ]]; then
    awk -v m="$mib" 'BEGIN { printf "%.1f\n", m / 1024 }'
  else
    echo 140
  fi
}

mgspo_setup() {
  : "${CONFIG:?set CONFIG to the run config (YAML)}"
  PYTHON=${PYTHON:-python3}
  if [[ -z ${ENGINE_PYTHON:-} ]]; then
    # the engine venv of scripts/engine_env.sh, or one line and exit 2
    ENGINE_PYTHON=$("$PYTHON" -m megatron_gspo.engines.interpreter) || exit 2
  fi
  GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  GPU_MEM_GB=${GPU_MEM_GB:-$(mgspo_gpu_mem_gb)}
  LOG_DIR=${LOG_DIR:-logs/slurm-${SLURM_JOB_ID:-local}}
  RDZV_PORT=${RDZV_PORT:-29500}
  HEALTH_TIMEOUT_S=${HEALTH_TIMEOUT_S:-1800}
  GRACE_S=${GRACE_S:-170}
  KILL_AFTER_S=${KILL_AFTER_S:-30}
  POLL_S=${POLL_S:-5}
  PLAN_CACHE=${PLAN_CACHE:-$LOG_DIR/../param_counts.json}
  USER_SETS=("$@")
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  if [[ ${#NODES[@]} -eq 0 ]]; then
    echo "[slurm] no nodes in SLURM_JOB_NODELIST" >&2
    exit 2
  fi
  if [[ -n ${NET_IF:-} ]]; then
    export NCCL_SOCKET_IFNAME=$NET_IF GLOO_SOCKET_IFNAME=$NET_IF
  fi
  mkdir -p "$LOG_DIR/launch"
  ENGINE_PIDS=()
  ENGINE_NAMES=()
  TRAINER_PID=
  STOPPING=0
  # Whatever ends this script (failure, normal end, signal), nothing it started survives it.
  trap mgspo_teardown EXIT
  trap mgspo_on_term TERM INT
}

# The planner runs before anything starts: an invalid layout (exit 2) or a verdict of "does not
# fit" (exit 1, unless PLAN_FORCE=1) ends the job here. It also writes the launch files (engine
# and router command lines, the trainer's --set overrides) into $LOG_DIR/launch.
mgspo_plan() {
  local rollout_nodes=$1 hosts rc=0
  shift
  hosts=$(IFS=,; echo "${NODES[*]}")
  "$PYTHON" -m megatron_gspo.plan --config "$CONFIG" "${USER_SETS[@]}" \
    --nodes "${#NODES[@]}" --gpus-per-node "$GPUS_PER_NODE" --gpu-mem-gb "$GPU_MEM_GB" \
    --rollout-nodes "$rollout_nodes" --hosts "$hosts" --emit-launch "$LOG_DIR/launch" \
    --engine-python "$ENGINE_PYTHON" --counts-cache "$PLAN_CACHE" --json "$LOG_DIR/plan.json" \
    "$@" >"$LOG_DIR/plan.txt" 2>&1 || rc=$?
  cat "$LOG_DIR/plan.txt"
  if [[ $rc -eq 1 && ${PLAN_FORCE:-0} == 1 ]]; then
    echo "[slurm] planner: does not fit; PLAN_FORCE=1, starting anyway" >&2
  elif [[ $rc -ne 0 ]]; then
    echo "[slurm] planner refused the job (exit $rc); nothing was started" >&2
    exit "$rc"
  fi
}

# One srun step per engine, on its node, sharing the node with other steps (--overlap).
mgspo_start_engines() {
  local f i host argv
  for f in "$LOG_DIR"/launch/engine*.argv; do
    i=${f##*/engine}
    i=${i%.argv}
    host=$(<"$LOG_DIR/launch/engine$i.host")
    mapfile -d '' argv <"$f"
    srun --nodes=1 --ntasks=1 --nodelist="$host" --overlap \
      --output="$LOG_DIR/engine$i-$host.log" "${argv[@]}" &
    ENGINE_PIDS+=($!)
    ENGINE_NAMES+=("engine$i@$host")
  done
}

# sglang-router in front of the engines (disaggregated), once they are healthy.
mgspo_start_router() {
  local host argv
  host=$(<"$LOG_DIR/launch/router.host")
  mapfile -d '' argv <"$LOG_DIR/launch/router.argv"
  srun --nodes=1 --ntasks=1 --nodelist="$host" --overlap \
    --output="$LOG_DIR/router-$host.log" "${argv[@]}" &
  ENGINE_PIDS+=($!)
  ENGINE_NAMES+=("router@$host")
}

# Poll `route` on every URL listed in the file `$1` until all answer 200. /health_generate runs
# a one-token generation, so an engine is "healthy" when it can generate. A process of ours that
# exits while we wait fails the job at once.
mgspo_wait_healthy() {
  local deadline=$((SECONDS + HEALTH_TIMEOUT_S)) url i route=$2
  local -a urls pending
  mapfile -t urls <"$1"
  while :; do
    for i in "${!ENGINE_PIDS[@]}"; do
      if ! kill -0 "${ENGINE_PIDS[$i]}" 2>/dev/null; then
        echo "[slurm] ${ENGINE_NAMES[$i]} exited before it was healthy" >&2
        return 1
      fi
    done
    pending=()
    for url in "${urls[@]}"; do
      curl -sf --max-time 10 -o /dev/null "$url$route" || pending+=("$url")
    done
    if [[ ${#pending[@]} -eq 0 ]]; then
      echo "[slurm] healthy: ${urls[*]}"
      return 0
    fi
    if ((SECONDS > deadline)); then
      echo "[slurm] not healthy after ${HEALTH_TIMEOUT_S}s: ${pending[*]}" >&2
      return 1
    fi
    sleep 5
  done
}

# One torchrun per trainer node (srun --ntasks-per-node=1), c10d rendezvous on the first one.
# torchrun SIGKILLs its workers --shutdown-timeout seconds after forwarding a SIGTERM (30 s by
# default): GRACE_S instead, the time the trainer has to finish its step and checkpoint.
mgspo_start_trainer() {
  local -a trainer_nodes=("${@}") sets extra=()
  local s nodelist
  mapfile -d '' sets <"$LOG_DIR/launch/trainer.sets"
  for s in "${sets[@]}"; do
    extra+=(--set "$s")
  done
  # A requeued job (Slurm counts restarts) or MGSPO_RESUME=1 continues from the checkpoint; a
  # first run into a used run directory is refused by the trainer rather than overwriting it.
  if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] || [ "${MGSPO_RESUME:-0}" = 1 ]; then
    extra+=(--resume)
  fi
  nodelist=$(IFS=,; echo "${trainer_nodes[*]}")
  srun --nodes="${#trainer_nodes[@]}" --ntasks-per-node=1 --nodelist="$nodelist" --overlap \
    --kill-on-bad-exit=1 --output="$LOG_DIR/trainer-%N.log" \
    "$PYTHON" -m megatron_gspo.torchrun --nnodes "${#trainer_nodes[@]}" \
    --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d \
    --rdzv-endpoint "${trainer_nodes[0]}:$RDZV_PORT" --rdzv-id "${SLURM_JOB_ID:-mgspo}" \
    --shutdown-timeout "$GRACE_S" \
    -m megatron_gspo.train --config "$CONFIG" "${USER_SETS[@]}" "${extra[@]}" &
  TRAINER_PID=$!
}

# Wait for the trainer; if an engine (or the router) dies first, the job fails and everything
# is torn down. Returns the trainer's exit status (1 if an engine died).
mgspo_monitor() {
  local i rc
  while :; do
    if ! kill -0 "$TRAINER_PID" 2>/dev/null; then
      rc=0
      wait "$TRAINER_PID" || rc=$?
      echo "[slurm] trainer exited with $rc"
      return "$rc"
    fi
    for i in "${!ENGINE_PIDS[@]}"; do
      if ! kill -0 "${ENGINE_PIDS[$i]}" 2>/dev/null; then
        echo "[slurm] ${ENGINE_NAMES[$i]} exited during training; stopping the job" >&2
        return 1
      fi
    done
    # `wait` on a background sleep, so a SIGTERM runs its trap at once.
    sleep "$POLL_S" &
    wait $! || true
  done
}

# SIGTERM (preemption, or --signal=B:TERM@N before the time limit): the trainer gets it first
# (srun forwards it to torchrun, torchrun to the ranks; train.py finishes the step, writes a
# checkpoint and exits 0), and GRACE_S to do so; then everything else is stopped.
mgspo_on_term() {
  [[ $STOPPING == 1 ]] && return
  STOPPING=1
  echo "[slurm] SIGTERM: asking the trainer to checkpoint (up to ${GRACE_S}s)" >&2
  local rc=143 deadline=$((SECONDS + GRACE_S))
  if [[ -n $TRAINER_PID ]] && kill -0 "$TRAINER_PID" 2>/dev/null; then
    kill -TERM "$TRAINER_PID" 2>/dev/null || true
    while kill -0 "$TRAINER_PID" 2>/dev/null && ((SECONDS < deadline)); do
      sleep 1
    done
    if ! kill -0 "$TRAINER_PID" 2>/dev/null; then
      rc=0
      wait "$TRAINER_PID" || rc=$?
    fi
  fi
  exit "$rc"
}

_mgspo_stop() {
  local pid deadline=$((SECONDS + KILL_AFTER_S)) alive
  for pid in "$@"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  while :; do
    alive=()
    for pid in "$@"; do
      if kill -0 "$pid" 2>/dev/null; then
        alive+=("$pid")
      fi
    done
    [[ ${#alive[@]} -eq 0 ]] && return 0
    if ((SECONDS >= deadline)); then
      kill -KILL "${alive[@]}" 2>/dev/null || true
      return 0
    fi
    sleep 0.2
  done
}

# The EXIT trap: stop the trainer (if still up), then the engines and router; no orphans.
mgspo_teardown() {
  local rc=$?
  trap - EXIT TERM INT
  local -a pids=()
  [[ -n ${TRAINER_PID:-} ]] && pids+=("$TRAINER_PID")
  _mgspo_stop "${pids[@]}" ${ENGINE_PIDS[@]+"${ENGINE_PIDS[@]}"}
  wait 2>/dev/null || true
  echo "[slurm] torn down (exit $rc); logs in $LOG_DIR"
  exit "$rc"
}
