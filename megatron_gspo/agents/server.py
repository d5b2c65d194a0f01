"""The OpenAI-compatible, token-exact endpoint agents talk to, in front of the rollout engines.

    POST /v1/chat/completions            trajectory id: header `X-Trajectory-Id` or body field
                                         `trajectory_id` (openai: `extra_body=`)
    POST /t/{trajectory_id}/v1/chat/completions   the same, the id in the base URL (agents that
                                         only take a `base_url` need nothing else)
    GET  /v1/models, /t/{id}/v1/models   the one policy
    GET  /trajectories/{id}              what was recorded (ids, log-probs, versions, counts)

A call is rendered with the model's chat template, sent to the engines as token ids
(`Sampler.agenerate`: the pool's retries and fail-over apply), answered in OpenAI's format
(tool calls parsed by SGLang's parser, `engines/tool_calls.py`), and recorded as a `Turn` of its
trajectory: prompt and response ids as the engine saw them, engine log-probs, weight version.
A later call that sends the conversation back reuses those ids (`agents/trajectory.py`), so the
training sample is exactly what was sampled, whatever the agent's own tokenisation.

Streaming (`stream: true`) answers in OpenAI's server-sent-events format once the response is
complete (the engines generate token ids without streaming them): the same chunks a streaming
server sends (role, content per token, tool calls, finish reason, `[DONE]`, usage with
`stream_options.include_usage`), without the early first token.

Errors are OpenAI's envelope `{"error": {"message", "type", "code"}}`: 400 for a request the
endpoint cannot serve (the message names the field), 409 for a refused edit
(`on_edit: refuse`), 503 (retried by the openai client) when generation was aborted by a weight
push or no engine is left.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from megatron_gspo.agents.chat import ChatDeltaError, ChatRenderer, message_key
from megatron_gspo.agents.config import AgentEndpointConfig
from megatron_gspo.agents.trajectory import Trajectory, TrajectoryStore, Turn
from megatron_gspo.engines.protocols import EngineError, NoEnginesLeft, Sampler
from megatron_gspo.engines.tool_calls import parse_tool_calls, tool_call_parser_names
from megatron_gspo.engines.types import Sample, SamplingParams

if TYPE_CHECKING:
    from megatron_gspo.data.tokenizer import Tokenizer

__all__ = ["AgentEndpoint", "RequestError"]

HEADER = "X-Trajectory-Id"


class RequestError(Exception):
    """A call the endpoint answers with an OpenAI error envelope."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _error(e: RequestError) -> web.Response:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    body = {"error": {"message": str(e), "type": kind, "code": e.code, "param": None}}
    return web.json_response(body, status=e.status)


class AgentEndpoint:
    """The endpoint's app and its server thread; `start()` returns the base URL
    (`.../v1` is what an OpenAI client's `base_url` takes)."""

    def __init__(
        self,
        generator: Sampler,
        tokenizer: Tokenizer,
        config: AgentEndpointConfig | None = None,
        *,
        store: TrajectoryStore | None = None,
    ) -> None:
        self.generator = generator
        self.tokenizer = tokenizer
        self.config = config or AgentEndpointConfig()
        self.renderer = ChatRenderer(tokenizer)
        self.store = store or TrajectoryStore()
        self.url = ""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None

    # ---- the app ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/t/{tid}/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/t/{tid}/v1/models", self._models)
        app.router.add_get("/trajectories/{tid}", self._trajectory)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "megatron-gspo",
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _trajectory(self, request: web.Request) -> web.Response:
        tid = request.match_info["tid"]
        if tid not in self.store.ids():
            return _error(RequestError(404, f"no trajectory {tid!r}", "not_found"))
        traj = self.store.get(tid)
        turns = [
            {
                k: getattr(t, k)
                for k in (
                    "index",
                    "parent",
                    "attach",
                    "prompt_ids",
                    "response_ids",
                    "logprobs",
                    "weight_version",
                    "finish_reason",
                )
            }
            for t in traj.turns
        ]
        return web.json_response(
            {"trajectory_id": tid, "turns": turns, "counts": dict(traj.counts)}
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except ValueError as e:
                raise RequestError(400, f"the body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object")
            tid = (
                request.match_info.get("tid")
                or request.headers.get(HEADER)
                or body.get("trajectory_id")
            )
            if not tid:
                raise RequestError(
                    400,
                    f"no trajectory id: send the {HEADER} header, a `trajectory_id` field, or "
                    "use the base URL .../t/<trajectory_id>/v1",
                    "missing_trajectory_id",
                )
            return await self._complete(request, str(tid), body)
        except RequestError as e:
            return _error(e)

    # ---- one call ---------------------------------------------------------------------------
    def _sampling(self, body: dict[str, Any]) -> tuple[SamplingParams, int]:
        cap = self.config.max_new_tokens
        want = body.get("max_completion_tokens") or body.get("max_tokens") or cap
        n = body.get("n") or 1
        if not isinstance(n, int) or not 1 <= n <= self.config.max_n:
            raise RequestError(400, f"n must be an integer in [1, {self.config.max_n}]")
        stop_ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        stop = body.get("stop")
        for s in [stop] if isinstance(stop, str) else stop or []:
            ids = self.renderer.encode(s)
            if len(ids) != 1:
                raise RequestError(
                    400,
                    f"stop {s!r} is {len(ids)} tokens: only single-token stop strings are "
                    "served (a cut inside the sampled ids would train on text the agent never saw)",
                )
            stop_ids += ids
        cfg = self.config
        temperature = body.get("temperature")
        temperature = cfg.temperature if cfg.temperature is not None else temperature
        top_p = cfg.top_p if cfg.top_p is not None else body.get("top_p")
        try:
            sampling = SamplingParams(
                max_new_tokens=min(int(want), cap),
                temperature=1.0 if temperature is None else float(temperature),
                top_p=1.0 if top_p is None else float(top_p),
                top_k=int(body.get("top_k") or -1),
                stop_token_ids=tuple(dict.fromkeys(stop_ids)),
                seed=body.get("seed"),
            )
        except (TypeError, ValueError) as e:
            raise RequestError(400, f"bad sampling parameter: {e}") from None
        return sampling, n

    def _prompt(
        self, traj: Trajectory, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], int | None, str | None, str]:
        """(prompt ids, parent turn, attach, how) for this call's messages."""
        keys = [message_key(m) for m in messages]
        m = self.store.match(traj, keys)
        how = "root" if not traj.turns else "unmatched"
        if m.parent is not None:
            parent = traj.turns[m.parent]
            try:
                if m.attach == "response":
                    rest = self.renderer.after_model(messages[m.rest :], parent.response_ids)
                    return (
                        parent.prompt_ids + parent.response_ids + rest,
                        m.parent,
                        m.attach,
                        "continued",
                    )
                rest = self.renderer.after_prompt(messages[m.rest :])
                return parent.prompt_ids + rest, m.parent, m.attach, "replaced"
            except ChatDeltaError:
                how = "unmatched"
        return self.renderer.prompt_ids(messages, tools), None, None, how

    async def _complete(
        self, request: web.Request, tid: str, body: dict[str, Any]
    ) -> web.StreamResponse:
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and "role" in m for m in messages)
        ):
            raise RequestError(400, "messages must be a non-empty list of {role, content} objects")
        tools = body.get("tools") or None
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise RequestError(
                400, f"tool_choice {choice!r} is not served (no constrained decoding): use auto"
            )
        sampling, n = self._sampling(body)
        traj = self.store.get(tid)
        prompt, parent, attach, how = self._prompt(traj, messages, tools)
        if how in ("replaced", "unmatched") and self.config.on_edit == "refuse":
            traj.counts["refused"] += 1
            raise RequestError(
                409,
                f"trajectory {tid}: the messages do not extend a recorded turn ({how}); this "
                "endpoint refuses edited conversations (on_edit: refuse)",
                "edited_conversation",
            )
        traj.counts[how] += 1
        try:
            result = await self.generator.agenerate(
                [prompt], sampling, n=n, rid_prefix=f"agent-{uuid.uuid4().hex[:12]}"
            )
        except NoEnginesLeft as e:
            raise RequestError(503, str(e), "no_engine") from None
        except EngineError as e:
            status = e.status if e.status is not None and 400 <= e.status < 500 else 502
            raise RequestError(status, f"the engine refused the request: {e}", "engine") from None
        samples = result.samples
        if len(samples) != n:
            raise RequestError(502, f"{n - len(samples)} of {n} responses were rejected", "engine")
        if any(s.finish_reason == "abort" for s in samples):
            traj.counts["aborted"] += 1
            raise RequestError(503, "generation was aborted (a weight update); retry", "aborted")
        parse = bool(tools) and choice != "none" and self.config.tool_call_parser is not None
        choices = []
        for i, s in enumerate(samples):
            message, finish = self._message(s, tools if parse else None)
            self.store.add(
                traj,
                Turn(
                    index=len(traj.turns),
                    parent=parent,
                    attach=attach,  # type: ignore[arg-type]
                    keys=tuple(message_key(m) for m in messages),
                    answer_key=message_key(message),
                    prompt_ids=list(prompt),
                    response_ids=list(s.response_ids),
                    logprobs=list(s.logprobs),
                    logprob_mask=list(s.logprob_mask),
                    weight_version=s.weight_version,
                    finish_reason=s.finish_reason,
                    engine_id=s.engine_id,
                ),
            )
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": self._logprobs(s) if body.get("logprobs") else None,
                }
            )
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": sum(len(s.response_ids) for s in samples),
            "total_tokens": len(prompt) * n + sum(len(s.response_ids) for s in samples),
        }
        out = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.config.model_name,
            "choices": choices,
            "usage": usage,
            "trajectory_id": tid,
            "weight_version": samples[0].weight_version,
        }
        if body.get("stream"):
            return await self._stream(request, out, samples, body)
        return web.json_response(out)

    def _message(self, s: Sample, tools: list[dict[str, Any]] | None) -> tuple[dict[str, Any], str]:
        text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        calls = []
        if tools:
            assert self.config.tool_call_parser is not None
            text, parsed = parse_tool_calls(text, tools, self.config.tool_call_parser)
            calls = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in parsed
            ]
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        finish = "length" if s.finish_reason == "length" else "tool_calls" if calls else "stop"
        return message, finish

    def _logprobs(self, s: Sample) -> dict[str, Any]:
        content = []
        for tok, lp in zip(s.response_ids, s.logprobs, strict=True):
            piece = self.tokenizer.decode([tok], skip_special_tokens=False)
            content.append(
                {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
            )
        return {"content": content}

    async def _stream(
        self, request: web.Request, out: dict[str, Any], samples: list[Sample], body: dict
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        head = {k: out[k] for k in ("id", "created", "model")}

        async def send(choices: list[dict[str, Any]], **extra: object) -> None:
            chunk = {**head, "object": "chat.completion.chunk", "choices": choices, **extra}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        for c, s in zip(out["choices"], samples, strict=True):
            i, msg = c["index"], c["message"]
            await send(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            )
            for piece in self._pieces(s, msg):
                await send([{"index": i, "delta": {"content": piece}, "finish_reason": None}])
            for k, tc in enumerate(msg.get("tool_calls") or []):
                await send(
                    [
                        {
                            "index": i,
                            "delta": {"tool_calls": [{"index": k, **tc}]},
                            "finish_reason": None,
                        }
                    ]
                )
            await send(
                [
                    {
                        "index": i,
                        "delta": {},
                        "finish_reason": c["finish_reason"],
                        "logprobs": c["logprobs"],
                    }
                ]
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            await send([], usage=out["usage"])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _pieces(self, s: Sample, msg: dict[str, Any]) -> list[str]:
        """The content as per-token text deltas (all of it at once after tool-call parsing)."""
        content = msg.get("content") or ""
        if msg.get("tool_calls"):
            return [content] if content else []
        pieces, prev = [], ""
        for k in range(1, len(s.response_ids) + 1):
            text = self.tokenizer.decode(s.response_ids[:k], skip_special_tokens=True)
            if text.startswith(prev) and len(text) > len(prev):
                pieces.append(text[len(prev) :])
                prev = text
        if prev != content:  # a decoder that is not prefix-stable: send what is left whole
            pieces = [content]
        return pieces

    # ---- the server thread ---------------------------------------------------------------
    def start(self) -> str:
        """Serve on `config.host:config.port` from a thread of this process; returns the URL.
        SGLang's tool-call parsers load here (seconds), not inside the first call's handler
        where the import would hold up every agent; an unknown parser name raises ValueError."""
        parser = self.config.tool_call_parser
        if parser is not None and parser not in tool_call_parser_names():
            raise ValueError(
                f"agent endpoint tool_call_parser={parser!r} is not one of SGLang's "
                f"{', '.join(tool_call_parser_names())}"
            )
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                self._runner = web.AppRunner(self.app(), access_log=None)
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, self.config.host, self.config.port)
                loop.run_until_complete(site.start())
                host, port = self._runner.addresses[0][:2]
                self.url = f"http://{host}:{port}"
            except BaseException as e:  # reported by start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="agent-endpoint")
        self._thread.start()
        ready.wait()
        if failure:
            raise RuntimeError(f"agent endpoint did not start: {failure[0]}") from failure[0]
        return self.url

    def stop(self) -> None:
        """Stop serving (calls in flight are cancelled)."""
        if self._loop is None or self._runner is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)
        self._loop = None
