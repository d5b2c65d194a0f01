"""A Hugging Face model directory checked as the loaders will read it, before anything starts.

`check_model_files(path)` reads only what is cheap: the safetensors index, every shard's header
(8 bytes + a JSON header, a few KB to a few MB per shard) and, per tensor, its first and last
`SAMPLE_BYTES` bytes (two small reads). It finds what megatron-bridge would otherwise meet
after start-up, on every rank, as a traceback naming one tensor: a shard the index names that
is missing, empty (an interrupted download) or truncated, a header that does not parse, a
tensor the index places in a shard that lacks it, embeddings or layers that do not match
config.json, a non-float weight, an inf / NaN among the sampled values, a tokenizer with ids
past the model's vocabulary. Each problem is one `ConfigError` line naming the file and the fix.

Cost, measured on a synthetic Qwen3-30B-A3B directory (16 shards, 18,867 tensors, 61 GB:
`benchmarks/startup_validation.py`, table in docs/reliability.md): 0.7 s of CPU warm, 37,734
reads of 256 bytes (9.2 MiB), ~20 s of a loaded machine's cold disk; reading every value
instead would take half an hour there.

    check_model_files("/models/Qwen3-30B-A3B")   # None, or ConfigError("<file>: ...")
    weights_present("/models/Qwen3-30B-A3B")     # the same as one line, or None
    model_files_problem("/models/Qwen3-30B-A3B") # presence only (headers): the launch planner

`model_files_problem` is the planner's cheaper question (issue 35: the recipes ship only
config.json; are the weight files there, non-empty, with a readable header?), asked before
any engine starts; it reads no values and does not compare with config.json, which lets the
planner's tests use header-only stand-ins. Both read headers through `_parse_header`.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from megatron_gspo.config_io import ConfigError, require

__all__ = [
    "SAMPLE_BYTES",
    "check_model_files",
    "estimate_checkpoint_bytes",
    "model_files_problem",
    "weights_present",
]

SAMPLE_BYTES = 256
"""Bytes read at each end of every tensor for the finite-value check."""

_FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_ALL_DTYPES = _FLOAT_DTYPES | {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def weights_present(path: str | Path) -> str | None:
    """The one-line problem with the model directory's weight files, or None when they are
    all there and sound (what the launch planner and the Slurm scripts ask before a launch)."""
    try:
        check_model_files(path)
    except ConfigError as e:
        return str(e)
    return None


def check_model_files(path: str | Path, key: str = "model.hf_path") -> dict[str, Any]:
    """Check the weight files and tokenizer of the model directory `path` (see the module
    docstring); returns the tensors' headers by name (`dtype`, `shape`). Raises ConfigError
    naming the file and the fix."""
    root = Path(path)
    config = _read_json(root / "config.json", key)
    shards = _shards(root, key)
    tensors: dict[str, Any] = {}
    for shard, expected in shards.items():
        header = _read_header(shard, key)
        if expected is not None:
            lacking = sorted(set(expected) - set(header))
            require(
                not lacking,
                f"{shard}: lacks {len(lacking)} tensor(s) model.safetensors.index.json places "
                f"in it ({', '.join(lacking[:3])}); download the shard again",
            )
        _check_values(shard, header)
        tensors |= header
    _check_against_config(root, config, tensors)
    _check_tokenizer(root, config)
    return tensors


def estimate_checkpoint_bytes(tensors: dict[str, Any], optimizer: str = "adam") -> int:
    """Bytes one trainer checkpoint of these weights takes (estimated): fp32 parameters plus
    the optimizer's fp32 state (Adam: two moments; SGD: one momentum buffer)."""
    params = sum(math.prod(t["shape"]) for t in tensors.values())
    copies = 3 if optimizer == "adam" else 2
    return params * 4 * copies


def _read_json(path: Path, key: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing; check {key}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as JSON ({e}); check {key}") from None


def _shards(root: Path, key: str) -> dict[Path, list[str] | None]:
    """Each weight file the loaders will open, with the tensors the index places in it (None
    for a single unindexed file)."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        data = _read_json(index, key)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index}: has no 'weight_map'; download the model again")
        out: dict[Path, list[str] | None] = {}
        for name, file in sorted(weight_map.items()):
            shard = root / str(file)
            names = out.setdefault(shard, [])
            assert names is not None
            names.append(name)
        return out
    files = sorted(root.glob("*.safetensors"))
    require(
        bool(files) or any(root.glob("*.bin")),
        f"{root}: no *.safetensors or *.bin weights; add them, or set model.load_weights=false "
        "to train from random weights",
    )
    return {f: None for f in files}


class _Unreadable(Exception):
    """Why a safetensors file cannot be loaded: `short` for the planner's list of files,
    `detail` and `fix` for the start-up check's one line."""

    def __init__(self, short: str, detail: str, fix: str = "download it again") -> None:
        super().__init__(detail)
        self.short, self.detail, self.fix = short, detail, fix


def _parse_header(shard: Path) -> tuple[int, int, dict[str, Any]]:
    """(file size, header length, header) of the safetensors file `shard`, reading only its
    8-byte length and its JSON header; raises `_Unreadable`. The one header reader of both
    the start-up check (`_read_header`) and the planner's presence check."""
    try:
        size = shard.stat().st_size
    except FileNotFoundError:
        named = "missing, but model.safetensors.index.json names it"
        raise _Unreadable("missing", named) from None
    except OSError as e:
        why = e.strerror or str(e)
        raise _Unreadable(f"unreadable ({why})", f"cannot be read ({why})") from None
    if not shard.is_file():
        raise _Unreadable("missing", "not a file")
    if size == 0:
        raise _Unreadable("empty", "empty (0 bytes; an interrupted download?)")
    try:
        with shard.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _Unreadable(
                    "truncated (no safetensors header)",
                    f"{size} bytes, too short for a safetensors file",
                )
            (n,) = struct.unpack("<Q", head)
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                raise _Unreadable(
                    "not a safetensors file (header length out of range)",
                    f"not a safetensors file (header length {n} for {size} bytes)",
                )
            raw = f.read(n)
    except PermissionError:
        raise _Unreadable(
            "unreadable (permission denied)", "not readable (permission denied)", "fix its mode"
        ) from None
    except OSError as e:
        why = e.strerror or str(e)
        raise _Unreadable(f"unreadable ({why})", f"cannot be read ({why})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        bad = "not a safetensors file (bad header)"
        raise _Unreadable(bad, "its safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        bad = "not a safetensors file (bad header)"
        raise _Unreadable(bad, "its safetensors header is not a mapping")
    return size, n, header


def _read_header(shard: Path, key: str) -> dict[str, Any]:
    """The shard's tensors (`__metadata__` dropped), after checking that the file is present,
    non-empty, readable and long enough for every tensor its header lists."""
    fix = "download it again"
    try:
        size, n, header = _parse_header(shard)
    except _Unreadable as e:
        raise ConfigError(f"{shard}: {e.detail}; {e.fix}") from None
    header.pop("__metadata__", None)
    end = 0
    for name, t in header.items():
        ok = (
            isinstance(t, dict)
            and t.get("dtype") in _ALL_DTYPES
            and isinstance(t.get("shape"), list)
            and isinstance(t.get("data_offsets"), list)
            and len(t["data_offsets"]) == 2
        )
        require(ok, f"{shard}: tensor {name!r} has a malformed header entry; {fix}")
        begin, stop = t["data_offsets"]
        nbytes = math.prod(t["shape"]) * _ALL_DTYPES[t["dtype"]]
        require(
            stop - begin == nbytes,
            f"{shard}: tensor {name!r} spans {stop - begin} bytes, its shape needs {nbytes}; {fix}",
        )
        end = max(end, stop)
    require(
        size >= 8 + n + end,
        f"{shard}: {size} bytes, its header needs {8 + n + end} (truncated); {fix}",
    )
    t0 = 8 + n
    for t in header.values():
        t["start"] = t0 + t["data_offsets"][0]
    return header


def _as_float(raw: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        u = np.frombuffer(raw[: len(raw) // 2 * 2], dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32)
    return np.frombuffer(raw, dtype={"F64": "<f8", "F32": "<f4", "F16": "<f2"}[dtype])


def _check_values(shard: Path, header: dict[str, Any]) -> None:
    """Inf / NaN among the first and last SAMPLE_BYTES of every float tensor (FP8 skipped: its
    formats have no inf, and a block-scaled checkpoint's scales are checked as F32)."""
    with shard.open("rb") as f:
        for name, t in header.items():
            dtype = t["dtype"]
            if dtype not in ("F64", "F32", "F16", "BF16"):
                continue
            width = _FLOAT_DTYPES[dtype]
            nbytes = t["data_offsets"][1] - t["data_offsets"][0]
            take = min(nbytes, SAMPLE_BYTES) // width * width
            spans = {(t["start"], take), (t["start"] + nbytes - take, take)}
            for offset, count in spans:
                f.seek(offset)
                values = _as_float(f.read(count), dtype)
                require(
                    bool(np.isfinite(values).all()),
                    f"{shard}: tensor {name!r} holds inf or NaN values; the weights are "
                    "damaged or diverged: use a sound model directory",
                )


def _check_against_config(root: Path, config: Any, tensors: dict[str, Any]) -> None:
    """Embeddings, head, layer count and dtypes against config.json (what the bridge builds
    the model from)."""
    where = root / "config.json"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors and vocab and hidden:
            shape = tensors[name]["shape"]
            require(
                shape == [vocab, hidden],
                f"{root}: {name} has shape {shape}, {where.name} says [vocab_size, hidden_size]"
                f" = [{vocab}, {hidden}]; the weights and {where} are of different models",
            )
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int):
        seen = {int(p.split(".")[2]) for p in tensors if p.startswith("model.layers.")}
        if seen:
            require(
                seen == set(range(layers)),
                f"{root}: the weights hold layers {_span(seen)}, {where.name} says "
                f"num_hidden_layers={layers}; the weights and {where} are of different models",
            )
    for name, t in tensors.items():
        require(
            t["dtype"] in _FLOAT_DTYPES or not name.endswith(".weight"),
            f"{root}: weight {name!r} is stored as {t['dtype']}, not a float type; use a "
            "checkpoint in bf16, fp16 or fp32",
        )


def _span(seen: set[int]) -> str:
    return f"{min(seen)}..{max(seen)} ({len(seen)} of them)"


def _check_tokenizer(root: Path, config: Any) -> None:
    """The tokenizer's largest id fits the model's vocabulary (an id past it would index past
    the embedding in the engine and the trainer)."""
    path = root / "tokenizer.json"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab = text.get("vocab_size")
    if not path.exists() or not isinstance(vocab, int):
        return
    data = _read_json(path, "model.hf_path")
    model = data.get("model") if isinstance(data, dict) else None
    ids = [a.get("id", -1) for a in data.get("added_tokens") or [] if isinstance(a, dict)]
    table = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(table, dict):
        ids += [v for v in table.values() if isinstance(v, int)]
    elif isinstance(table, list):  # Unigram: [[piece, score], ...], ids are positions
        ids.append(len(table) - 1)
    top = max(ids, default=-1)
    require(
        top < vocab,
        f"{path}: token id {top} is past the model's vocab_size={vocab} ({root / 'config.json'});"
        " the tokenizer is of another model: use the model's own tokenizer",
    )


# --- presence only: the launch planner (megatron_gspo/plan/launch.py) ---------------------

INDEX = "model.safetensors.index.json"


def _presence_problem(f: Path) -> str | None:
    """Why the safetensors file `f` cannot be loaded (missing, empty, unreadable, a header
    that is not one), or None. Reads only the 8-byte length and the JSON header."""
    try:
        _parse_header(f)
    except _Unreadable as e:
        return e.short
    return None


def model_files_problem(path: str | Path, key: str = "model.hf_path") -> str | None:
    """One line naming what is wrong with the weights of the Hugging Face model directory
    `path` (`key`: the config key that names it), or None when every weight file is there:
    with `model.safetensors.index.json`, every file its `weight_map` names is present,
    non-empty and has a readable safetensors header; without one, at least one
    `*.safetensors` file does and all present ones do."""
    d = Path(path)
    fix = (
        f"download the checkpoint into it or point {key} at one (the recipes' directories "
        "hold only config.json, for planning)"
    )
    if not d.is_dir():
        return f"{key}={path}: no such directory; {fix}"
    if not (d / "config.json").is_file():
        return f"{key}={path}: no config.json; not a Hugging Face model directory"
    index = d / INDEX
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{index}: unreadable weight_map ({type(e).__name__}); re-download it"
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
        if not files:
            return f"{key}={path}: no *.safetensors weights; {fix}"
    bad = [(f, why) for f in files if (why := _presence_problem(d / f)) is not None]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        f, why = bad[0]
        return f"{key}={path}: weight file {f} {why}{more}; {fix}"
    return None
