"""The CPU model behind the embedded engine: a HF transformers causal LM with SGLang's numerics.

Generation is one sequence at a time with a KV cache. Per step, as SGLang's default sampler
(`sglang/srt/layers/sampler.py`) does: `logits / T`, full-vocabulary softmax, top-k / top-p /
min-p applied to a copy for sampling only, and the returned log-prob is
`log_softmax(logits / T)` of the sampled token (greedy: T = 1). With
`return_original_logprob` (SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB=1`) the log-prob is
`log_softmax(logits)` whatever T is. Finish rules follow `Req.update_finish_state`: a stop
token or EOS wins over the length cap; the matched token stays in the output.

Shape legend: `V` vocabulary, `P` prompt length.
"""

from __future__ import annotations

import dataclasses
import random
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from megatron_gspo.engines.wire import overall_checksum, tensor_checksum

if TYPE_CHECKING:
    from sglang.srt.sampling.sampling_params import SamplingParams

    from megatron_gspo.layout import HFConfig

_SAMPLING_EPS = 1e-6
_TOP_K_ALL = 1 << 30
_EXPERT_RE = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


@dataclasses.dataclass(kw_only=True, slots=True)
class GenerationOutput:
    """One finished sequence."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    routed_experts: torch.Tensor | None = None
    """`[P + R - 1, L, K]` int32 routed expert ids (`return_routed_experts`), else None."""


class HFPolicy:
    """A HF causal LM on CPU that generates like SGLang and accepts SGLang-style weight loads."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        return_original_logprob: bool = False,
        quantization: str | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        from megatron_gspo.engines.embedded import fp8_emulation

        self.model_path = str(model_path)
        fp8_checkpoint = quantization is not None and fp8_emulation.is_block_fp8(self.model_path)
        if fp8_checkpoint:  # its e4m3 tensors and scales are loaded below, as a push would
            self.model = fp8_emulation.unquantised_model(self.model_path, dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        self.model.eval()
        self.return_original_logprob = return_original_logprob
        self.quantization = quantization
        self.fp8 = None if quantization is None else fp8_emulation.emulate(self.model, quantization)
        """Block-FP8 weights (quantised linears, held e4m3 + scale) when quantization is set."""
        cfg = cast("HFConfig", self.model.config)  # (Module attributes type as Tensor | Module)
        self.vocab_size = int(cfg.vocab_size)
        self.context_len = int(getattr(cfg, "max_position_embeddings", 1 << 20))
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self.eos_token_ids: set[int] = set(
            [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        )
        # Weight loads and forward steps take this lock, so an update never lands mid-step.
        self.lock = threading.RLock()
        self.weights_epoch = 0
        """Bumped by every weight load (a retracted request rebuilds its KV cache if it moved)."""
        self._rng = random.Random()
        if fp8_checkpoint:
            self.load_from_disk(self.model_path)
        from megatron_gspo.engines.embedded.routes import RouteCapture

        self.routes = RouteCapture(self.model)
        """Hooks on the MoE routers: the experts each fed token went to (routing replay)."""

    # ---- generation --------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        input_ids: Sequence[int],
        sp: SamplingParams,
        *,
        should_abort: Callable[[], bool] = lambda: False,
        wait_if_paused: Callable[[], bool] = lambda: False,
        on_token: Callable[[int], None] = lambda n: None,
        return_routed_experts: bool = False,
    ) -> GenerationOutput:
        """Generate one sequence; `sp` is a normalised `sglang` `SamplingParams`.

        `wait_if_paused` blocks while the engine is paused and returns True when the request
        was retracted meanwhile: then, as SGLang does, its KV cache is rebuilt from the tokens
        so far, so the rest of the response sees weights pushed during the pause.
        `return_routed_experts`: also the experts each fed token was routed to (`routes.py`).
        `on_token(n)`: called after each sampled token, with the response length so far.
        """
        from transformers import DynamicCache

        seed = sp.sampling_seed if sp.sampling_seed is not None else self._rng.getrandbits(62)
        gen = torch.Generator().manual_seed(int(seed))
        stop_ids = set(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            stop_ids |= self.eos_token_ids
        max_new = int(sp.max_new_tokens if sp.max_new_tokens is not None else 128)
        out_ids: list[int] = []
        out_lps: list[float] = []
        cache = DynamicCache()
        step_ids = torch.tensor([list(input_ids)], dtype=torch.long)
        epoch = self.weights_epoch
        routes = None
        if return_routed_experts:
            routes = self.routes.buffer(min(len(input_ids) + max_new, self.context_len))
        fed = 0  # position of the first token of `step_ids`

        def done(reason: dict[str, Any]) -> GenerationOutput:
            n = len(input_ids) + len(out_ids) - 1
            kept = routes[: max(n, 0)].clone() if routes is not None else None
            return GenerationOutput(
                output_ids=out_ids, logprobs=out_lps, finish_reason=reason, routed_experts=kept
            )

        while True:
            if max_new == 0 or len(input_ids) + len(out_ids) >= self.context_len:
                return done({"type": "length", "length": len(out_ids)})
            if wait_if_paused() and epoch != self.weights_epoch:
                cache, epoch = DynamicCache(), self.weights_epoch
                step_ids = torch.tensor([list(input_ids) + out_ids], dtype=torch.long)
                fed = 0
            if should_abort():
                return done(
                    {
                        "type": "abort",
                        "message": "Abort in waiting queue" if not out_ids else "Aborted",
                        "status_code": None,
                        "err_type": None,
                    }
                )
            with self.lock, self.routes.record(routes, fed):
                out = self.model(input_ids=step_ids, past_key_values=cache, use_cache=True)
            fed += step_ids.shape[1]
            cache = out.past_key_values
            logits_v = out.logits[0, -1].float()
            tok, lp = self._sample(logits_v, sp, gen)
            out_ids.append(tok)
            out_lps.append(lp)
            on_token(len(out_ids))
            step_ids = torch.tensor([[tok]], dtype=torch.long)
            if tok in stop_ids:
                return done({"type": "stop", "matched": tok})
            if len(out_ids) >= max_new:
                return done({"type": "length", "length": max_new})

    def _sample(
        self, logits_v: torch.Tensor, sp: SamplingParams, gen: torch.Generator
    ) -> tuple[int, float]:
        temperature = float(sp.temperature)
        top_k = int(sp.top_k) if sp.top_k not in (None, -1) else _TOP_K_ALL
        if top_k == 1 or temperature < _SAMPLING_EPS:
            # Greedy: SGLang normalises T to 1, so the log-prob is the untempered one.
            tok = int(torch.argmax(logits_v))
            return tok, float(torch.log_softmax(logits_v, -1)[tok])
        scaled_v = logits_v / temperature
        logprobs_v = torch.log_softmax(scaled_v, -1)
        probs_v = logprobs_v.exp()
        sorted_v, order_v = probs_v.sort(descending=True)
        cum_v = sorted_v.cumsum(-1)
        keep_v = (cum_v - sorted_v) <= float(sp.top_p)
        keep_v &= torch.arange(sorted_v.numel()) < min(top_k, sorted_v.numel())
        if float(sp.min_p) > 0:
            keep_v &= sorted_v >= sorted_v[0] * float(sp.min_p)
        keep_v[0] = True
        choice = int(torch.multinomial(sorted_v * keep_v, 1, generator=gen))
        tok = int(order_v[choice])
        if self.return_original_logprob:
            return tok, float(torch.log_softmax(logits_v, -1)[tok])
        return tok, float(logprobs_v[tok])

    # ---- weights -----------------------------------------------------------------------
    def _target(self, params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The model tensor (or view) a HF checkpoint name loads into.

        transformers 5 fuses MoE experts (`experts.gate_up_proj` [E, 2I, H] = gate rows then
        up rows, `experts.down_proj` [E, H, I]) while checkpoints, SGLang and the trainer's
        HF export use per-expert names, as SGLang's `load_weights` does.
        """
        if name in params:
            return params[name]
        m = _EXPERT_RE.fullmatch(name)
        if m is not None:
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            if proj == "down_proj" and f"{prefix}.down_proj" in params:
                return params[f"{prefix}.down_proj"][e]
            fused = params.get(f"{prefix}.gate_up_proj")
            if fused is not None:
                half = fused.shape[1] // 2
                return fused[e, :half] if proj == "gate_proj" else fused[e, half:]
        raise KeyError(f"unknown weight name {name!r}")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model (casting dtype); returns how many were loaded.

        Unknown names or shape mismatches raise: a silently skipped tensor is the classic
        weight-sync bug.
        """
        params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        n = 0
        with self.lock, torch.no_grad():
            for name, t in named_tensors:
                if self.fp8 is not None and self.fp8.load(name, t):
                    n += 1
                    continue
                p = self._target(params, name)
                if tuple(p.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(p.shape)}")
                p.copy_(t.to(device=p.device, dtype=p.dtype))
                n += 1
            self.weights_epoch += 1
        return n

    def load_from_disk(self, path: str | Path) -> int:
        """Load every safetensors file of a HF checkpoint directory."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        n = 0
        for f in files:
            n += self.load_weights(load_file(str(f)).items())
        self.model_path = str(path)
        return n

    def checksums(self, skip: Sequence[str] | None = None) -> dict[str, Any]:
        """Per-tensor checksums (HF names) in SGLang's `/weights_checker` format."""
        with self.lock:
            sums = {
                name: tensor_checksum(p)
                for name, p in self.checkpoint_tensors()
                if not any(s in name for s in (skip or ()))
            }
        return {"checksums": sums, "per_gpu_checksum": overall_checksum(sums)}

    def checkpoint_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The model's tensors under checkpoint (per-expert) HF names, the names the trainer
        sends: transformers' fused expert tensors are split back into per-expert views; with
        FP8 emulation, quantised weights are their e4m3 tensors plus `<name>_scale_inv`."""
        if self.fp8 is not None:
            yield from self.fp8.checkpoint_tensors()
        for name, p in self.model.named_parameters():
            if self.fp8 is not None and name in self.fp8.owned:
                continue
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith(".experts") and leaf == "gate_up_proj":
                half = p.shape[1] // 2
                for e in range(p.shape[0]):
                    yield f"{prefix}.{e}.gate_proj.weight", p[e, :half]
                    yield f"{prefix}.{e}.up_proj.weight", p[e, half:]
            elif prefix.endswith(".experts") and leaf == "down_proj":
                for e in range(p.shape[0]):
                    yield f"{prefix}.{e}.down_proj.weight", p[e]
            else:
                yield name, p

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """As SGLang: the tensor (HF checkpoint name) as fp32 nested lists, truncated on dim 0."""
        t = self.fp8.target(name) if self.fp8 is not None else None
        if t is None:
            t = self._target(dict(self.model.named_parameters()), name)
        return t.detach().float().cpu().numpy().tolist()[:truncate_size]
