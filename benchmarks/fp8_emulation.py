"""The embedded engine's block-FP8 emulation against its fp32 self: log-prob mismatch and speed.

    python benchmarks/fp8_emulation.py                 # tiny Qwen3-MoE, 8 prompts x 4, 64 tokens
    python benchmarks/fp8_emulation.py --max-new-tokens 128 --repeats 3

Two in-process embedded engines (SGLang's HTTP app, `EmbeddedServer`) on the same tiny
checkpoint, one with `quantization="fp8"`. Mismatch: the FP8 engine samples (T = 1, EOS
ignored) and every response token's engine log-prob is compared with the fp32 model's
log-prob of the same token, from one full forward pass (what a trainer holding the fp32 weights
computes): per-token |logp_fp8 - logp_fp32| and the per-sequence mean of the signed difference
(the log of GSPO's length-normalised sequence ratio). Speed: the same prompts and seeds on both
engines through the same client, alternating, best of --repeats (one thread each).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="tiny checkpoint seed")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM

    from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
    from megatron_gspo.engines.client import ClientConfig, SGLangClient
    from megatron_gspo.engines.embedded.server import EmbeddedServer
    from megatron_gspo.engines.types import SamplingParams

    ckpt = str(save_tiny_hf_checkpoint(tempfile.mkdtemp(prefix="fp8bench_"), seed=args.seed))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (int(k),), generator=g).tolist()
               for k in torch.randint(4, 17, (args.prompts,), generator=g)]  # fmt: skip
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=7,
                        ignore_eos=True)  # fmt: skip
    servers = {
        "fp32": EmbeddedServer(ckpt).start(),
        "fp8": EmbeddedServer(ckpt, quantization="fp8").start(),
    }
    clients = {k: SGLangClient(ClientConfig(engine_urls=[s.url])) for k, s in servers.items()}
    try:
        times: dict[str, list[float]] = {k: [] for k in servers}
        results = {}
        for _ in range(args.repeats):
            for k, c in clients.items():
                tic = time.perf_counter()
                results[k] = c.generate(prompts, sp, n=args.n)
                times[k].append(time.perf_counter() - tic)
        ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        tok_diffs, seq_diffs = [], []
        for s in results["fp8"].samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
            with torch.no_grad():
                logits = ref(input_ids=ids).logits[0].double()
            pos = torch.arange(len(s.prompt_ids) - 1, ids.shape[1] - 1)
            lp = torch.log_softmax(logits[pos], -1)[torch.arange(pos.numel()), ids[0, pos + 1]]
            d = torch.tensor(s.logprobs, dtype=torch.float64) - lp
            tok_diffs += d.abs().tolist()
            seq_diffs.append(float(d.mean()))
    finally:
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.stop()
    t = torch.tensor(tok_diffs)
    tokens = len(tok_diffs)
    print(f"{len(results['fp8'].samples)} sequences x {args.max_new_tokens} tokens = {tokens}")
    print(f"|logp_fp8 - logp_fp32| per token: mean {t.mean():.4g}  median {t.median():.4g}  "
          f"p99 {t.quantile(0.99):.4g}  max {t.max():.4g}")  # fmt: skip
    sd = torch.tensor(seq_diffs).abs()
    print(f"|mean_t (logp_fp8 - logp_fp32)| per sequence: mean {sd.mean():.4g}  "
          f"max {sd.max():.4g}")  # fmt: skip
    best = {k: min(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:5s} generate: best {best[k]:.2f} s  ({tokens / best[k]:.0f} tok/s), "
              f"runs {', '.join(f'{x:.2f}' for x in v)}")  # fmt: skip
    med = statistics.median(times["fp8"]) / statistics.median(times["fp32"])
    print(f"fp8/fp32 time: {best['fp8'] / best['fp32']:.2f}x  (median of runs {med:.2f}x)")


if __name__ == "__main__":
    main()
