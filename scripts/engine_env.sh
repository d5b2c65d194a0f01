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
source "$root/scripts/venv_lib.sh"

install_engine() {
  "$1/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    -r "$root/constraints-engine.txt"
  "$1/bin/python" -c 'import sglang.srt.server_args'  # fail here, not in the first test
}

mgspo_cached_venv engine-venv "$(sha256sum "$root/constraints-engine.txt" | cut -c1-16)" \
  install_engine
