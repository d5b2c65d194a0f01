#!/usr/bin/env bash
# Ensure the pinned Python 3.12 environment exists and print its directory.
#
# The venv lives outside the clone, keyed by the hash of constraints.txt, so CI and later clones
# reuse it; a fresh machine builds it from nothing (~3 min, ~5 GB: torch's CUDA build).
#   MGSPO_CACHE   where venvs are kept (default ~/.cache/megatron-gspo)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
hash=$(sha256sum "$root/constraints.txt" | cut -c1-16)
cache=${MGSPO_CACHE:-$HOME/.cache/megatron-gspo}
venv="$cache/venv-$hash"

find_python312() {
  local c
  if c=$(command -v python3.12 2>/dev/null) && "$c" -c 'import sys' 2>/dev/null; then
    echo "$c"; return
  fi
  for c in "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$c" ]; then echo "$c"; return; fi
  done
  echo "error: Python 3.12 not found (megatron-core 0.19 needs it); install it, e.g. 'pyenv install 3.12'" >&2
  exit 1
}

if [ ! -f "$venv/.complete" ]; then
  mkdir -p "$cache"
  exec 9>"$cache/.lock-$hash"
  flock 9  # another clone may be building the same venv
  if [ ! -f "$venv/.complete" ]; then
    py=$(find_python312)
    echo "[env] building $venv with $py (one time: ~3 min, ~5 GB)" >&2
    start=$(date +%s)
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check pip==26.3 >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
      -r "$root/constraints.txt" >&2
    touch "$venv/.complete"
    echo "[env] ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
  fi
fi
echo "$venv"
