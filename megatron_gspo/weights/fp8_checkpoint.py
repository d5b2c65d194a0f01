"""Write the block-FP8 engine checkpoint of a BF16 HF checkpoint (what FP8 recipes start from).

    python tools/fp8_checkpoint.py --src BF16_DIR --out FP8_DIR [--config-only]

Every decoder linear weight (`fp8.is_quantised_name`) becomes `q` (float8_e4m3fn, 128x128
blocks) plus `<name>_scale_inv` (fp32 `[ceil(N/128), ceil(K/128)]`), quantised by the same
`fp8.quantise_blockwise` that the weight sync sends with, so the engine starts from exactly the
layout (parameter names, dtypes, block size) each later push loads into; everything else
(norms, the MoE router, embeddings, lm_head) is copied unchanged. config.json gets the
`quantization_config` SGLang and DeepSeek-style FP8 checkpoints carry
(`fp8.quantization_config_for`: quant_method fp8, fmt e4m3, dynamic activations,
weight_block_size [128, 128], the unquantised modules). Tokenizer and generation files are
copied. Shards are processed one at a time (peak memory: one BF16 shard and its FP8 copy).
`--config-only` writes config.json alone (planning without weights).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from megatron_gspo.weights import fp8 as fp8_lib

_COPIED = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
           "special_tokens_map.json", "generation_config.json", "added_tokens.json")  # fmt: skip


def fp8_config(src_config: dict) -> dict:
    """config.json of the FP8 checkpoint: the BF16 one plus its `quantization_config`."""
    out = dict(src_config)
    out["quantization_config"] = fp8_lib.quantization_config_for(src_config)
    return out


def write_fp8_checkpoint(src: str | Path, out: str | Path, *, config_only: bool = False) -> Path:
    """Quantise `src` (a BF16/FP32 HF checkpoint directory) into `out`; returns `out`."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantised: {config['quantization_config']}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(fp8_config(config), indent=2) + "\n")
    if config_only:
        return out
    for name in _COPIED:
        if (src / name).exists():
            shutil.copy2(src / name, out / name)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    weight_map: dict[str, str] = {}
    for f in files:
        tensors: dict[str, torch.Tensor] = {}
        for name, t in load_file(str(f)).items():
            for n, x in fp8_lib.quantise_named(name, t, other_dtype=t.dtype, check=True):
                tensors[n] = x.contiguous()
                weight_map[n] = f.name
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True, help="BF16 HF checkpoint directory")
    p.add_argument("--out", required=True, help="where the FP8 checkpoint is written")
    p.add_argument("--config-only", action="store_true", help="write config.json only")
    args = p.parse_args(argv)
    out = write_fp8_checkpoint(args.src, args.out, config_only=args.config_only)
    print(f"fp8 checkpoint: {out}")


if __name__ == "__main__":
    main()
