"""Peak memory and time of the LM head + log-probs + GSPO loss: straightforward, chunked, fused.

    python benchmarks/logprob_loss.py                       # CPU, the default grid below
    python benchmarks/logprob_loss.py --hidden 2048 --tokens 2048
    python benchmarks/logprob_loss.py --device cuda         # GPU: torch.cuda.max_memory_allocated

Each variant runs forward + backward of (output layer -> target log-probs + entropy -> GSPO loss
with an entropy term) w.r.t. the final hidden states [T, H] and the output weight [V, H] (bf16):
  straightforward  logits = h @ W^T; log_softmax(logits.float() / temp)   ([T, V] float32 x 2+)
  chunked          logits = h @ W^T; megatron_gspo.algo.vocab_parallel_logprobs (the unfused
                   trainer path: bf16 [T, V] logits and their bf16 gradient, fp32 per chunk)
  fused            megatron_gspo.algo.fused_lm_head_logprobs (no [T, V] tensor in either pass),
                   fp32 logit blocks from bf16 operands (SGLang's fp32 LM head; on CPU the
                   block's operands upcast, on CUDA the bf16 GEMM with an fp32 output)
  fused-bf16       the same with fp32_logits=False: logit blocks rounded to bf16 (before issue 35)
  gemm             one forward h @ W^T, no grad: the unit of matmul time (the three above do
                   3, 3 and 4 such GEMMs: the fused backward recomputes the logit blocks)

Memory is the peak ABOVE what was allocated before the step (h, W and the [T] inputs), so it
includes the bf16 gradients of h and W that every variant returns (dW alone is V*H*2 bytes).
Two measurements:
  tensor peak  every size: the same step under torch's FakeTensorMode (shapes only, nothing
               computed or allocated) with torch.distributed._tools.mem_tracker.MemTracker,
               which counts every tensor storage alive at each moment (exact, allocator-free)
  run          where it fits (estimated peak <= --mem-limit-gib, GEMM work <= --max-tflop):
               a real step in a fresh subprocess: time, and the process's resident-set
               high-water mark (VmHWM, reset through /proc/self/clear_refs; ru_maxrss where
               that is unavailable); on CUDA torch.cuda.max_memory_allocated
Ratios are against the straightforward row of the same size.

    python benchmarks/logprob_loss.py --profile --tokens 1024 --hidden 4096

--profile: chunked and fused in ONE process (paired, alternating, min of --repeat steps), the
fused/chunked time ratio, and a torch.profiler breakdown of one step of each (self CPU time per
aten op, grouped; see `_category`) against the GEMM floor: the fused path does 4 [T, V, H] GEMM
passes (forward logits, backward recompute, dH, dW) to the chunked path's 3. Also the peak
memory of each: tensor peak (all three) and the run's RSS high-water mark (chunked, fused).

    python benchmarks/logprob_loss.py --sweep 1024x8192,512x8192 --tokens 2048 --hidden 4096

--sweep: fused step time per token chunk x vocab chunk setting, in one process (alternating).
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
    fused_lm_head_logprobs,
    policy_loss,
    vocab_parallel_logprobs,
)

MIB, GIB = 2**20, 2**30
VARIANTS = ("straightforward", "chunked", "fused", "fused-bf16", "gemm")
# Bytes per [T, V] element alive at the peak, rounded up from the ops each path runs (used only
# to skip what cannot fit): bf16 logits + fp32 copy + fp32 log-softmax + their gradients.
PEAK_BYTES_PER_TV = {
    "straightforward": 18, "chunked": 4.5, "fused": 0, "fused-bf16": 0, "gemm": 2
}  # fmt: skip
GEMMS = {"straightforward": 3, "chunked": 3, "fused": 4, "fused-bf16": 4, "gemm": 1}


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


def _logprobs(args: argparse.Namespace, h: torch.Tensor, w: torch.Tensor, target: torch.Tensor):
    if args.variant in ("fused", "fused-bf16"):
        return fused_lm_head_logprobs(
            h,
            w,
            target,
            temperature=args.temperature,
            chunk_size=args.chunk,
            vocab_chunk=args.vocab_chunk,
            with_entropy=True,
            fp32_logits=args.variant == "fused",
        )
    logits = h @ w.T
    if args.variant == "straightforward":
        logq = torch.log_softmax(logits.float() / args.temperature, dim=-1)
        logp = logq.gather(1, target[:, None]).squeeze(1)
        return logp, -(logq.exp() * logq).sum(-1)
    return vocab_parallel_logprobs(
        logits, target, temperature=args.temperature, chunk_size=args.chunk, with_entropy=True
    )


def _make_step(args: argparse.Namespace, variant: str, leaves: tuple | None = None):
    """(h, w, step): bf16 h [T, H] and W [V, H] leaves and one forward + backward of `variant`
    (the same inputs for every variant: seed 0; `leaves` = (h, w) of another step to share
    them, so that several variants in one process hold one copy of W). The step wraps its
    forward and its backward in profiler ranges "fwd" / "bwd" (no cost without a profiler)."""
    torch.manual_seed(0)
    dev = torch.device(args.device)
    t, v, hd = args.tokens, args.vocab, args.hidden
    h = torch.randn(t, hd, dtype=torch.bfloat16, device=dev).requires_grad_(True)
    w = (torch.randn(v, hd, device=dev) * (3 / hd**0.5)).bfloat16().requires_grad_(True)
    if leaves is not None:
        h, w = leaves
    target = torch.randint(0, v, (t,), device=dev)
    seq_len = max(1, t // args.seqs)
    seq_index = (torch.arange(t, device=dev) // seq_len).clamp(max=args.seqs - 1)
    adv = torch.randn(args.seqs, device=dev)
    mask = torch.ones(t, dtype=torch.bool, device=dev)
    cfg = PolicyLossConfig(kind="gspo")
    ns = argparse.Namespace(**{**vars(args), "variant": variant})

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        h.grad = w.grad = None
        if variant == "gemm":
            with torch.no_grad():
                out = (h @ w.T)[:, 0].float()
            return out, out.sum()
        with torch.profiler.record_function("fwd"):
            logp, ent = _logprobs(ns, h, w, target)
            # pi_old a hair away from pi_theta so some sequences clip and some do not.
            old = logp.detach() + 1e-4 * torch.sin(torch.arange(t, device=dev, dtype=logp.dtype))
            batch = PolicyLossInputs(
                logp=logp,
                old_logp=old,
                advantages=adv,
                seq_index=seq_index,
                mask=mask,
                num_seqs=args.seqs,
                entropy=ent.detach(),
            )
            loss, _ = policy_loss(batch, cfg, denominator=float(args.seqs))
            loss = loss - 1e-3 * ent.mean()  # make the entropy path part of the backward
        with torch.profiler.record_function("bwd"):
            loss.backward()
        return logp.detach(), loss.detach()

    return h, w, step


def worker(args: argparse.Namespace) -> dict:
    dev = torch.device(args.device)
    h, w, step = _make_step(args, args.variant)
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
    grads = args.variant != "gemm"
    return {
        "variant": args.variant,
        "peak_mib": peak / MIB,
        "time_s": min(times),
        "loss": loss.item(),
        "logp_head": logp[:256].double().tolist(),
        "dh_head": h.grad[:8].double().flatten().tolist() if grads else [],
        "dw_head": w.grad[:64].double().flatten().tolist() if grads else [],
        "exact_hwm": cuda or exact,
    }


def tensor_peak(variant: str, t: int, hd: int, args: argparse.Namespace) -> float:
    """Peak bytes of live tensors during one step, above its inputs (FakeTensorMode: no
    memory or compute is used, so any size can be measured)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    if variant == "gemm":
        return float("nan")
    ns = argparse.Namespace(**{**vars(args), "variant": variant})
    with FakeTensorMode():
        h = torch.randn(t, hd, dtype=torch.bfloat16).requires_grad_(True)
        w = torch.randn(args.vocab, hd, dtype=torch.bfloat16).requires_grad_(True)
        target = torch.randint(0, args.vocab, (t,))
        seq_index = (torch.arange(t) // max(1, t // args.seqs)).clamp(max=args.seqs - 1)
        adv = torch.randn(args.seqs)
        mask = torch.ones(t, dtype=torch.bool)
        inputs = [h, w, target, seq_index, adv, mask]
        tracker = MemTracker()
        tracker.track_external(*inputs)
        with tracker:
            logp, ent = _logprobs(ns, h, w, target)
            old = logp.detach() + 1e-4
            batch = PolicyLossInputs(
                logp=logp,
                old_logp=old,
                advantages=adv,
                seq_index=seq_index,
                mask=mask,
                num_seqs=args.seqs,
                entropy=ent.detach(),
            )
            loss, _ = policy_loss(batch, PolicyLossConfig(kind="gspo"), denominator=1.0)
            (loss - 1e-3 * ent.mean()).backward()
        snap = tracker.get_tracker_snapshot("peak")
    peak = sum(d["Total"] for d in snap.values())
    return peak - sum(x.numel() * x.element_size() for x in inputs)


def _skip_reason(args: argparse.Namespace, variant: str, t: int, hd: int) -> str | None:
    tv = t * args.vocab
    est = PEAK_BYTES_PER_TV[variant] * tv + 4 * (t + args.vocab) * hd
    if est > args.mem_limit_gib * GIB:
        return f"estimated peak {est / GIB:.1f} GiB > --mem-limit-gib {args.mem_limit_gib:g}"
    tflop = GEMMS[variant] * 2 * tv * hd / 1e12
    if tflop > args.max_tflop:
        return f"{tflop:.0f} TFLOP of GEMMs > --max-tflop {args.max_tflop:g}"
    return None


def _run_variant(args: argparse.Namespace, variant: str, t: int, hd: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant]
    for k, val in [
        ("--device", args.device),
        ("--tokens", t),
        ("--hidden", hd),
        ("--vocab", args.vocab),
        ("--seqs", args.seqs),
        ("--temperature", args.temperature),
        ("--chunk", args.chunk),
        ("--vocab-chunk", args.vocab_chunk),
        ("--repeat", args.repeat),
        ("--warmup", args.warmup),
    ]:
        cmd += [k, str(val)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _max_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=float("nan"))


# aten op -> category of the --profile breakdown (self CPU time; anything else is "other").
_CATEGORIES = {
    "exp": ("aten::exp", "aten::exp_"),
    "entropy bmm": ("aten::bmm",),
    "reductions": ("aten::amax", "aten::sum", "aten::max", "aten::mean", "aten::logsumexp"),
    "elementwise": (
        "aten::mul", "aten::mul_", "aten::sub", "aten::sub_", "aten::add", "aten::add_",
        "aten::neg", "aten::neg_", "aten::div", "aten::div_", "aten::maximum", "aten::log",
        "aten::where", "aten::clamp", "aten::clamp_", "aten::ge", "aten::lt", "aten::__and__",
        "aten::bitwise_and", "aten::sin",
    ),
    "scatter/gather": ("aten::scatter_add_", "aten::gather", "aten::index", "aten::index_put_"),
    "dtype casts/copies": ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone"),
    "allocation": (
        "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros", "aten::zero_",
        "aten::fill_", "aten::new_zeros", "aten::new_empty", "aten::resize_",
    ),
}  # fmt: skip
_GEMM_ROWS = ("GEMM fwd logits", "GEMM bwd recompute", "GEMM dH", "GEMM dW")
_ROWS = (*_GEMM_ROWS, *_CATEGORIES, "other")


def _category(name: str, shapes: list, phase: str, t: int, hd: int) -> str:
    """The breakdown row of one aten op. GEMMs (aten::mm/addmm) [a, K] @ [K, c] are told apart
    by their inner size K: K == H is a logits block (forward, or the fused backward's
    recompute); K == T (a sum over all tokens) is dL/dW, either orientation; any other K (a
    vocab block or the whole vocab) is dL/dh. Needs T != H and T, H != every vocab block width
    (V, and the fused backward's Vb), checked by the caller."""
    if name in ("aten::mm", "aten::addmm"):
        # input_shapes: mm (self, mat2[, out]); addmm (bias, mat1, mat2[, out]).
        _, k = shapes[1] if name == "aten::addmm" else shapes[0]
        if k == hd:
            return "GEMM fwd logits" if phase == "fwd" else "GEMM bwd recompute"
        return "GEMM dW" if k == t else "GEMM dH"
    for cat, names in _CATEGORIES.items():
        if name in names:
            return cat
    return "other"


def _profile_one(step, t: int, hd: int) -> tuple[float, dict[str, float]]:
    """(wall seconds, self CPU seconds per breakdown row) of one profiled step (phases from
    its "fwd"/"bwd" ranges). The profiler records a few hundred large ops per step: its
    overhead is far below the timing noise of these steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    events = list(prof.events())
    # The phase of an op: the "fwd"/"bwd" range whose interval holds its start (autograd runs
    # the backward on other threads, so ranges are matched by time, not by parent).
    ranges = [
        (e.time_range.start, e.time_range.end, e.name) for e in events if e.name in ("fwd", "bwd")
    ]
    out = dict.fromkeys(_ROWS, 0.0)
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        phase = next((n for s0, s1, n in ranges if s0 <= e.time_range.start <= s1), "bwd")
        cat = _category(e.name, list(e.input_shapes or []), phase, t, hd)
        out[cat] += e.self_cpu_time_total / 1e6
    return wall, out


def profile_main(args: argparse.Namespace) -> None:
    """Paired chunked vs fused timing and a per-category breakdown, in this process."""
    t, hd, v = int(args.tokens), int(args.hidden), args.vocab
    vb = min(v, max(1, min(t, args.chunk) * args.vocab_chunk // t))  # fused backward block
    if len({t, hd, v, vb}) != 4:
        raise SystemExit(
            f"--profile: T, H, V and the fused backward's block Vb must differ to tell the GEMMs "
            f"apart (got T={t}, H={hd}, V={v}, Vb={vb}); change --chunk or --vocab-chunk"
        )
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    args.tokens, args.hidden = t, hd
    tflop = 2 * t * v * hd / 1e12
    print(
        f"profile: T={t} H={hd} V={v} chunk={args.chunk} vocab_chunk={args.vocab_chunk} bf16, "
        f"one [T, V, H] GEMM = {tflop:.2f} TFLOP; chunked: 3 GEMMs, fused: 4 (floor 4/3 = 1.33x "
        f"if the GEMMs dominate and run equally fast); load: {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    names = ["chunked", "fused"] + (["gemm"] if args.gemm_unit else [])
    h, w, first = _make_step(args, names[0])
    steps = {names[0]: first, **{n: _make_step(args, n, (h, w))[2] for n in names[1:]}}
    peaks = {n: tensor_peak(n, t, hd, args) / MIB for n in ("straightforward", "chunked", "fused")}
    for _ in range(args.warmup):
        for st in steps.values():
            st()
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in steps}
    rss: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.repeat):  # alternate, so that load drifts hit both paths alike
        for name, st in steps.items():
            h.grad = w.grad = None  # the last step's gradients are not part of this one's peak
            _reset_rss_hwm()
            base = _rss_hwm_bytes()
            runs[name].append(_profile_one(st, t, hd))
            rss[name].append((_rss_hwm_bytes() - base) / MIB)
            print(
                f"  step {i} {name}: {runs[name][-1][0]:.2f} s, RSS peak +{rss[name][-1]:.0f} MiB,"
                f" load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    fastest = {n: min(r, key=lambda x: x[0]) for n, r in runs.items()}
    best = {n: f[0] for n, f in fastest.items()}
    unit = best.get("gemm")
    print(
        f"time s (min of {args.repeat}, paired): chunked {best['chunked']:.2f}  fused "
        f"{best['fused']:.2f}  ->  fused/chunked {best['fused'] / best['chunked']:.3f}"
        + (
            f"  (one GEMM {unit:.2f}: chunked = {best['chunked'] / unit:.2f} GEMMs, fused = "
            f"{best['fused'] / unit:.2f} GEMMs)"
            if unit
            else ""
        ),
        flush=True,
    )
    sf = peaks["straightforward"]
    print(
        "peak MiB above the inputs (tensor peak, FakeTensorMode; run: RSS high-water mark, max "
        "over steps): "
        + "; ".join(
            f"{n} {peaks[n]:.0f} (1/{sf / peaks[n]:.2f})"
            + (f" run {max(rss[n]):.0f}" if n in rss else " not run")
            for n in peaks
        ),
        flush=True,
    )
    prof = {name: fastest[name][1] for name in ("chunked", "fused")}
    print(f"{'self CPU s (fastest step)':<32}{'chunked':>9}{'fused':>9}{'fused-chunked':>15}")
    for row in _ROWS:
        c, f = prof["chunked"][row], prof["fused"][row]
        print(f"{row:<32}{c:>9.2f}{f:>9.2f}{f - c:>+15.2f}")
    tot = {n: sum(p.values()) for n, p in prof.items()}
    gemm = {n: sum(p[r] for r in _GEMM_ROWS) for n, p in prof.items()}
    rest = {n: tot[n] - gemm[n] for n in tot}
    print(
        f"{'total':<32}{tot['chunked']:>9.2f}{tot['fused']:>9.2f}"
        f"{tot['fused'] - tot['chunked']:>+15.2f}\n"
        f"GEMM share: chunked {gemm['chunked'] / tot['chunked']:.0%}, fused "
        f"{gemm['fused'] / tot['fused']:.0%}; GEMM-only ratio "
        f"{gemm['fused'] / gemm['chunked']:.3f}, non-GEMM ratio "
        f"{rest['fused'] / rest['chunked']:.3f}"
    )


def sweep_main(args: argparse.Namespace) -> None:
    """Fused step time per (token chunk, vocab chunk) of `--sweep`, in this process (the same
    h and W; alternating over the settings, min of --repeat): to pick the default chunks."""
    t, hd = int(args.tokens), int(args.hidden)
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    args.tokens, args.hidden = t, hd
    settings = [tuple(int(x) for x in pair.split("x")) for pair in args.sweep.split(",")]
    print(
        f"sweep: fused, T={t} H={hd} V={args.vocab} bf16, settings chunk x vocab_chunk "
        f"{settings}; load: {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    h = w = None
    steps = {}
    for c, vc in settings:
        ns = argparse.Namespace(**{**vars(args), "chunk": c, "vocab_chunk": vc})
        h, w, steps[(c, vc)] = _make_step(ns, "fused", None if h is None else (h, w))
    times: dict[tuple[int, int], list[float]] = {k: [] for k in steps}
    for i in range(args.repeat):
        for k, st in steps.items():
            t0 = time.perf_counter()
            st()
            times[k].append(time.perf_counter() - t0)
            print(
                f"  round {i} chunk {k[0]:>5} vocab_chunk {k[1]:>6}: {times[k][-1]:7.2f} s, "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    base = min(times[settings[0]])
    for k, ts in times.items():
        print(
            f"chunk {k[0]:>5} vocab_chunk {k[1]:>6}: min {min(ts):7.2f} s  "
            f"({min(ts) / base:.3f}x the first setting)  block buffers 12*C*Vc = "
            f"{12 * k[0] * k[1] / MIB:.0f} MiB"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", default="2048,8192,32768", help="comma-separated T values")
    p.add_argument("--hidden", default="2048,4096", help="comma-separated hidden sizes")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seqs", type=int, default=16, help="sequences the tokens are packed into")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (chunked, fused)")
    p.add_argument("--vocab-chunk", type=int, default=8192, help="vocab rows per block (fused)")
    p.add_argument("--profile", action="store_true", help="paired time + breakdown (see top)")
    p.add_argument(
        "--no-gemm-unit",
        dest="gemm_unit",
        action="store_false",
        help="--profile: skip the one-GEMM reference step (saves a GEMM's time at large T)",
    )
    p.add_argument("--sweep", help="CxVc,CxVc,...: fused step time per chunk setting (see top)")
    p.add_argument("--mem-limit-gib", type=float, default=12.0)
    p.add_argument("--max-tflop", type=float, default=60.0)
    p.add_argument("--repeat", type=int, default=None, help="timed steps (min is reported)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    args.repeat = args.repeat if args.repeat is not None else (5 if cuda else 1)
    args.warmup = args.warmup if args.warmup is not None else (2 if cuda else 0)
    if args.profile:
        profile_main(args)
        return
    if args.sweep:
        sweep_main(args)
        return
    if args.variant:
        args.tokens, args.hidden = int(args.tokens), int(args.hidden)
        if not cuda:
            torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
        print(json.dumps(worker(args)))
        return

    print(
        f"device={args.device} V={args.vocab} bf16 h and W, S={args.seqs} chunk={args.chunk} "
        f"temperature={args.temperature} (forward+backward: LM head -> logp, entropy -> GSPO loss)"
    )
    head = (
        f"{'H':>5}{'T':>7} {'variant':<16}{'tensor peak MiB':>16}{'ratio':>7}  |"
        f"{'run: RSS MiB':>13}{'time s':>9}{'t ratio':>8}"
        f"{'max|dlogp|':>11}{'max|ddh|':>9}{'max|ddW|':>9}"
    )
    print(head)
    print("-" * len(head), flush=True)
    inexact = False
    for hd in (int(x) for x in args.hidden.split(",")):
        for t in (int(x) for x in args.tokens.split(",")):
            rows: dict[str, dict] = {}
            peaks: dict[str, float] = {}
            for variant in args.variants.split(","):
                peaks[variant] = tensor_peak(variant, t, hd, args) / MIB
                ratio = peaks[variant] / peaks.get("straightforward", float("nan"))
                line = f"{hd:>5}{t:>7} {variant:<16}{peaks[variant]:>16.0f}{ratio:>7.3f}  |"
                why = _skip_reason(args, variant, t, hd)
                if why:
                    print(f"{line} not run: {why}", flush=True)
                    continue
                r = rows[variant] = _run_variant(args, variant, t, hd)
                inexact |= not r["exact_hwm"]
                ref = rows.get("straightforward") or rows.get("chunked") or r
                same = r["variant"] != "gemm" and ref["variant"] != "gemm"
                print(
                    f"{line}{r['peak_mib']:>13.0f}{r['time_s']:>9.2f}"
                    f"{r['time_s'] / ref['time_s']:>8.2f}"
                    + (
                        f"{_max_diff(r['logp_head'], ref['logp_head']):>11.1e}"
                        f"{_max_diff(r['dh_head'], ref['dh_head']):>9.1e}"
                        f"{_max_diff(r['dw_head'], ref['dw_head']):>9.1e}"
                        if same
                        else ""
                    ),
                    flush=True,
                )
    if inexact:
        print("note: VmHWM reset unavailable; peaks are ru_maxrss deltas (lower bounds)")
    print(
        "ratios: against the straightforward row of the same H and T (time: else the chunked "
        "row); max|d...|: against that row (bf16 inputs)"
    )


if __name__ == "__main__":
    main()
