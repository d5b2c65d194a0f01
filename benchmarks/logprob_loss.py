"""Peak memory and time: chunked vocab-parallel log-probs + GSPO loss vs the naive path.

    python benchmarks/logprob_loss.py                 # CPU, T=2048, V=151,936, bf16 logits
    python benchmarks/logprob_loss.py --device cuda   # GPU: torch.cuda.max_memory_allocated

Each variant runs forward + backward of (target log-probs -> GSPO loss) w.r.t. [T, V] logits:
  naive     log_softmax(logits.float() / temp).gather(target)    ([T, V] float32, twice or more)
  chunked   megatron_gspo.algo.vocab_parallel_logprobs(..., chunk_size=C)
"+H" rows also compute the entropy (naive: from the same full log-softmax).

Memory is the peak ABOVE what was allocated before the step (the bf16 logits and the [T] inputs),
so the bf16 gradient of the logits, which both paths must produce, is included. On CPU each
variant runs in a fresh subprocess and reads the process's resident-set high-water mark (VmHWM,
reset through /proc/self/clear_refs; ru_maxrss where that is unavailable); on CUDA it uses
torch.cuda.max_memory_allocated. Ratios are against the naive row of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_gspo.algo import (  # noqa: E402
    PolicyLossConfig,
    PolicyLossInputs,
    policy_loss,
    vocab_parallel_logprobs,
)

MIB = 2**20


def _rss_hwm_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _reset_rss_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5": reset the peak RSS to the current RSS
        return True
    except OSError:
        return False


def _logprobs(variant: str, logits, target, temperature: float, chunk: int):
    with_entropy = variant.endswith("+H")
    if variant.startswith("naive"):
        logq = torch.log_softmax(logits.float() / temperature, dim=-1)
        logp = logq.gather(1, target[:, None]).squeeze(1)
        ent = -(logq.exp() * logq).sum(-1) if with_entropy else None
        return logp, ent
    return vocab_parallel_logprobs(
        logits, target, temperature=temperature, chunk_size=chunk, with_entropy=with_entropy
    )


def worker(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    dev = torch.device(args.device)
    t, v = args.tokens, args.vocab
    logits = torch.randn(t, v, dtype=torch.bfloat16, device=dev).mul_(3).requires_grad_(True)
    target = torch.randint(0, v, (t,), device=dev)
    seq_len = max(1, t // args.seqs)
    seq_index = (torch.arange(t, device=dev) // seq_len).clamp(max=args.seqs - 1)
    adv = torch.randn(args.seqs, device=dev)
    mask = torch.ones(t, dtype=torch.bool, device=dev)
    cfg = PolicyLossConfig(kind="gspo")

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        logits.grad = None
        logp, ent = _logprobs(args.variant, logits, target, args.temperature, args.chunk)
        # pi_old a hair away from pi_theta so some sequences clip and some do not.
        old = logp.detach() + 1e-4 * torch.sin(torch.arange(t, device=dev, dtype=logp.dtype))
        batch = PolicyLossInputs(
            logp=logp,
            old_logp=old,
            advantages=adv,
            seq_index=seq_index,
            mask=mask,
            num_seqs=args.seqs,
            entropy=ent,
        )
        loss, _ = policy_loss(batch, cfg, denominator=float(args.seqs))
        if ent is not None:
            loss = loss - 1e-3 * ent.mean()  # make the entropy path part of the backward
        loss.backward()
        return logp.detach(), loss.detach()

    cuda = dev.type == "cuda"
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        exact = _reset_rss_hwm()
        base = _rss_hwm_bytes()
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        logp, loss = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss_hwm_bytes()) - base
    return {
        "variant": args.variant,
        "chunk": args.chunk if not args.variant.startswith("naive") else None,
        "peak_mib": peak / MIB,
        "time_s": min(times),
        "loss": loss.item(),
        "logp_head": logp[:256].double().tolist(),
        "grad_head": logits.grad[:4, :4096].double().flatten().tolist(),
        "exact_hwm": cuda or exact,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--seqs", type=int, default=16, help="sequences the tokens are packed into")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunks", default="256,1024", help="comma-separated chunk sizes")
    p.add_argument("--entropy", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--repeat", type=int, default=None, help="timed steps (min is reported)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=1024, help=argparse.SUPPRESS)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    args.repeat = args.repeat if args.repeat is not None else (5 if cuda else 1)
    args.warmup = args.warmup if args.warmup is not None else (2 if cuda else 0)
    if args.variant:
        if not cuda:
            torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
        print(json.dumps(worker(args)))
        return

    runs = [("naive", 0)] + [("chunked", int(c)) for c in args.chunks.split(",")]
    if args.entropy:
        runs += [("naive+H", 0), ("chunked+H", int(args.chunks.split(",")[-1]))]
    rows = []
    for variant, chunk in runs:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--variant",
            variant,
            "--chunk",
            str(chunk),
            "--device",
            args.device,
            "--tokens",
            str(args.tokens),
            "--vocab",
            str(args.vocab),
            "--seqs",
            str(args.seqs),
            "--temperature",
            str(args.temperature),
            "--repeat",
            str(args.repeat),
            "--warmup",
            str(args.warmup),
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))

    print(
        f"device={args.device} T={args.tokens} V={args.vocab} logits=bf16 S={args.seqs} "
        f"temperature={args.temperature} (forward+backward, logp -> GSPO loss)"
    )
    if not all(r["exact_hwm"] for r in rows):
        print("note: VmHWM reset unavailable; peaks are ru_maxrss deltas (lower bounds)")
    head = (
        f"{'variant':<11}{'chunk':>6}{'peak MiB':>11}{'time s':>9}{'mem ratio':>11}"
        f"{'time ratio':>11}{'max|dlogp|':>12}{'max|dgrad|':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ref = (
            rows[0]
            if not r["variant"].endswith("+H")
            else next(x for x in rows if x["variant"] == "naive+H")
        )
        dlogp = max(abs(a - b) for a, b in zip(r["logp_head"], ref["logp_head"], strict=True))
        dgrad = max(abs(a - b) for a, b in zip(r["grad_head"], ref["grad_head"], strict=True))
        print(
            f"{r['variant']:<11}{r['chunk'] or '-':>6}{r['peak_mib']:>11.0f}"
            f"{r['time_s']:>9.2f}{r['peak_mib'] / ref['peak_mib']:>11.2f}"
            f"{r['time_s'] / ref['time_s']:>11.2f}{dlogp:>12.1e}{dgrad:>12.1e}"
        )
    print("ratios: against the naive row with the same outputs (naive, or naive+H for +H rows)")


if __name__ == "__main__":
    main()
