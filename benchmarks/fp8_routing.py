"""FP8 routing check (issue 37, plan S6): do the FP8-emulated engine and the fp32 trainer route
the same tokens to the same experts?

    python benchmarks/fp8_routing.py --model step0=T/model --model step100=CK/hf \
        --data T/pattern.jsonl --json docs/evidence/fp8_routing/routing.json

For each model (HF directories: the study's initial model, a run's final HF export), the fp32
model samples `--sequences` responses of `--length` tokens (T = 1, the pattern task's prompts,
`benchmarks/mismatch_sources.py`'s sampler) and the full sequences (prompt + response) are
forwarded again by three variants of the same weights (HF transformers, in-process, CPU):

    fp32   fp32 weights and compute (the trainer's routing: the reference)
    fp8    the embedded engine's block-FP8 emulation (`engines/embedded/fp8_emulation.py`:
           e4m3 decoder GEMMs; the router itself stays fp32, its input is FP8-computed)
    bf16   bf16 weights and compute (what a bf16 engine routes; for scale)

A hook on every MoE layer's router records its logits and top-k experts. Per variant: the share
of (token, MoE layer) whose top-k expert set differs from fp32's (overall and per layer), and
the mean |logp_variant - logp_fp32| per response token. Per model: the fp32 router's margin
between its k-th and (k+1)-th logit (median, and the share of (token, layer) below 1e-2 and
1e-3: near ties, which any rounding can flip). The JSON also records the command, commit, seed
and load average, so the result can be reproduced.
"""

from __future__ import annotations

if __name__ == "__main__":
    import sys
    from pathlib import Path

    _root = str(Path(__file__).resolve().parents[1])
    if _root not in sys.path:
        sys.path.insert(0, _root)

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.mismatch_sources import load, prompts, response_logits, sample
from benchmarks.provenance import provenance


class RouteRecorder:
    """Forward hooks on every `mlp.gate` (transformers' Qwen3-MoE top-k router): per forward,
    a list over MoE layers of (router logits [T, E], top-k expert indices [T, k])."""

    def __init__(self, model: Any) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = []
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                self.handles.append(gate.register_forward_hook(self._hook))

    def _hook(self, _mod: Any, _inp: Any, out: Any) -> None:
        logits, _scores, idx = out
        self.calls.append((logits.detach().double(), idx.detach()))

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out, self.calls = self.calls, []
        return out


def _sets(idx: torch.Tensor) -> torch.Tensor:
    """[T, k] expert indices -> [T, k] sorted (set comparison by equality of rows)."""
    return torch.sort(idx, dim=-1).values


def disagreement(
    ref: list[list[tuple[torch.Tensor, torch.Tensor]]],
    var: list[list[tuple[torch.Tensor, torch.Tensor]]],
) -> list[float]:
    """Per MoE layer, the share of tokens whose top-k expert set differs between two recordings
    of the same sequences (order within the top k ignored)."""
    n_layers = len(ref[0])
    per_layer, count = [0.0] * n_layers, 0
    for ref_seq, var_seq in zip(ref, var, strict=True):
        for j, ((_, ri), (_, vi)) in enumerate(zip(ref_seq, var_seq, strict=True)):
            per_layer[j] += float((_sets(ri) != _sets(vi)).any(-1).sum())
        count += ref_seq[0][1].shape[0]
    return [x / count for x in per_layer]


def measure(model: Any, seqs: list[list[int]], plen: list[int]) -> dict[str, Any]:
    """Route and log-prob agreement of the fp8 and bf16 variants with fp32 on `seqs`."""
    from megatron_gspo.engines.embedded.fp8_emulation import emulate

    fp8 = copy.deepcopy(model)
    emulate(fp8, "fp8")
    variants = {"fp32": model, "fp8": fp8, "bf16": copy.deepcopy(model).to(torch.bfloat16)}
    routes: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}
    logps: dict[str, list[torch.Tensor]] = {}
    for name, m in variants.items():
        rec = RouteRecorder(m)
        routes[name], logps[name] = [], []
        for ids, p in zip(seqs, plen, strict=True):
            logits = response_logits(m, ids, p)
            tgt = torch.tensor(ids[p:])
            logps[name].append(torch.log_softmax(logits, -1).gather(1, tgt[:, None])[:, 0])
            routes[name].append(rec.take())
        for h in rec.handles:
            h.remove()
    n_layers = len(routes["fp32"][0])
    out: dict[str, Any] = {"moe_layers": n_layers, "tokens": sum(len(s) for s in seqs)}
    margins = []
    for per_seq in routes["fp32"]:
        for logits, idx in per_seq:
            k = idx.shape[1]
            top = torch.topk(logits, k + 1, dim=-1).values
            margins += (top[:, k - 1] - top[:, k]).tolist()
    out["fp32_margin_median"] = statistics.median(margins)
    out["fp32_margin_below_1e-2"] = sum(m < 1e-2 for m in margins) / len(margins)
    out["fp32_margin_below_1e-3"] = sum(m < 1e-3 for m in margins) / len(margins)
    for name in ("fp8", "bf16"):
        per_layer = disagreement(routes["fp32"], routes[name])
        dlogp = torch.cat([(a - b).abs() for a, b in zip(logps[name], logps["fp32"], strict=True)])
        out[name] = {
            "route_disagreement": sum(per_layer) / n_layers,
            "route_disagreement_per_layer": per_layer,
            "abs_dlogp_token": float(dlogp.mean()),
        }
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="label=HF dir (repeatable)")
    p.add_argument("--data", required=True, help="pattern-task jsonl (the prompts)")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results and provenance here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for spec in a.model:
        label, _, path = spec.partition("=")
        model = load(path, 1.0)
        ps = prompts(a.data, path, a.sequences)
        seqs = sample(model, ps, a.length, a.seed)
        r = {"model": label, "path": path, **measure(model, seqs, [len(x) for x in ps])}
        print(json.dumps(r), flush=True)
        results.append(r)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"provenance": provenance(sys.argv, seed=a.seed), "results": results}
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
