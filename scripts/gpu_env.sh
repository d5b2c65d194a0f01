#!/usr/bin/env bash
# The trainer's environment on NVIDIA GPUs, one command; prints its directory.
#
#   bash scripts/gpu_env.sh            build (once) and print the venv directory
#   bash scripts/gpu_env.sh --dry-run  check the pins against PyPI without installing (CPU ok)
#
# constraints.txt (the CPU/CI lock: torch 2.13.0 CUDA 13 build, megatron-core, megatron-bridge,
# ...) plus constraints-gpu.txt (Transformer Engine 2.20.2 and what it needs; that file says
# why), both installed with --no-deps: a full lock, nothing resolved at install time. The
# SGLang server has its own environment (scripts/engine_env.sh: sglang pins another torch).
# Cached outside the clone, keyed by the hash of both files, built once under a lock. The
# build needs no GPU, but ~15-30 min on few cores if Transformer Engine's PyTorch extension is
# compiled (its setup first tries NVIDIA's prebuilt wheel for this torch); ~10 GB.
#   MGSPO_CACHE   where venvs are kept (default ~/.cache/megatron-gspo)
#   MAX_JOBS      parallel compile jobs for that build (default: number of cores)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
hash=$(cat "$root/constraints.txt" "$root/constraints-gpu.txt" | sha256sum | cut -c1-16)
TE_EXT=transformer-engine-torch  # the one sdist: built last, against the installed torch

pins() { grep -hvE '^\s*(#|$)' "$@"; }

if [ "${1:-}" = "--dry-run" ]; then
  # The CPU venv has torch, which transformer-engine-torch's setup.py imports even to report
  # its metadata; --no-build-isolation lets it use that torch instead of fetching one.
  py="$(bash "$root/scripts/env.sh")/bin/python"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  pip_q=(-m pip --disable-pip-version-check -q)
  echo "[gpu-env] every pin exists for $("$py" -c 'import sys; print(sys.version.split()[0])')" \
    "on linux x86_64 (pip install --dry-run --no-deps)" >&2
  NVTE_FRAMEWORK=pytorch "$py" "${pip_q[@]}" install --dry-run --no-deps --ignore-installed \
    --no-build-isolation -r "$root/constraints.txt" -r "$root/constraints-gpu.txt" >&2
  echo "[gpu-env] the additions are closed under their dependencies, within both locks" >&2
  # nvidia-nccl-cu13 is pinned to the engine's version, not torch 2.13's exact Requires-Dist
  # (constraints.txt says why): left to the resolver here, and not compared below.
  pins "$root/constraints.txt" "$root/constraints-gpu.txt" | grep -v '^nvidia-nccl-' > "$tmp/all.txt"
  NVTE_FRAMEWORK=pytorch "$py" "${pip_q[@]}" install --dry-run --ignore-installed \
    --no-build-isolation --report "$tmp/report.json" -c "$tmp/all.txt" \
    "transformer-engine[pytorch,core_cu13]" nvidia-cuda-nvcc nvidia-cuda-cccl ninja >&2
  "$py" - "$tmp/report.json" "$tmp/all.txt" <<'PY'
import json, re, sys

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
pinned = {norm(n): v for n, v in (l.split("==") for l in open(sys.argv[2]).read().split())}
missing = [
    f"{m['name']}=={m['version']}"
    for m in (i["metadata"] for i in json.load(open(sys.argv[1]))["install"])
    if pinned.get(norm(m["name"])) != m["version"] and not norm(m["name"]).startswith("nvidia-nccl-")
]
if missing:
    sys.exit(f"[gpu-env] resolved but not pinned (add to constraints-gpu.txt): {missing}")
print("[gpu-env] dry run ok: constraints.txt + constraints-gpu.txt resolve", file=sys.stderr)
PY
  exit 0
fi

source "$root/scripts/venv_lib.sh"

install_gpu() {
  local vpy="$1/bin/python"
  pins "$root/constraints.txt" "$root/constraints-gpu.txt" | grep -v "^$TE_EXT==" > "$1/.pins"
  "$vpy" -m pip install -q --disable-pip-version-check --no-deps -r "$1/.pins"
  # nvcc, the CUDA headers and cuDNN come from the NVIDIA wheels just installed (TE's build
  # finds them under site-packages/nvidia); a system toolkit in CUDA_HOME is used if set.
  # Compiling TE's extension (when no prebuilt wheel matches) can take ~30 min on few cores.
  NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-$(nproc)} "$vpy" -m pip install \
    --disable-pip-version-check --no-deps --no-build-isolation \
    "$(grep -hE "^$TE_EXT==" "$root/constraints-gpu.txt")"
  # fail here, not in the first training step
  "$vpy" -c 'import transformer_engine.pytorch, megatron.core, megatron.bridge'
}

mgspo_cached_venv gpu-venv "$hash" install_gpu
