"""The agent endpoint, driven by the real `openai` client through multi-turn tool-calling
conversations on the embedded CPU engine: the training sequence's ids and log-probs equal what
the engine received and returned, turn by turn, edited turns included.

The reference is what a recording proxy between the endpoint and the engine saw
(`fixtures.RecordingProxy`), not the endpoint's own records. The tiny model memorised one
tool-calling conversation (`fixtures.memorised_checkpoint`), so greedy decoding makes real tool
calls; it writes its call compactly while the chat template renders it with spaces, so a
re-rendering endpoint would train on ids the engine never sampled
(`test_the_check_catches_a_re_tokenisation` plants that).
"""

from __future__ import annotations

import json

import pytest

from megatron_gspo.agents.config import AgentEndpointConfig
from megatron_gspo.agents.server import AgentEndpoint
from megatron_gspo.agents.trajectory import to_samples
from megatron_gspo.data.chat_toy import build_chat_toy_tokenizer
from tests.agents.fixtures import QUESTION, TOOLS, check_token_exact

openai = pytest.importorskip("openai")


def _client(endpoint: AgentEndpoint, tid: str):
    return openai.OpenAI(
        base_url=f"{endpoint.url}/t/{tid}/v1", api_key="none", max_retries=0, timeout=600
    )


def _add(call) -> str:
    args = json.loads(call.function.arguments)
    return str(int(args["a"]) + int(args["b"]))


def _agent(client, *, edit=None, stream=False) -> tuple[list[dict], list]:
    """A plain OpenAI tool-calling agent: ask, run the tool calls, ask again until no call.
    `edit(message) -> message` changes the assistant message before it is sent back."""
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    answers = []
    for _ in range(3):
        if stream:
            msg = _streamed(client, messages)
        else:
            resp = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, temperature=0.0, max_tokens=128
            )
            msg = resp.choices[0].message.model_dump()
        answers.append(msg)
        if edit is not None and msg.get("tool_calls") and len(answers) == 1:
            msg = edit(msg)
        messages.append(msg)
        if not msg.get("tool_calls"):
            break
        for call in msg["tool_calls"]:
            c = openai.types.chat.ChatCompletionMessageToolCall.model_validate(call)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": _add(c)})
    return messages, answers


def _streamed(client, messages) -> dict:
    content, calls = "", {}
    stream = client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=TOOLS,
        temperature=0.0,
        max_tokens=128,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(
                    tc.index,
                    {"id": tc.id, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["function"]["name"] += tc.function.name or ""
                slot["function"]["arguments"] += tc.function.arguments or ""
    msg: dict = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return msg


def test_tool_conversation_is_token_exact(stack):
    endpoint, proxy, tok = stack
    since = len(proxy.calls)
    messages, answers = _agent(_client(endpoint, "plain"))
    turns = proxy.engine_turns(since)
    # the model called the tool (parsed by SGLang's qwen25 parser), then answered
    assert answers[0]["tool_calls"][0]["function"]["name"] == "add"
    assert json.loads(answers[0]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert answers[-1]["content"] == "5" and len(turns) == 2
    traj = endpoint.store.get("plain")
    assert dict(traj.counts) == {"root": 1, "continued": 1}
    (sample,) = to_samples(traj)
    check_token_exact(sample, turns)
    # what the engine saw is the template's rendering with the model's own text as its turn
    raw = tok.decode(turns[0][1][:-1])  # without the model's <|im_end|>
    mine = [messages[0], {"role": "assistant", "content": raw}, messages[2]]
    expect = tok.apply_chat_template(mine, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert tok.decode(turns[1][0]) == expect
    # the drift is real: the conversation rendered whole is not what the engine saw
    assert endpoint.renderer.prompt_ids(messages[:-1], TOOLS) != turns[1][0]
    assert sample.meta["num_model_turns"] == 2 and sample.finish_reason == "stop"


def test_streamed_tool_conversation_is_token_exact(stack):
    endpoint, proxy, tok = stack
    since = len(proxy.calls)
    _, answers = _agent(_client(endpoint, "streamed"), stream=True)
    turns = proxy.engine_turns(since)
    assert json.loads(answers[0]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert answers[-1]["content"] == "5" and len(turns) == 2
    (sample,) = to_samples(endpoint.store.get("streamed"))
    check_token_exact(sample, turns)


def test_an_edited_turn_branches_and_is_not_trained(stack):
    endpoint, proxy, tok = stack
    since = len(proxy.calls)

    def edit(msg: dict) -> dict:  # the agent rewrites the call's arguments and adds a remark
        msg = json.loads(json.dumps(msg))
        msg["content"] = "Let me add."
        msg["tool_calls"][0]["function"]["arguments"] = json.dumps({"a": 2, "b": 3, "c": 0})
        return msg

    _agent(_client(endpoint, "edited"), edit=edit)
    turns = proxy.engine_turns(since)
    assert len(turns) >= 2
    traj = endpoint.store.get("edited")
    assert traj.counts["replaced"] >= 1 and "unmatched" not in traj.counts
    (sample,) = to_samples(traj)  # the replaced first answer is no sample of its own
    # the final branch: the first turn's prompt, the agent's text as context, the engine's turns
    check_token_exact(sample, turns[1:])
    assert sample.prompt_ids == turns[0][0]
    context = [t for t, m in zip(sample.response_ids, sample.logprob_mask) if not m]
    assert "Let me add." in tok.decode(context)
    assert turns[0][1] != sample.response_ids[: len(turns[0][1])]  # the replaced answer is gone


def test_refused_edits_are_counted(stack):
    endpoint, proxy, tok = stack
    strict = AgentEndpoint(endpoint.generator, tok, AgentEndpointConfig(on_edit="refuse"))
    strict.start()
    try:
        client = _client(strict, "strict")

        def edit(msg: dict) -> dict:
            return {**msg, "content": "edited"}

        with pytest.raises(openai.ConflictError, match="edited"):
            _agent(client, edit=edit)
        assert strict.store.get("strict").counts["refused"] == 1
    finally:
        strict.stop()


def test_the_check_catches_a_re_tokenisation(stack, monkeypatch):
    """Plant the naive proxy: every call rendered whole by the template (no recorded ids)."""
    endpoint, proxy, tok = stack
    from megatron_gspo.agents.trajectory import Match, TrajectoryStore

    monkeypatch.setattr(
        TrajectoryStore,
        "match",
        staticmethod(lambda traj, keys: Match(parent=None, attach=None, rest=0)),
    )
    since = len(proxy.calls)
    _agent(_client(endpoint, "naive"))
    turns = proxy.engine_turns(since)
    samples = to_samples(endpoint.store.get("naive"))
    with pytest.raises(AssertionError):
        for s in samples:
            check_token_exact(s, turns)


def test_requests_without_a_trajectory_id_are_refused(stack):
    endpoint, _, _ = stack
    client = openai.OpenAI(base_url=f"{endpoint.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="trajectory id"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    assert [m.id for m in client.models.list()] == ["policy"]
    # the header works as well as the URL
    resp = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        extra_headers={"X-Trajectory-Id": "by-header"},
        logprobs=True,
    )
    (turn,) = endpoint.store.get("by-header").turns
    assert [c.logprob for c in resp.choices[0].logprobs.content] == turn.logprobs


@pytest.mark.slow  # imports SGLang's parsers (8-20 s)
def test_an_unknown_tool_call_parser_is_refused_at_start():
    tok = build_chat_toy_tokenizer()
    endpoint = AgentEndpoint(None, tok, AgentEndpointConfig(tool_call_parser="qwen9"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tool_call_parser='qwen9' is not one of SGLang's"):
        endpoint.start()
