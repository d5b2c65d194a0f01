#!/usr/bin/env bash
# Install (cached) and run the whole test suite: lint, then pytest. Extra args go to pytest.
#   --quick   the quick tier: every module's fast tests, no multi-rank launches, no
#             end-to-end runs, no real SGLang server (tests marked slow or multirank are left
#             out); under 5 minutes on 2 cores. CI (.ci/run) always runs everything.
set -uo pipefail
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/env.sh") || exit 1
# The real SGLang server runs in its own pinned venv (SGLang pins its own torch); with it built,
# the tests against the real server must run, never skip. The quick tier does not use it.
if [ "$quick" = 0 ]; then
  engine_venv=$(bash "$root/scripts/engine_env.sh") || exit 1
  export MGSPO_ENGINE_PYTHON="$engine_venv/bin/python" MGSPO_REQUIRE_SGLANG=1
fi
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
start=$(date +%s)
"$venv/bin/ruff" check . || { echo "[test] ruff check failed"; exit 1; }
# The central seams are type-checked: the numerics, the config, the policy and the loop.
MYPY_PATHS=(megatron_gspo/algo megatron_gspo/config.py megatron_gspo/config_io.py
  megatron_gspo/layout.py megatron_gspo/dist.py megatron_gspo/megatron/policy.py
  megatron_gspo/rollout/experience.py megatron_gspo/checkpoint.py megatron_gspo/train.py
  megatron_gspo/preflight.py megatron_gspo/rollout/config.py megatron_gspo/rollout/scheduler.py
  megatron_gspo/engines/protocols.py megatron_gspo/engines/connect.py)
"$venv/bin/mypy" "${MYPY_PATHS[@]}" || { echo "[test] mypy failed"; exit 1; }
if [ "$quick" = 1 ]; then
  set -- -m "not slow and not multirank" "$@"
fi
# --durations: the 40 slowest tests, to keep the suite's time in view
"$venv/bin/python" -m pytest -p no:cacheprovider --durations=40 "$@"
rc=$?
tier=$([ "$quick" = 1 ] && echo "quick tier" || echo "suite")
echo "[test] $tier wall time: $(( $(date +%s) - start )) s on $(nproc) cores"
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
