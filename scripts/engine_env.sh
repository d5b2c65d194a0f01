#!/usr/bin/env bash
# Ensure the pinned Python 3.12 environment of the real SGLang server exists; print its directory.
#
# Separate from the trainer's venv (scripts/env.sh) because sglang pins its own torch
# (constraints-engine.txt says why). Cached outside the clone, keyed by the hash of
# constraints-engine.txt, built once under a lock (~4 min, ~11 GB: torch's CUDA build plus
# sglang's GPU kernel stack, all unused on CPU but part of the unmodified install).
#   MGSPO_CACHE   where venvs are kept (default ~/.cache/megatron-gspo)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
hash=$(sha256sum "$root/constraints-engine.txt" | cut -c1-16)
cache=${MGSPO_CACHE:-$HOME/.cache/megatron-gspo}
venv="$cache/engine-venv-$hash"

find_python312() {
  local c
  if c=$(command -v python3.12 2>/dev/null) && "$c" -c 'import sys' 2>/dev/null; then
    echo "$c"; return
  fi
  for c in "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$c" ]; then echo "$c"; return; fi
  done
  echo "error: Python 3.12 not found; install it, e.g. 'pyenv install 3.12'" >&2
  exit 1
}

if [ ! -f "$venv/.complete" ]; then
  mkdir -p "$cache"
  exec 9>"$cache/.lock-engine-$hash"
  flock 9  # another clone may be building the same venv
  if [ ! -f "$venv/.complete" ]; then
    py=$(find_python312)
    echo "[engine-env] building $venv with $py (one time: ~4 min, ~11 GB)" >&2
    start=$(date +%s)
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check pip==26.3 >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
      -r "$root/constraints-engine.txt" >&2
    "$venv/bin/python" -c 'import sglang.srt.server_args' >&2  # fail here, not in the first test
    touch "$venv/.complete"
    echo "[engine-env] ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
  fi
fi
echo "$venv"
