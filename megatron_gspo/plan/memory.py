"""The planner's model arithmetic: per-rank parameter counts and the memory / weight-sync estimate.

`count_params` has each pipeline stage's model chunks built on the `meta` device inside a fake
process group (`megatron/param_count.py`: megatron-core's own sharding, no memory);
`cached_count_params` memoises it.
`hf_tensor_bytes` sizes the HF model and its weight sync (bf16 or FP8 blocks), `_activations` /
`_micro_batches` the activation terms; `trainer_memory`, `engine_estimate` and `sync_estimate`
are a plan's three estimates, and `memory_formula()` is the text printed under the planner's
table. `plan/planner.py` (the CLI, checks, verdict and launch files) uses these.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_gspo.algo.config import LOGPROB_CHUNK, VOCAB_CHUNK
from megatron_gspo.config import Config
from megatron_gspo.engines.sglang_rules import DEFAULT_MEM_FRACTION
from megatron_gspo.layout import HFConfig, Layout, num_experts

if TYPE_CHECKING:
    from megatron_gspo.engines.launch import LaunchConfig

__all__ = [
    "GiB",
    "MemoryEstimate",
    "StageParams",
    "EngineEstimate",
    "cached_count_params",
    "count_params",
    "engine_estimate",
    "hf_tensor_bytes",
    "memory_formula",
    "sync_estimate",
    "trainer_memory",
    "push_buffer_bytes",
]

GiB = 1024**3
FP8_BLOCK = 128
# CUDA context, NCCL communicators and workspace per process, held whatever the model.
PROCESS_OVERHEAD_GB = 3.0
# What a colocated engine keeps while released (memory saver: CUDA context + allocator).
RELEASED_ENGINE_GB = 1.0


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of a pipeline stage (every TP/EP rank holds the same count)."""

    stage: int
    total: int
    expert: int

    @property
    def dense(self) -> int:
        return self.total - self.expert


@dataclass
class MemoryEstimate:
    """Bytes per GPU of the most loaded pipeline stage, by part."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    overhead: float
    engine_train: float
    engine_rollout: float
    send_buffers: float = 0.0
    """The weight push's buffers on the busiest trainer GPU, held while the engines are back
    (`push_buffer_bytes`)."""

    @property
    def trainer_static(self) -> float:
        return self.weights + self.grads + self.optimizer + self.overhead

    @property
    def train_peak(self) -> float:
        return self.trainer_static + self.activations + self.engine_train

    @property
    def rollout_peak(self) -> float:
        # The push runs after the engines resumed: its buffers sit next to their share.
        return self.trainer_static + self.engine_rollout + self.send_buffers


def push_buffer_bytes(bucket_bytes: int, senders: str, stacked_bytes: float = 0.0) -> float:
    """Send buffers of one push on the busiest trainer GPU: up to 3 buckets in flight
    (`weights.pipeline`: one being sent, one looked ahead, one being filled), plus on the one
    sender (`weights.senders=one`) the expert batch gathered into it (about one bucket,
    `weights.ep_batch`). With `owners` every trainer GPU holds its own 3, none more.
    stacked_bytes: in SGLang's layout (`weights.layout=engine`) a layer's stacked experts
    (`w13_weight`) are sent whole, in a bucket of their own when larger than one (with owners
    gathered into one rank where an engine rank's experts are spread: `weights.owners_fused`;
    colocated, only the part the GPU's own engine rank holds: `weights.owners_home`), so a
    bucket in flight is up to that size (`stacked_expert_bytes`)."""
    per = max(float(bucket_bytes), stacked_bytes)
    return (3 if senders == "owners" else 4) * per


def stacked_expert_bytes(cfg: Config, hf: HFConfig, trainer_bytes: int) -> float:
    """The largest stacked expert parameter a push in SGLang's layout sends from one GPU (a
    layer's `w13_weight`: every expert's gate and up rows), 0 for HF-named pushes or dense
    models. Colocated owners pushes send from each GPU only the part of it that GPU's engine
    rank holds (`weights.owners_home`): 1 / the engines' TP size of it."""
    experts = num_experts(hf) or 0
    if cfg.weights.resolved_layout != "engine" or not experts:
        return 0.0
    dtype = cfg.weights.dtype
    sent = trainer_bytes if dtype is None else {"float64": 8, "float32": 4}.get(dtype, 2)
    whole = float(experts * 2 * getattr(hf, "moe_intermediate_size", 0) * hf.hidden_size * sent)
    launch = getattr(getattr(cfg, "rollout", None), "launch", None)
    if cfg.weights.senders == "owners" and launch is not None and launch.colocated:
        return whole / launch.tp_size
    return whole


# ---------------------------------------------------------------------------------------------
# parameter counts from megatron-core


def count_params(hf_dir: str | Path, layout: Layout, world_size: int) -> list[StageParams]:
    """Per-rank parameter counts of every pipeline stage, from megatron-core's own modules
    (`megatron.param_count.stage_param_counts`: each stage built on the `meta` device in a
    fake process group). Must run before this process joins a real group."""
    from megatron_gspo.megatron.param_count import stage_param_counts

    counts = stage_param_counts(hf_dir, layout, world_size)
    return [StageParams(stage=s, total=t, expert=e) for s, (t, e) in enumerate(counts)]


def cached_count_params(
    hf_dir: str | Path, layout: Layout, world_size: int, cache: str | Path | None
) -> list[StageParams]:
    """`count_params`, memoised in a JSON file keyed by (config.json, layout, world size): a
    requeued job or a second script run skips the megatron import and the meta build."""
    if cache is None:
        return count_params(hf_dir, layout, world_size)
    text = (Path(hf_dir) / "config.json").read_text()
    key = hashlib.sha256(
        json.dumps([text, layout.to_dict(), world_size], sort_keys=True).encode()
    ).hexdigest()
    path = Path(cache)
    table = json.loads(path.read_text()) if path.exists() else {}
    if key not in table:
        counted = [dataclasses.asdict(s) for s in count_params(hf_dir, layout, world_size)]
        path.parent.mkdir(parents=True, exist_ok=True)
        # Planners sharing a cache may finish at once: merge into what is there now, under a
        # lock, so that neither loses the other's entry.
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            table = json.loads(path.read_text()) if path.exists() else {}
            table[key] = counted
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table))
            tmp.replace(path)
    return [StageParams(**s) for s in table[key]]


def hf_tensor_bytes(hf: HFConfig, *, dtype_bytes: int, fp8: bool) -> tuple[int, int]:
    """(parameters, bytes sent per weight sync) of the whole HF model, by tensor shape.

    FP8: every decoder `*_proj.weight` (weights/fp8.py's rule) goes as 1 byte per element plus
    one fp32 scale per 128x128 block; everything else as `dtype_bytes`. The shapes are those of
    the HF checkpoint (Qwen3-MoE / Qwen3 / Llama-style names), derived from config.json.
    """
    h, v, layers = hf.hidden_size, hf.vocab_size, hf.num_hidden_layers
    d = getattr(hf, "head_dim", None) or h // hf.num_attention_heads
    q, kv = hf.num_attention_heads * d, hf.num_key_value_heads * d
    experts = num_experts(hf) or 0
    f_moe = getattr(hf, "moe_intermediate_size", 0)
    f = getattr(hf, "intermediate_size", 0)
    mlp_only = set(getattr(hf, "mlp_only_layers", []) or [])
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    proj: list[tuple[int, int]] = []
    other = 0
    for layer in range(layers):
        proj += [(q, h), (kv, h), (kv, h), (h, q)]
        other += 2 * h + 2 * d  # input / post-attention norms, q / k norms
        if experts and layer not in mlp_only and (layer + 1) % step == 0:
            proj += [(f_moe, h), (f_moe, h), (h, f_moe)] * experts
            other += experts * h  # router
        else:
            proj += [(f, h), (f, h), (h, f)]
    other += v * h * (1 if hf.tie_word_embeddings else 2) + h  # embeddings, lm head, final norm
    params = other + sum(r * c for r, c in proj)
    if not fp8:
        return params, params * dtype_bytes
    scales = sum(math.ceil(r / FP8_BLOCK) * math.ceil(c / FP8_BLOCK) for r, c in proj)
    return params, other * dtype_bytes + sum(r * c for r, c in proj) + 4 * scales


# ---------------------------------------------------------------------------------------------
# memory


def memory_formula() -> str:
    """The estimate, as printed under the table (symbols defined there)."""
    return f"""\
memory per GPU (most loaded pipeline stage; P = its parameters, Pd dense + Pe expert):
  weights     = b_p * P            b_p = 2 (bf16) or 4 (fp32)
  grads       = 4 * P              megatron DDP grad buffer (grad_reduce_in_fp32)
  optimizer   = (m + s) * (Pd / (dp*cp) + Pe / edp) with optim.use_distributed_optimizer
                (else (m + s) * P); m = 4 (fp32 main copy) if b_p = 2, s = 8 Adam / 4 SGD
  activations = inflight * L_stage * per_layer + logits (last stage); T = micro_batch_tokens
     per_layer (recompute none or selective*) = attention + moe, b = 2 bytes (bf16):
       attention  b*(3h + 6*(nq + nkv)*d) * T/(cp*tp)   norm in/normalised/out, qkv, q/k norms,
                  RoPE outputs, q k v o kept by attention (measured: tests/plan/test_plan_memory)
       moe        (b*3h + 8E + 8k) * T/(cp*tp) + imb * k*T*etp/(cp*tp) * b*(h + 6*f/etp)
                  (dense MLP: b*(3h + 3f) * T/(cp*tp))
     per_layer (recompute full) = b*h*T/(cp*tp), plus one layer's full working set
     lm head    model.fused_lm_head (default), t = T/cp, C = min(t, 1024), Vc = min(V/tp, 8192),
                Vb = min(V/tp, max(C * 8192 / t, min(h, 8192))) (the backward's vocab
                block): b * t * h (hidden states gathered over SP) + max(forward
                10 * C * Vc (bf16 logit block, fp32 z and exp), backward 10 * C * Vb
                + b * t * Vb (bf16 logit block, fp32 log p and p; bf16 [t, Vb] dlogits)
                + (4 + b) * t * h (fp32 hidden-gradient accumulator and its cast)
                + b * V/tp * h (the output weight's gradient before DDP adds it to the
                grad buffer))
                unfused: 6 * T/cp * V/tp (bf16 logits + gradient + fp32 log-softmax chunk)
     inflight   = min(pp - stage, micro-batches), * (1 + (pp-1)/(pp*vpp)) if interleaved
     *selective recompute re-runs core attention only, which flash attention does not store
  overhead    = {PROCESS_OVERHEAD_GB} GiB per process (CUDA context, NCCL buffers)
  engine      = colocated: mem_fraction_static * M while rolling out, {RELEASED_ENGINE_GB} GiB
                while released (trainer-launched engines; engines started outside the trainer
                are not released, so their full share counts while training too)
  send bufs   = 4 x weights.bucket_mb on the one sender's GPU (3 in flight + a gathered expert
                batch), 3 x on every GPU with weights.senders=owners (a bucket: at least one
                layer's stacked experts in SGLang's layout); in the rollout peak
  weight sync = HF bytes of the model (bf16, or FP8: 1 B/elem of *_proj weights + an fp32
                scale per 128x128 block) / the stated bandwidth into each engine GPU: all
                of them with HF-named loads, 1/TP in SGLang's own layout (weights.layout
                auto with the tensor transport); owners: a sender sends 1/n
assumptions: routing balanced up to imb (--moe-imbalance), packed micro-batches filled to T,
sequences at their longest, bf16 activations, no CPU offload, fragmentation in the overhead."""


def _activations(
    hf: HFConfig, cfg: Config, layout: Layout, layers_stage: int, imbalance: float
) -> tuple[float, float]:
    """(bytes of one micro-batch's layer activations on a stage, bytes of the LM head's
    working set on the last stage: see `memory_formula`)."""
    b = 2 if cfg.model.dtype != "fp32" else 4
    T = cfg.train.micro_batch_tokens
    h, v = hf.hidden_size, hf.vocab_size
    d = getattr(hf, "head_dim", None) or h // hf.num_attention_heads
    nq, nkv = hf.num_attention_heads, hf.num_key_value_heads
    experts, k = num_experts(hf) or 0, getattr(hf, "num_experts_per_tok", 1)
    f = getattr(hf, "moe_intermediate_size", 0) if experts else hf.intermediate_size
    tok = T / (layout.cp * layout.tp)  # tokens per rank of a sequence-parallel tensor
    # What megatron-core's modules keep for backward, per token (tests/plan/test_plan_memory
    # measures it): each norm keeps its input, its normalised copy and its output (3h); the
    # attention keeps the fused qkv, the q/k-norm inputs and outputs, the RoPE outputs and
    # q, k, v, o (6 copies of q+k+v-sized tensors).
    attn = b * (3 * h + 6 * (nq + nkv) * d) * tok
    if experts:
        etp = layout.expert_tp
        routed = imbalance * k * T * etp / (layout.cp * layout.tp)
        # router probs/logits (fp32) and int64 routing indices per token; per routed copy the
        # permuted input (h) and fc1 out, SwiGLU in/out, fc2 in, the per-expert splits (6f).
        mlp = (b * 3 * h + 8 * experts + 8 * k) * tok + routed * b * (h + 6 * f / etp)
    else:
        mlp = b * (3 * h + 3 * f) * tok
    full_layer = attn + mlp
    if cfg.model.activation_recompute == "full":
        per_stage = layers_stage * b * h * tok + full_layer
    else:
        per_stage = layers_stage * full_layer
    return per_stage, _lm_head(cfg, layout, b, h, v)


def _lm_head(cfg: Config, layout: Layout, b: int, h: int, v: int) -> float:
    """Bytes of the LM head + log-prob working set (fused or not; see `memory_formula`)."""
    tok, vp = cfg.train.micro_batch_tokens / layout.cp, v / layout.tp
    if not cfg.model.fused_lm_head:
        return 6 * tok * vp
    # The buffers megatron_gspo.algo.lm_head allocates once per pass (tests/plan measures it).
    c = min(tok, LOGPROB_CHUNK)
    vb = min(vp, max(1, c * VOCAB_CHUNK // tok, min(h, VOCAB_CHUNK)))  # backward vocab block
    forward = 10 * c * min(vp, VOCAB_CHUNK)
    backward = 10 * c * vb + b * tok * vb + (4 + b) * tok * h + b * vp * h
    return b * tok * h + max(forward, backward)


def _micro_batches(cfg: Config, dp: int, prompt_tokens: int) -> int:
    """Packed micro-batches per mini-batch per DP rank (sequences at their longest)."""
    seqs = cfg.rl.rollout_size / cfg.rl.mini_batches_per_rollout / dp
    tokens = seqs * (prompt_tokens + cfg.rollout.max_new_tokens)
    return max(1, math.ceil(tokens / cfg.train.micro_batch_tokens))


# ---------------------------------------------------------------------------------------------
# the estimates of a plan: trainer stages, engines, weight sync


def trainer_memory(
    cfg: Config,
    hf: HFConfig,
    stages: list[StageParams],
    *,
    dp: int,
    expert_dp: int,
    micro_batches: int,
    moe_imbalance: float,
    engine_train: float,
    engine_rollout: float,
) -> tuple[MemoryEstimate, float]:
    """The most loaded pipeline stage's bytes per GPU (the largest training peak) and the
    micro-batches in flight on it; `engine_train` / `engine_rollout`: the bytes a colocated
    engine holds on the same GPU while training / rolling out (0 on separate nodes)."""
    layout = cfg.parallel
    b_p = 4 if cfg.model.dtype == "fp32" else 2
    layers_act, logits_act = _activations(
        hf, cfg, layout, hf.num_hidden_layers // layout.pp, moe_imbalance
    )
    worst: MemoryEstimate | None = None
    worst_inflight = 0.0
    for s in stages:
        master = 4 if b_p == 2 else 0  # fp32 main params behind bf16 weights
        state = 8 if cfg.optim.optimizer == "adam" else 4
        if cfg.optim.use_distributed_optimizer:  # sharded over DPxCP (dense), expert DP
            opt_elems = s.dense / (dp * layout.cp) + s.expert / expert_dp
        else:
            opt_elems = float(s.total)
        # 1F1B: stage s holds the activations of up to pp - s micro-batches; the interleaved
        # schedule warms up more of them (megatron's (1 + (pp-1)/(pp*vpp)) factor).
        inflight = float(min(layout.pp - s.stage, micro_batches))
        if layout.vpp:
            inflight *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
        last = s.stage == layout.pp - 1
        est = MemoryEstimate(
            weights=b_p * s.total,
            grads=4 * s.total,
            optimizer=(master + state) * opt_elems,
            activations=inflight * layers_act + (logits_act if last else 0.0),
            overhead=PROCESS_OVERHEAD_GB * GiB,
            engine_train=engine_train,
            engine_rollout=engine_rollout,
            send_buffers=push_buffer_bytes(
                cfg.weights.bucket_bytes,
                cfg.weights.senders,
                stacked_expert_bytes(cfg, hf, b_p),
            ),
        )
        if worst is None or est.train_peak > worst.train_peak:
            worst, worst_inflight = est, inflight
    assert worst is not None  # count_params gives every layout at least one stage
    return worst, worst_inflight


@dataclass(frozen=True)
class EngineEstimate:
    """What the rollout engines hold: the planner's engine table and the numbers it checks."""

    params: int
    """Parameters of the HF model (every tensor the engines load)."""
    weights_per_gpu: float
    """Bytes of engine weights per GPU (the model split over `rollout.launch.tp_size`)."""
    table: dict[str, Any]
    """`Plan.engine`: engines, GPUs, weights, KV-cache tokens and sequences, samples each."""


def engine_estimate(
    cfg: Config,
    hf: HFConfig,
    launch: LaunchConfig,
    *,
    engine_gpus: int,
    gpu_mem_bytes: float,
    prompt_tokens: int,
    colocated: bool,
) -> EngineEstimate:
    """The engines' weights and KV cache per GPU: `launch` (a `rollout.launch` section) on
    `engine_gpus` GPUs of `gpu_mem_bytes`, sequences of `prompt_tokens` + max_new_tokens."""
    frac = launch.mem_fraction_static or DEFAULT_MEM_FRACTION
    num_engines = engine_gpus // launch.tp_size
    dtype_bytes = 4 if launch.dtype in ("float32", "fp32") else 2
    params, engine_bytes = hf_tensor_bytes(
        hf, dtype_bytes=2, fp8=cfg.weights.fp8 or launch.quantization == "fp8"
    )
    engine_weights = engine_bytes / launch.tp_size
    d = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = max(1, hf.num_key_value_heads // launch.tp_size)
    kv_b = 1 if "fp8" in launch.kv_cache_dtype else dtype_bytes
    kv_per_token = 2 * hf.num_hidden_layers * kv_heads * d * kv_b
    kv_tokens = max(0.0, frac * gpu_mem_bytes - engine_weights) / kv_per_token
    seq_tokens = prompt_tokens + cfg.rollout.max_new_tokens
    table = dict(
        num_engines=num_engines,
        tp_size=launch.tp_size,
        gpus=engine_gpus,
        weights_gb=engine_weights / GiB,
        mem_fraction_static=frac,
        kv_cache_tokens=int(kv_tokens),
        kv_sequences=int(kv_tokens // seq_tokens),
        samples_per_engine=cfg.rl.rollout_size / max(1, num_engines),
        colocated=colocated,
    )
    return EngineEstimate(params=params, weights_per_gpu=engine_weights, table=table)


def sync_estimate(
    cfg: Config, hf: HFConfig, gb_per_s: float, *, gpus_per_node: int, trainer_world: int
) -> dict[str, float]:
    """Bytes of one weight sync (`weights.dtype`, block FP8 with `weights.fp8`), through the
    busiest sender, into each engine GPU, and its time at `gb_per_s`. `weights.senders=owners`
    splits the bytes over each scope's ranks (a node for tensor, the trainer for distributed).
    An engine GPU receives all of them with HF names (SGLang loads every tensor on every TP
    rank); in SGLang's own layout (`weights.layout` resolving to engine) only its rank's part,
    about 1/TP of them (`rollout.launch.tp_size`; docs/performance.md, "SGLang's own layout")."""
    send_dtype_bytes = 4 if (cfg.weights.dtype == "float32") else 2
    _, sync_bytes = hf_tensor_bytes(hf, dtype_bytes=send_dtype_bytes, fp8=cfg.weights.fp8)
    senders = 1
    if cfg.weights.senders == "owners":
        senders = gpus_per_node if cfg.weights.transport == "tensor" else trainer_world
    launch = cfg.rollout.launch
    tp = launch.tp_size if launch is not None else 1
    engine_gpu_bytes = sync_bytes / tp if cfg.weights.resolved_layout == "engine" else sync_bytes
    return dict(
        bytes=float(sync_bytes),
        sender_bytes=sync_bytes / senders,
        engine_gpu_bytes=float(engine_gpu_bytes),
        gb_per_s=gb_per_s,
        seconds=engine_gpu_bytes / 1e9 / gb_per_s,
        fp8=float(cfg.weights.fp8),
    )
