#!/usr/bin/env bash
# Install (cached) and run the whole test suite: lint, then pytest. Extra args go to pytest.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/env.sh") || exit 1
# The real SGLang server runs in its own pinned venv (SGLang pins its own torch); with it built,
# the tests against the real server must run, never skip.
engine_venv=$(bash "$root/scripts/engine_env.sh") || exit 1
export MGSPO_ENGINE_PYTHON="$engine_venv/bin/python" MGSPO_REQUIRE_SGLANG=1
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
start=$(date +%s)
"$venv/bin/ruff" check . || { echo "[test] ruff check failed"; exit 1; }
# The central seams are type-checked: the numerics, the config, the policy and the loop.
MYPY_PATHS=(megatron_gspo/algo megatron_gspo/config.py megatron_gspo/config_io.py
  megatron_gspo/layout.py megatron_gspo/dist.py megatron_gspo/megatron/policy.py
  megatron_gspo/rollout/experience.py megatron_gspo/checkpoint.py megatron_gspo/train.py megatron_gspo/preflight.py
  megatron_gspo/rollout/config.py megatron_gspo/rollout/scheduler.py)
"$venv/bin/mypy" "${MYPY_PATHS[@]}" || { echo "[test] mypy failed"; exit 1; }
"$venv/bin/python" -m pytest -p no:cacheprovider "$@"
rc=$?
echo "[test] suite wall time: $(( $(date +%s) - start )) s on $(nproc) cores"
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
