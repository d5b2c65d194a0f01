"""Independent references for the rollout tests (plain HF forward passes, no engine code)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch


def hf_model(path_or_weights, ckpt: str | None = None):
    """A HF model from a checkpoint dir, or `ckpt`'s config with HF-named `weights`.

    The weights go through a safetensors file and `from_pretrained`, so transformers' own
    checkpoint conversion (e.g. fused MoE experts) is the reference, not the engine's.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if isinstance(path_or_weights, str):
        return AutoModelForCausalLM.from_pretrained(path_or_weights, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        for f in ("config.json", "generation_config.json"):
            shutil.copy(Path(ckpt) / f, Path(tmp) / f)
        weights = {k: v.contiguous() for k, v in path_or_weights.items()}
        save_file(weights, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


@torch.no_grad()
def rescore(
    model, prompt: Sequence[int], response: Sequence[int], temperature: float = 1.0
) -> list[float]:
    """log_softmax(logits / T) of each response token from ONE full forward pass, in float64."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(input_ids=ids).logits[0].double()
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    lp = torch.log_softmax(logits[pos] / temperature, -1)
    return lp[torch.arange(len(response)), torch.tensor(list(response))].tolist()


@torch.no_grad()
def greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by repeated full forwards (no KV cache), EOS ignored."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]
