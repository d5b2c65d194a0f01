"""Write HF checkpoint directories: safetensors shards + index, config.json, tokenizer files.

Used by the disk transport (one shard per bucket) and by the Megatron -> HF converter.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge
    from transformers import PretrainedConfig

INDEX_NAME = "model.safetensors.index.json"
# Everything a HF directory carries besides weights and config: tokenizer, chat template,
# generation defaults. Copied verbatim so the written checkpoint serves like the original.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class ShardWriter:
    """Write HF-named tensors as `model-XXXXX.safetensors` shards and the index at `close()`."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.weight_map: dict[str, str] = {}
        self.total_size = 0
        self._n = 0

    def write(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Write one shard; returns its file name."""
        from safetensors.torch import save_file

        fname = f"model-{self._n:05d}.safetensors"
        self._n += 1
        data = {}
        for name, t in tensors:
            if name in self.weight_map or name in data:
                raise ValueError(f"tensor {name!r} written twice")
            data[name] = t.detach().to("cpu").contiguous()
            self.total_size += t.numel() * t.element_size()
        save_file(data, str(self.out_dir / fname), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(data, fname))
        return fname

    def close(self) -> None:
        index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))


def write_config(
    out_dir: str | Path,
    config: PretrainedConfig | Mapping[str, Any],
    *,
    dtype: torch.dtype | None = None,
    quantization_config: dict | None = None,
) -> None:
    """config.json from a `PretrainedConfig` (or a dict), with dtype / FP8 settings applied."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        cfg["torch_dtype"] = name
        cfg["dtype"] = name
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    else:
        cfg.pop("quantization_config", None)
    Path(out_dir, "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def copy_side_files(src_dir: str | Path | None, out_dir: str | Path) -> list[str]:
    """Copy tokenizer / generation files that exist in `src_dir`; returns the names copied."""
    if src_dir is None or not Path(src_dir).is_dir():
        return []
    copied = []
    for name in SIDE_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(out_dir) / name)
            copied.append(name)
    return copied


def hf_config_of(bridge: AutoBridge) -> PretrainedConfig:
    """The `PretrainedConfig` of an `AutoBridge` (built from a checkpoint or from a config)."""
    hf = bridge.hf_pretrained
    return getattr(hf, "config", hf)


def hf_source_dir(bridge: AutoBridge) -> Path | None:
    """The local directory an `AutoBridge` was loaded from, if it was a local path."""
    hf = getattr(bridge, "hf_pretrained", None)
    path = getattr(hf, "model_name_or_path", None) or getattr(hf, "_model_name_or_path", None)
    return Path(path) if path is not None and Path(path).is_dir() else None


def write_fp8_checkpoint(
    src_dir: str | Path, out_dir: str | Path, *, shard_bytes: int = 2 * 1024**3
) -> Path:
    """Block-FP8 copy of a HF checkpoint, for launching an FP8 engine that FP8 sync can update.

    An engine builds FP8 parameters (and `weight_scale_inv`) only when its checkpoint's
    config.json carries a `quantization_config`; the sync then sends exactly those tensors.
    Decoder linear weights become e4m3 with 128x128 block scales (`fp8.quantise_named`),
    everything else BF16; config.json gets `fp8.quantization_config_for` of the source config;
    tokenizer files are copied.
    """
    from safetensors import safe_open

    from megatron_gspo.weights import fp8

    src, out = Path(src_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    writer = ShardWriter(out)
    shard: list[tuple[str, torch.Tensor]] = []
    size = 0
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                for n, t in fp8.quantise_named(name, fh.get_tensor(name), check=True):
                    shard.append((n, t))
                    size += t.numel() * t.element_size()
                if size >= shard_bytes:
                    writer.write(shard)
                    shard, size = [], 0
    if shard:
        writer.write(shard)
    writer.close()
    write_config(
        out, config, dtype=torch.bfloat16, quantization_config=fp8.quantization_config_for(config)
    )
    copy_side_files(src, out)
    return out
