#!/usr/bin/env bash
# What tests/gpu/device_check.py needs beyond torch + Triton, for a GPU machine with no network:
# run this where pip reaches PyPI, carry .whl/ over (under 64 MiB), then there:
#     pip install --no-deps --no-index .whl/*.whl
#     PYTHONPATH=.:.whl/sglang-src python tests/gpu/device_check.py --out device_check.json
#
# Wheels (manylinux x86_64, CPython 3.12; versions from constraints.txt; sizes as downloaded
# on 2026-12-03; 18.6 MiB in all with the SGLang files):
#   megatron-core 0.19.2   2.4 MB   the model, DDP, distributed optimizer, dist-checkpointing
#   numpy 2.5.5           15.7 MB   megatron-core imports it; SGLang's sha256 branch uses it
#   PyYAML 6.0.4           0.8 MB   megatron_gspo.config
#   packaging 26.4         0.1 MB   megatron-core
#   psutil 7.2.2           0.2 MB   megatron-core's dist-checkpointing writer workers
# and .whl/sglang-src/: SGLang 0.5.23's hash functions, four source files taken out of its
# wheel (kernels/ops/memory/gpu_tensor_hash.py run whole; of the other three only tensor_hash,
# _hash_tensor, overall_checksum and flatten_nested_list are compiled), 0.26 MB. The whole sglang wheel (36 MiB) and the
# imports of `sglang.srt` (transformers, orjson, psutil, pydantic, msgspec, ...) do not fit in
# 64 MiB; device_check.py uses the full package when it imports and these files otherwise
# (its JSON says which: hash.sglang).
# megatron-bridge is not needed: the check builds the tiny MoE with megatron-core directly
# (no Transformer Engine there either).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$root/.whl}"
pip="${PIP:-python3 -m pip}"
pin() { grep -i -m1 "^$1==" "$root/constraints.txt" | tr -d '[:space:]'; }
mkdir -p "$out"
$pip download --no-deps --only-binary=:all: --dest "$out" \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  "$(pin megatron-core)" "$(pin numpy)" "$(pin PyYAML)" "$(pin packaging)" "$(pin psutil)"
# SGLang's hash functions only: fetched into a scratch directory, four files kept.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
$pip download --no-deps --only-binary=:all: --dest "$tmp" \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_34_x86_64 --platform any "$(pin sglang)"
python3 - "$tmp"/sglang-*.whl "$out/sglang-src" <<'EOF'
import sys, zipfile
from pathlib import Path

wheel, dest = sys.argv[1], Path(sys.argv[2])
keep = [
    "sglang/kernels/ops/memory/gpu_tensor_hash.py",
    "sglang/srt/managers/mm_utils.py",
    "sglang/srt/utils/weight_checker.py",
    "sglang/srt/utils/common.py",
]
with zipfile.ZipFile(wheel) as z:
    for name in keep:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(z.read(name))
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    version = next(l for l in z.read(meta).decode().splitlines() if l.startswith("Version:"))
(dest / "VERSION").write_text(version.split(":", 1)[1].strip() + "\n")
print(f"{dest}: {len(keep)} files of {Path(wheel).name}")
EOF
du -ch "$out"/*.whl "$out/sglang-src" | tail -1
