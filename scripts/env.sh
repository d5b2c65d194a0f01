#!/usr/bin/env bash
# Ensure the pinned Python 3.12 environment exists and print its directory.
#
# The venv lives outside the clone, keyed by the hash of constraints.txt, so CI and later clones
# reuse it; a fresh machine builds it from nothing (~2-3 min, ~5 GB: torch's CUDA build).
#   MGSPO_CACHE   where venvs are kept (default ~/.cache/megatron-gspo)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/venv_lib.sh"

install_trainer() {
  "$1/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    -r "$root/constraints.txt"
}

mgspo_cached_venv venv "$(sha256sum "$root/constraints.txt" | cut -c1-16)" install_trainer
