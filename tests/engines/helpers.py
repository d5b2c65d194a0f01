"""Independent references for the rollout tests (plain HF forward passes, no engine code)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


class ThreadedApp:
    """An aiohttp app served on a loopback port from a thread of this process (until `stop`).
    Subclasses build the app and call `serve(app)`; handlers may await `self._release`, which
    `stop` sets."""

    def serve(self, app: Any) -> None:
        import asyncio
        import threading

        from aiohttp import web

        from megatron_gspo.dist import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._runner = web.AppRunner(app)
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._release = asyncio.Event()
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            self._loop.run_until_complete(site.start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)

    def stop(self) -> None:
        import asyncio

        self._loop.call_soon_threadsafe(self._release.set)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class FaultyProxy(ThreadedApp):
    """A loopback HTTP server in front of a real engine that spoils its `/generate` answers.

    `mode`: "ok" (forward), "5xx" (HTTP 503), "text" (200 with a non-JSON body), "shape"
    (200 with JSON that is no /generate answer), "mismatch" (first sample one log-prob short),
    "nan" (every first log-prob NaN), "hang" (never answers). Other routes are forwarded;
    `/abort_request` bodies are recorded in `aborts`, and with `hang_aborts` never answered.
    """

    def __init__(self, upstream: str, mode: str = "ok") -> None:
        import json

        import aiohttp
        from aiohttp import web

        self.mode, self.hits = mode, 0
        self.aborts: list[dict] = []
        self.hang_aborts = False

        async def forward(request: web.Request) -> tuple[int, bytes]:
            body = await request.read()
            async with (
                aiohttp.ClientSession() as s,
                s.request(
                    request.method, upstream + request.path, data=body, headers=request.headers
                ) as r,
            ):
                return r.status, await r.read()

        async def generate(request: web.Request) -> web.Response:
            self.hits += 1
            if self.mode == "hang":
                await self._release.wait()  # until stop()
            if self.mode == "5xx":
                return web.json_response({"error": {"message": "overloaded"}}, status=503)
            if self.mode == "text":
                return web.Response(text="<html>502 Bad Gateway</html>", status=200)
            if self.mode == "shape":
                return web.json_response({"text": "hello"})
            status, raw = await forward(request)
            items = json.loads(raw)
            if self.mode == "mismatch":
                items[0]["meta_info"]["output_token_logprobs"].pop()
            if self.mode == "nan":
                for it in items:
                    it["meta_info"]["output_token_logprobs"][0][0] = float("nan")
            return web.Response(body=json.dumps(items).encode(), status=status)

        async def other(request: web.Request) -> web.Response:
            if request.path == "/abort_request":
                self.aborts.append(json.loads(await request.read()))
                if self.hang_aborts:
                    await self._release.wait()
            status, raw = await forward(request)
            return web.Response(body=raw, status=status, content_type="application/json")

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_route("*", "/{tail:.*}", other)
        self.serve(app)


class HFBridge:
    """Stands in for megatron-bridge in `WeightSync`: exports fixed HF-named tensors."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def export_hf_weights(self, model, cpu: bool = True, show_progress: bool = False):
        yield from sorted(self.weights.items())


def abs_logp_diff(samples, trainer_logprobs) -> float:
    """Mean |logp_trainer - logp_engine| over the valid response tokens of `samples`."""
    import math

    total, count = 0.0, 0
    for s, tl in zip(samples, trainer_logprobs, strict=True):
        for e, t, ok in zip(s.logprobs, tl, s.logprob_mask, strict=True):
            if ok and math.isfinite(float(t)):
                total += abs(float(t) - e)
                count += 1
    return total / count if count else 0.0


def wait_generating(engine: Any, count: int = 1, timeout: float = 60.0) -> None:
    """Wait until `count` requests run on the embedded `engine`, each with a token generated:
    an abort or pause after this lands mid-response, however loaded the machine is."""
    deadline = time.monotonic() + timeout
    while True:
        states = list(engine.tm.rid_to_state.values())
        if len(states) >= count and all(s.output_len > 0 for s in states):
            return
        assert time.monotonic() < deadline, f"{count} requests never started generating"
        time.sleep(0.01)
