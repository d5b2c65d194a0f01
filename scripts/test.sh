#!/usr/bin/env bash
# Install (cached) and run the whole test suite: ruff, then pytest with mypy beside it.
#   --quick   the quick tier: every module's fast tests, no multi-rank launches, no
#             end-to-end runs, no real SGLang server (tests marked slow or multirank are left
#             out); under 5 minutes on 2 cores. CI (.ci/run) always runs everything.
#   [pytest args]  run only what they select, in one pytest process (the whole suite runs as
#             two processes at once, see below; PYTEST_ADDOPTS reaches both).
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
# The whole package is type-checked (pyproject.toml [tool.mypy]; third-party packages without
# stubs are Any).
MYPY_PATHS=(megatron_gspo)
out=$(mktemp -d "${TMPDIR:-/tmp}/mgspo-test.XXXXXX")
trap 'rm -rf "$out"' EXIT
# mypy (one core, ~60 s without its cache) checks beside pytest; its verdict counts at the end.
"$venv/bin/mypy" "${MYPY_PATHS[@]}" >"$out/mypy.log" 2>&1 &
mypy_pid=$!
PYTEST=("$venv/bin/python" -m pytest -p no:cacheprovider)
if [ "$quick" = 1 ]; then
  # --durations: the slowest tests, to keep the suite's time in view
  "${PYTEST[@]}" -m "not slow and not multirank" --durations=15 "$@"
  rc=$?
elif [ "$#" -gt 0 ]; then
  "${PYTEST[@]}" --durations=15 "$@"  # a part of the suite, as asked
  rc=$?
else
  # The whole suite in three pytest processes at once, each with its own temporary directory:
  # the launches (tests marked slow or multirank) of tests/train/ and of the rest, and the
  # in-process tests (the quick tier). One stream of launches leaves about a third of the 2
  # cores idle (start-up, health waits) and the in-process tests use one core. Reports follow
  # in this order; any stream's failure or exit 5 (no tests) fails the run.
  stream() {  # name, pytest args: runs in the background, its report in $out/name.log
    local name=$1; shift
    ( "${PYTEST[@]}" "$@" --basetemp="$out/$name" --durations=15 >"$out/$name.log" 2>&1
      r=$?; echo "[test] $name: exit $r after $(( $(date +%s) - start )) s" | tee -a "$out/$name.log"
      exit "$r" ) &
    pids+=($!); names+=("$name")
  }
  pids=(); names=()
  echo "[test] three pytest streams at once; each one's report follows when all have ended"
  stream launches-train -m "slow or multirank" tests/train
  stream launches-rest -m "slow or multirank" --ignore=tests/train
  stream in-process -m "not slow and not multirank"
  rc=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    r=$?
    echo "[test] ---- ${names[$i]} ----"
    cat "$out/${names[$i]}.log"
    [ "$rc" -eq 0 ] && rc=$r
  done
fi
tier=$([ "$quick" = 1 ] && echo "quick tier" || echo "suite")
if ! wait "$mypy_pid"; then
  cat "$out/mypy.log"
  echo "[test] mypy failed"
  [ "$rc" -eq 0 ] && rc=1
fi
echo "[test] $tier wall time: $(( $(date +%s) - start )) s on $(nproc) cores"
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
