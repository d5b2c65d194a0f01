"""What the start-up validation of the model files costs on a Qwen3-30B-A3B-sized directory
(issue 40: "say what it costs on the 30B model's files, and sample where reading everything
would take minutes").

    python benchmarks/startup_validation.py                 # builds the directory in a tmp dir
    python benchmarks/startup_validation.py --keep DIR      # ... in DIR, kept for reruns

The directory is synthetic but has the real layout: `examples/recipes/qwen3-30b-a3b/config.json`,
16 safetensors shards with the checkpoint's 18,867 tensor names, shapes and bf16 dtype (48
layers x (128 experts x 3 + 9) + embeddings, norm, head), consecutive layers per shard, and
an index naming them. Each shard is a sparse file of its full size (61 GB in all, ~0 on disk):
its headers are real, its values zeros. Measured in this process, each median of 3:

* `model_files_problem` (the planner: the index and every header);
* `check_model_files` (preflight: headers, every entry against its shard, config.json, and
  the first and last 256 bytes of every tensor), warm: the values are the page cache's zero
  pages, so this is the check's own cost (parsing, seeks, syscalls), not the disk's;
* the disk, on a real 256 MiB file of this machine with its pages dropped (posix_fadvise
  DONTNEED, this file only): random 4 KiB reads per second and sequential MiB/s; from them,
  the sampled check's reads on a cold disk, and reading every value (61 GB) instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from megatron_gspo.plan.model_files import (  # noqa: E402
    SAMPLE_BYTES,
    check_model_files,
    model_files_problem,
)

SHARDS = 16


def tensors(cfg: dict) -> list[tuple[str, list[int]]]:
    """Qwen3-MoE's HF tensor names and shapes for `cfg` (config.json), in checkpoint order."""
    h, v, e = cfg["hidden_size"], cfg["vocab_size"], cfg["num_experts"]
    heads, kv, d, f = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], \
        cfg["moe_intermediate_size"]  # fmt: skip
    out = [("model.embed_tokens.weight", [v, h])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", [h]),
            (p + "post_attention_layernorm.weight", [h]),
            (p + "self_attn.q_proj.weight", [heads * d, h]),
            (p + "self_attn.k_proj.weight", [kv * d, h]),
            (p + "self_attn.v_proj.weight", [kv * d, h]),
            (p + "self_attn.o_proj.weight", [h, heads * d]),
            (p + "self_attn.q_norm.weight", [d]),
            (p + "self_attn.k_norm.weight", [d]),
            (p + "mlp.gate.weight", [e, h]),
        ]
        for j in range(e):
            out += [
                (p + f"mlp.experts.{j}.gate_proj.weight", [f, h]),
                (p + f"mlp.experts.{j}.up_proj.weight", [f, h]),
                (p + f"mlp.experts.{j}.down_proj.weight", [h, f]),
            ]
    return out + [("model.norm.weight", [h]), ("lm_head.weight", [v, h])]


def build(root: Path) -> tuple[int, int, int]:
    """The synthetic directory; returns (tensors, header bytes, value bytes)."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((ROOT / "examples/recipes/qwen3-30b-a3b/config.json").read_text())
    shutil.copy(ROOT / "examples/recipes/qwen3-30b-a3b/config.json", root / "config.json")
    names = tensors(cfg)
    per = math.ceil(len(names) / SHARDS)
    weight_map, header_bytes, value_bytes = {}, 0, 0
    for s in range(SHARDS):
        part = names[s * per : (s + 1) * per]
        file = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in part:
            n = math.prod(shape) * 2
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = file
        raw = json.dumps(header).encode()
        with open(root / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)  # sparse: the values read as zeros
        header_bytes, value_bytes = header_bytes + len(raw), value_bytes + offset
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return len(names), header_bytes, value_bytes


def timed(fn: object, *args: object) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process), medians of 3 runs: on a loaded machine the
    wall time is mostly waiting for a core, the CPU time is the check's own."""
    wall, cpu = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        fn(*args)  # type: ignore[operator]
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def disk(where: Path) -> tuple[float, float]:
    """(random 4 KiB reads per second, sequential MiB/s) of a 256 MiB file with its pages
    dropped before each measurement."""
    path, size = where / "disk_probe.bin", 256 * 2**20
    with open(path, "wb") as f:
        for _ in range(size // 2**20):
            f.write(os.urandom(2**20))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0, n = time.perf_counter(), 2000
        for _ in range(n):
            os.pread(fd, 4096, random.randrange(0, size - 4096) // 4096 * 4096)
        iops = n / (time.perf_counter() - t0)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.read(fd, 8 * 2**20):
            pass
        mib_s = size / 2**20 / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return iops, mib_s


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", type=Path, default=None, help="build the directory here, keep it")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="mgspo_30b_"))
    root = args.keep or tmp / "model"
    try:
        count, header_bytes, value_bytes = build(root)
        assert model_files_problem(root) is None
        check_model_files(root)  # a sound directory passes (and the cache is warm)
        presence = timed(model_files_problem, root)
        full = timed(check_model_files, root)
        iops, mib_s = disk(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    reads = 2 * count  # the first and last SAMPLE_BYTES of every tensor
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"synthetic Qwen3-30B-A3B: {SHARDS} shards, {count} tensors, "
          f"{header_bytes / 2**20:.1f} MiB of headers, {value_bytes / 1e9:.1f} GB of values")
    print(f"{'what':58s} {'wall s':>8s} {'CPU s':>8s}")
    print(f"{'model_files_problem (index + headers; the planner)':58s} {presence[0]:8.2f} "
          f"{presence[1]:8.2f}")
    print(f"{f'check_model_files, warm (+ {reads} reads of {SAMPLE_BYTES} B)':58s} "
          f"{full[0]:8.2f} {full[1]:8.2f}")
    print(f"{f'  its reads on a cold disk, at {iops:.0f} random reads/s':58s} "
          f"{reads / iops:8.1f}")
    print(f"{f'reading every value instead, at {mib_s:.0f} MiB/s':58s} "
          f"{value_bytes / 2**20 / mib_s:8.0f}")
    print(f"sampled bytes: {reads * SAMPLE_BYTES / 2**20:.1f} MiB of {value_bytes / 2**20:.0f} "
          f"MiB ({reads * SAMPLE_BYTES / value_bytes:.1e} of the values)")


if __name__ == "__main__":
    main()
