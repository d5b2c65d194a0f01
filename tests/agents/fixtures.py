"""A tiny model that has memorised one tool-calling conversation (so a CPU test sees real tool
calls from a real engine), and the conversation itself.

The model writes its tool call compactly (`{"a":2,"b":3}`) while the chat template renders
arguments with `tojson` (`{"a": 2, "b": 3}`): re-rendering the conversation changes its ids.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_gspo.data.chat_toy import build_chat_toy_tokenizer
from megatron_gspo.data.tiny_model import build_tiny_hf_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
QUESTION = "add 2 and 3"
CALL_TEXT = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>'
TOOL_RESULT = "5"
ANSWER = "5"


def conversation_ids(tok) -> tuple[list[int], list[bool]]:
    """The memorised conversation (ids) and which positions are the model's (to learn)."""
    first = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    parts = [
        (first, False),
        (CALL_TEXT + "<|im_end|>", True),
        (
            f"\n<|im_start|>user\n<tool_response>\n{TOOL_RESULT}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n",
            False,
        ),
        (ANSWER + "<|im_end|>", True),
    ]
    ids: list[int] = []
    learn: list[bool] = []
    for text, model in parts:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        learn += [model] * len(piece)
    return ids, learn


def memorised_checkpoint(path: Path, steps: int = 300) -> Path:
    """Train the tiny Qwen3-MoE on the conversation until greedy decoding reproduces it."""
    tok = build_chat_toy_tokenizer()
    ids, learn = conversation_ids(tok)
    model = build_tiny_hf_model(seed=0).train()
    x = torch.tensor([ids])
    target = torch.tensor(ids[1:])
    keep = torch.tensor(learn[1:])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(input_ids=x).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits[keep], target[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            # greedy decoding reproduces it once every learnt position's argmax is right
            if (logits[keep].argmax(-1) == target[keep]).all() and loss.item() < 0.05:
                break
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


class RecordingProxy:
    """A loopback proxy in front of an engine that records every `/generate` it forwards:
    (request body, answer items) in arrival order: the reference of what the engine saw and
    sampled, taken outside the code under test."""

    def __init__(self, upstream: str) -> None:
        import json

        import aiohttp
        from aiohttp import web

        from tests.engines.helpers import ThreadedApp

        self.calls: list[tuple[dict, list[dict]]] = []

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            async with (
                aiohttp.ClientSession() as s,
                s.request(
                    request.method, upstream + request.path, data=body, headers=request.headers
                ) as r,
            ):
                status, raw = r.status, await r.read()
            if request.path == "/generate" and status == 200:
                items = json.loads(raw)
                self.calls.append((json.loads(body), items if isinstance(items, list) else [items]))
            return web.Response(body=raw, status=status, content_type="application/json")

        self._app = ThreadedApp()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        self._app.serve(app)
        self.url = self._app.url

    def stop(self) -> None:
        self._app.stop()

    def engine_turns(self, since: int = 0) -> list[tuple[list[int], list[int], list[float]]]:
        """(input ids, output ids, log-probs) of every sample the engine answered, in order."""
        out = []
        for body, items in self.calls[since:]:
            ids = body["input_ids"]
            prompts = [ids] if ids and isinstance(ids[0], int) else ids
            for prompt, item in zip(prompts, items, strict=True):
                lps = [e[0] for e in item["meta_info"]["output_token_logprobs"]]
                out.append((list(prompt), list(item["output_ids"]), lps))
        return out


def check_token_exact(sample, engine_turns) -> None:
    """`sample` trains on exactly the engine's turns: each turn's input is a prefix of the
    sequence, its output follows it with the engine's log-probs, and nothing else is trained."""
    full = sample.prompt_ids + sample.response_ids
    p = len(sample.prompt_ids)
    trained = [False] * len(full)
    for k, (inp, out, lps) in enumerate(engine_turns):
        assert full[: len(inp)] == inp, f"engine turn {k}: its input is not the sequence's prefix"
        end = len(inp) + len(out)
        assert full[len(inp) : end] == out, f"engine turn {k}: its output is not in the sequence"
        assert len(inp) >= p, f"engine turn {k} starts inside the prompt"
        assert sample.logprobs[len(inp) - p : end - p] == lps, f"engine turn {k}: log-probs differ"
        trained[len(inp) : end] = [True] * len(out)
    assert sample.logprob_mask == trained[p:], "trained tokens are not exactly the engine's"
    for k, (inp, _out, _) in enumerate(engine_turns[1:]):
        prev_in, prev_out, _ = engine_turns[k]
        assert inp[: len(prev_in) + len(prev_out)] == prev_in + prev_out  # token-in, token-out
