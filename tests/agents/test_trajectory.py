"""Trajectory matching and the trajectory -> training-sample conversion, on hand-built turns.

Expected sequences, masks, log-probs and versions are written out by hand from the tree's
definition (which ids the engine saw and sampled), not computed by the code under test.
"""

from __future__ import annotations

import pytest

from megatron_gspo.agents.chat import message_key
from megatron_gspo.agents.trajectory import Trajectory, TrajectoryStore, Turn, to_samples

U = {"role": "user", "content": "q"}
A1 = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ],
}
T1 = {"role": "tool", "tool_call_id": "x", "content": "r"}


def _turn(traj, parent, attach, msgs, answer, prompt, resp, lps, version="3"):
    t = Turn(
        index=len(traj.turns),
        parent=parent,
        attach=attach,
        keys=tuple(message_key(m) for m in msgs),
        answer_key=message_key(answer),
        prompt_ids=prompt,
        response_ids=resp,
        logprobs=lps,
        logprob_mask=[True] * len(resp),
        weight_version=version,
        finish_reason="stop",
        engine_id="e",
    )
    traj.turns.append(t)
    return t


def test_message_keys_ignore_echo_fields_and_argument_spacing():
    echoed = {**A1, "refusal": None, "audio": None, "function_call": None, "annotations": None}
    echoed["tool_calls"] = [
        {"id": "other", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    ]
    assert message_key(echoed) == message_key(A1)
    assert message_key({**A1, "content": "x"}) != message_key(A1)
    changed = {**A1, "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 2}'}}]}
    assert message_key(changed) != message_key(A1)


def test_match_prefers_the_longest_continued_turn():
    traj = Trajectory(trajectory_id="t")
    _turn(traj, None, None, [U], A1, [1, 2], [3, 4], [-0.1, -0.2])
    keys = [message_key(m) for m in (U, A1, T1)]
    m = TrajectoryStore.match(traj, keys)
    assert (m.parent, m.attach, m.rest) == (0, "response", 2)
    edited = [message_key(m) for m in (U, {**A1, "content": "hm"}, T1)]
    m = TrajectoryStore.match(traj, edited)
    assert (m.parent, m.attach, m.rest) == (0, "prompt", 1)
    m = TrajectoryStore.match(traj, [message_key({"role": "user", "content": "other"})])
    assert (m.parent, m.attach) == (None, None)


def test_samples_follow_the_branches():
    """root (prompt 1 2, response 3 4) -> continued (+ delta 5, response 6 at version 4);
    root -> replaced (+ agent text 7 8, response 9); a retry of the root's messages (a sibling
    that replaces the root with nothing added: response 10)."""
    traj = Trajectory(trajectory_id="t")
    _turn(traj, None, None, [U], A1, [1, 2], [3, 4], [-0.1, -0.2])
    _turn(traj, 0, "response", [U, A1, T1], U, [1, 2, 3, 4, 5], [6], [-0.6], version="4")
    _turn(traj, 0, "prompt", [U, A1, T1], U, [1, 2, 7, 8], [9], [-0.9])
    _turn(traj, 0, "prompt", [U], U, [1, 2], [10], [-1.0])
    samples = to_samples(traj, prompt_index=5)
    assert [s.sample_index for s in samples] == [0, 1, 2]
    cont, repl, retry = samples
    assert (cont.prompt_ids, cont.response_ids) == ([1, 2], [3, 4, 5, 6])
    assert cont.logprobs == [-0.1, -0.2, 0.0, -0.6]
    assert cont.logprob_mask == [True, True, False, True]
    assert cont.token_versions == [3, 3, 3, 4]
    assert [(t["kind"], t["start"], t["end"]) for t in cont.meta["turns"]] == [
        ("model", 0, 2),
        ("env", 2, 3),
        ("model", 3, 4),
    ]
    assert (repl.response_ids, repl.logprob_mask) == ([7, 8, 9], [False, False, True])
    assert repl.logprobs == [0.0, 0.0, -0.9] and repl.prompt_index == 5
    assert (retry.response_ids, retry.logprobs) == ([10], [-1.0])


def test_a_turn_that_does_not_extend_its_parent_is_an_error():
    traj = Trajectory(trajectory_id="t")
    _turn(traj, None, None, [U], A1, [1, 2], [3, 4], [-0.1, -0.2])
    _turn(traj, 0, "response", [U, A1, T1], U, [1, 2, 3, 9, 5], [6], [-0.6])  # 9: re-tokenised
    with pytest.raises(AssertionError, match="does not extend"):
        to_samples(traj)
