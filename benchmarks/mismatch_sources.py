"""Where the engine/trainer log-prob mismatch comes from, and why it grows during training.

    python benchmarks/mismatch_sources.py --model step0=runs/task/model --model step60=hf60
    python benchmarks/mismatch_sources.py --model step0=DIR --scales 1,2,4   # logit scale alone

For each model (HF checkpoints, e.g. a run's checkpoints converted with
tools/convert_megatron_to_hf.py) and each logit scale s (the final RMSNorm weight times s, so
every logit times s: the same network at a sharper temperature), the fp32 model samples
`--sequences` responses of `--length` tokens (T = 1, the pattern task's prompts) and each
response token's log-prob is recomputed by four forwards of the same tokens (HF transformers,
in-process, CPU):

    fp32       fp32 weights, fp32 compute                  (the trainer: the reference)
    w-bf16     bf16-rounded weights, fp32 compute          (rounding of the pushed weights)
    bf16       bf16 weights, bf16 compute                  (a bf16 engine)
    bf16-h32   bf16 weights and compute up to the lm_head, then the logits in fp32 from the
               bf16 hidden state and the bf16 lm_head weight, both upcast (what SGLang's
               `--enable-fp32-lm-head` computes: the bf16 rounding of the logits taken out)
    fp8        block-FP8 inference as the embedded engine emulates it
               (`engines/embedded/fp8_emulation.py`: e4m3 weights in 128x128 blocks quantised
               from the fp32 weights, as the FP8 push sends them; per-token-group e4m3
               activations before each decoder GEMM; everything else fp32)

Per variant v against fp32, over the response tokens: mean |logp_v - logp_fp32| per token, mean
|sequence mean of (logp_v - logp_fp32)| (GSPO's sequence log-ratio), and the RMS over the
vocabulary of the centred logit error dz - mean(dz), and the share of sequences whose
first-mini-batch GSPO ratio exp(mean_t(logp_fp32 - logp_v)) lies outside the clip band [1 -
3e-4, 1 + 4e-4] from this mismatch alone. `--lengths 16,64,256` repeats everything per response
length (how the mismatch scales with length at token and sequence level). Per model and scale:
the fp32 policy's mean entropy per token, the mean probability and logit of the sampled token,
the mean top logit, and the RMS of the centred fp32 logits (the logit scale). The difference of
log-probs is first order in the logit error, dlogp_y = dz_y - sum_j p_j dz_j: it shrinks as p_y
-> 1 and grows with the logit error, which bf16 makes proportional to the logits' magnitude (8
significant bits). Results of one invocation: docs/evidence.md ("What makes the mismatch grow").
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: this checkout's packages (benchmarks.provenance)
    import sys
    from pathlib import Path

    _root = str(Path(__file__).resolve().parents[1])
    if _root not in sys.path:
        sys.path.insert(0, _root)

import argparse
import copy
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron_gspo.engines.launch import LaunchConfig

VARIANTS = ("w-bf16", "bf16", "bf16-h32", "fp8")
EPS_LOW, EPS_HIGH = 3e-4, 4e-4
"""GSPO's sequence clip band (the paper's and the study's), for the share outside it."""


def load(path: str, scale: float) -> Any:
    """fp32 HF model of `path` with its final RMSNorm weight times `scale` (logits x scale)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    return model


def prompts(path: str, tokenizer_dir: str, n: int) -> list[list[int]]:
    """The first `n` prompts of a pattern-task jsonl, tokenised."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [json.loads(x) for x in Path(path).read_text().splitlines()[:n]]
    return [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]


@torch.no_grad()
def sample(model: Any, prompt_ids: list[list[int]], length: int, seed: int) -> list[list[int]]:
    """T = 1 samples of `length` tokens from the fp32 model (EOS not special)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in prompt_ids:
        ids = torch.tensor([p])
        past = None
        nxt = ids
        for _ in range(length):
            o = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = o.past_key_values
            probs = torch.softmax(o.logits[0, -1].double(), -1)
            tok = int(torch.multinomial(probs, 1, generator=g))
            nxt = torch.tensor([[tok]])
            ids = torch.cat([ids, nxt], 1)
        out.append(ids[0].tolist())
    return out


@torch.no_grad()
def response_logits(model: Any, ids: list[int], plen: int, head32: Any = None) -> torch.Tensor:
    """[R, V] float64 logits predicting the response tokens ids[plen:]; with `head32` (an fp32
    lm_head) the logits are head32(fp32 copy of the model's lm_head input)."""
    x = torch.tensor([ids])
    if head32 is None:
        logits = model(input_ids=x).logits[0]
    else:
        h = model.model(input_ids=x).last_hidden_state[0]
        logits = head32(h.float())
    return logits[plen - 1 : len(ids) - 1].double()


def variants(model: Any) -> dict[str, tuple[Any, Any]]:
    """variant -> (model, fp32 lm_head or None) as in the module docstring."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    half = copy.deepcopy(model).to(torch.bfloat16)
    from megatron_gspo.engines.embedded.fp8_emulation import emulate

    fp8 = copy.deepcopy(model)
    emulate(fp8, "fp8")  # quantises the fp32 weights in place, as a pushed fp32 weight is
    return {
        "w-bf16": (rounded, None),
        "bf16": (half, None),
        "bf16-h32": (half, rounded.lm_head),
        "fp8": (fp8, None),
    }


def measure(model: Any, seqs: list[list[int]], plens: list[int]) -> dict[str, Any]:
    """The module docstring's numbers for one model (and scale) on the sampled `seqs`."""
    ref = [response_logits(model, s, p) for s, p in zip(seqs, plens, strict=True)]
    toks = [torch.tensor(s[p:]) for s, p in zip(seqs, plens, strict=True)]
    ref_lp = [torch.log_softmax(z, -1) for z in ref]
    ent = torch.cat([-(lp.exp() * lp).sum(-1) for lp in ref_lp])
    p_tok = torch.cat([lp.gather(1, t[:, None])[:, 0].exp() for lp, t in zip(ref_lp, toks)])
    centred = torch.cat([z - z.mean(-1, keepdim=True) for z in ref])
    out: dict[str, Any] = {
        "entropy": float(ent.mean()),
        "p_token": float(p_tok.mean()),
        "logit_rms": float(centred.pow(2).mean().sqrt()),
        "logit_token": float(
            torch.cat([z.gather(1, t[:, None])[:, 0] for z, t in zip(ref, toks)]).mean()
        ),
        "logit_top": float(torch.cat([z.max(-1).values for z in ref]).mean()),
        "tokens": int(p_tok.numel()),
    }
    for name, (m, head) in variants(model).items():
        tok_d, seq_d, dz_rms, outside = [], [], [], 0
        for s, p, z0, lp0, t in zip(seqs, plens, ref, ref_lp, toks, strict=True):
            z = response_logits(m, s, p, head)
            d = (
                torch.log_softmax(z, -1).gather(1, t[:, None])[:, 0]
                - lp0.gather(1, t[:, None])[:, 0]
            )
            tok_d.append(d.abs())
            seq_d.append(abs(float(d.mean())))
            log_ratio = -float(d.mean())  # log of GSPO's s_i before the trainer moves
            outside += not math.log(1 - EPS_LOW) <= log_ratio <= math.log(1 + EPS_HIGH)
            dz = z - z0
            dz_rms.append((dz - dz.mean(-1, keepdim=True)).pow(2).mean(-1))
        out[name] = {
            "abs_dlogp_token": float(torch.cat(tok_d).mean()),
            "abs_seq_log_ratio": sum(seq_d) / len(seq_d),
            "logit_err_rms": float(torch.cat(dz_rms).mean().sqrt()),
            "outside_band": outside / len(seqs),
        }
    return out


def sglang_variant(
    name: str, path: str, python: str | None, port: int, log_dir: str | None
) -> LaunchConfig:
    """The bf16 SGLang CPU server of variant `name`: "bf16" with SGLang's bf16 logits,
    "bf16-h32" with `--enable-fp32-lm-head`. Set explicitly: since the fp32-logit default
    (`LaunchConfig.fp32_lm_head`), a server launched without saying so computes fp32 logits,
    which made both variants measure fp32 logits."""
    from megatron_gspo.engines.launch import LaunchConfig

    return LaunchConfig(
        model_path=path, backend="sglang", device="cpu", python=python, base_port=port,
        fp32_lm_head=name == "bf16-h32", startup_timeout_s=900, log_dir=log_dir,
    )  # fmt: skip


def sglang_rows(
    label: str, path: str, pids: list[list[int]], a: Any, lengths: list[int]
) -> list[dict[str, Any]]:
    """The real SGLang server on CPU (bf16), without and with `--enable-fp32-lm-head`: its
    own T = 1 samples of each length and their engine log-probs against the fp32 HF forward of
    the same tokens (per token, per sequence and the share outside GSPO's band, as `measure`);
    one row per length."""
    from megatron_gspo.dist import free_port
    from megatron_gspo.engines.client import ClientConfig, SGLangClient
    from megatron_gspo.engines.launch import ServerGroup
    from megatron_gspo.engines.types import SamplingParams

    ref = load(path, 1.0)
    rows = {n: {"model": label, "length": n, "engine": "sglang-bf16"} for n in lengths}
    for name in ("bf16", "bf16-h32"):
        cfg = sglang_variant(name, path, a.sglang, free_port(), a.sglang_logs)
        with ServerGroup(cfg).start() as group:
            client = SGLangClient(ClientConfig(engine_urls=list(group.cfg.engine_urls)))
            try:
                results = {
                    n: client.generate(
                        pids,
                        SamplingParams(
                            max_new_tokens=n, temperature=1.0, seed=a.seed, ignore_eos=True
                        ),
                        n=1,
                    )
                    for n in lengths
                }
            finally:
                client.close()
        for n, res in results.items():
            tok_d, seq_d, ent, outside = [], [], [], 0
            for smp in res.samples:
                ids, plen = list(smp.prompt_ids) + list(smp.response_ids), len(smp.prompt_ids)
                lp = torch.log_softmax(response_logits(ref, ids, plen), -1)
                t = torch.tensor(list(smp.response_ids))
                d = (
                    torch.tensor(list(smp.logprobs), dtype=torch.float64)
                    - lp.gather(1, t[:, None])[:, 0]
                )
                tok_d.append(d.abs())
                seq_d.append(abs(float(d.mean())))
                log_ratio = -float(d.mean())
                outside += not math.log(1 - EPS_LOW) <= log_ratio <= math.log(1 + EPS_HIGH)
                ent.append(-(lp.exp() * lp).sum(-1))
            rows[n]["entropy_" + name] = float(torch.cat(ent).mean())
            rows[n][name] = {
                "abs_dlogp_token": float(torch.cat(tok_d).mean()),
                "abs_seq_log_ratio": sum(seq_d) / len(seq_d),
                "outside_band": outside / len(seq_d),
            }
            print(json.dumps(rows[n]), flush=True)
    return list(rows.values())


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per model and scale."""
    head = ["model", "L", "scale", "entropy", "p(token)", "logit RMS", "logit(token)", "top logit"]
    for v in VARIANTS:
        head += [f"{v} dlogp/tok", f"{v} seq", f"{v} dz RMS", f"{v} out"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [
            r["model"],
            str(r["length"]),
            f"{r['scale']:g}",
            f"{r['entropy']:.2f}",
            f"{r['p_token']:.2f}",
        ]
        cells += [f"{r[k]:.2f}" for k in ("logit_rms", "logit_token", "logit_top")]
        for v in VARIANTS:
            x = r[v]
            cells += [f"{x['abs_dlogp_token']:.1e}", f"{x['abs_seq_log_ratio']:.1e}",
                      f"{x['logit_err_rms']:.1e}", f"{x['outside_band']:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="label=HF dir (repeatable)")
    p.add_argument("--scales", default="1", help="comma-separated logit scales")
    p.add_argument("--data", help="pattern-task jsonl (default: <first model>/../pattern.jsonl)")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--lengths", help="comma-separated response lengths (overrides --length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--sglang", help="engine venv python: also measure the real SGLang server")
    p.add_argument("--sglang-logs", help="directory of the SGLang server logs")
    p.add_argument("--skip-hf", action="store_true", help="only the --sglang measurement")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    models = [m.partition("=")[::2] for m in a.model]
    first = models[0][1]
    data = a.data or str(Path(first).parent / "pattern.jsonl")
    pids = prompts(data, first, a.sequences)
    results = []
    lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else [a.length]
    for label, path in [] if a.skip_hf else models:
        for scale in (float(s) for s in a.scales.split(",")):
            model = load(path, scale)
            for length in lengths:
                seqs = sample(model, pids, length, a.seed)
                r = measure(model, seqs, [len(x) for x in pids])
                results.append({"model": label, "length": length, "scale": scale, **r})
                print(json.dumps(results[-1]), flush=True)
    print(
        f"\n{a.sequences} sequences x L tokens per row (T = 1 samples of the fp32 "
        "model); dlogp/tok: mean |logp_v - logp_fp32| per token; seq: mean |sequence mean of "
        "the difference|; dz RMS: RMS of the centred logit error; out: share of sequences "
        "whose GSPO ratio lies outside [1 - 3e-4, 1 + 4e-4] from the mismatch alone\n"
    )
    print(table(results))
    engine = (
        [r for label, path in models for r in sglang_rows(label, path, pids, a, lengths)]
        if a.sglang
        else []
    )
    if engine:
        print("\nreal SGLang server (CPU, bf16), its own samples vs the fp32 HF forward\n")
        head = ["model", "L", "entropy", "bf16 dlogp/tok", "bf16 seq", "bf16 out",
                "fp32-lm-head dlogp/tok", "fp32-lm-head seq", "fp32-lm-head out"]  # fmt: skip
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in engine:
            b, h = r["bf16"], r["bf16-h32"]
            print(f"| {r['model']} | {r['length']} | {r['entropy_bf16']:.2f} | "
                  f"{b['abs_dlogp_token']:.1e} | {b['abs_seq_log_ratio']:.1e} | "
                  f"{b['outside_band']:.2f} | {h['abs_dlogp_token']:.1e} | "
                  f"{h['abs_seq_log_ratio']:.1e} | {h['outside_band']:.2f} |")  # fmt: skip
    if a.json:
        from benchmarks.provenance import provenance

        doc = {"hf": results, "sglang": engine, "provenance": provenance(seed=a.seed)}
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    assert all(math.isfinite(r["bf16"]["abs_dlogp_token"]) for r in results + engine)
    return results + engine


if __name__ == "__main__":
    main()
