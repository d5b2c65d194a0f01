"""Agent trajectories, token-exact: what the engine saw and sampled on every call, and the
training samples built from exactly those ids.

A trajectory is a tree of `Turn`s, one per sampled choice of a chat-completion call. A call's
messages are matched against the turns recorded so far (`TrajectoryStore.match`):

* **continued** (the usual case): the messages start with a turn's messages plus the assistant
  message the endpoint answered. The new prompt is that turn's prompt and response ids, exactly
  as the engine saw and sampled them, plus the template's delta for the messages after it.
* **replaced** (the agent edited or truncated the assistant message, or sent the same messages
  again): the messages start with a turn's messages only. The new prompt is that turn's prompt
  plus the agent's assistant message rendered as context; the replaced turn is superseded.
* **unmatched**: a new root rendered whole (a trajectory's first call, or one whose history the
  agent rewrote).

With `on_edit="refuse"` the last two are refused (after the first call) and counted instead.

Training samples (`to_samples`): one per final turn (a turn that no later call continued or
replaced), over the path from its root: prompt = the root's prompt, response = everything
after it; log-probs, mask and weight versions come from the engine's answers on model tokens,
while template deltas and agent-written text are context (mask False, log-prob 0.0). That is
the shape of a multi-turn episode (`rollout/multiturn.py`), `meta["turns"]` included.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

from megatron_gspo.engines.types import Sample

__all__ = ["Match", "Trajectory", "TrajectoryStore", "Turn", "to_samples"]

Attach = Literal["response", "prompt"]


@dataclasses.dataclass(kw_only=True, slots=True)
class Turn:
    """One sampled choice of one call, as the engine saw it."""

    index: int
    """Position in `Trajectory.turns` (calls in arrival order; choices of a call in order)."""
    parent: int | None
    """The turn this one extends (None: a root)."""
    attach: Attach | None
    """`response`: after the parent's response (continued); `prompt`: after the parent's
    prompt, its response replaced by the agent's message (replaced); None for a root."""
    keys: tuple[Any, ...]
    """`chat.message_key` of each message of the call (what a later call is matched on)."""
    answer_key: Any
    """`chat.message_key` of the assistant message the endpoint answered."""
    prompt_ids: list[int]
    """Ids the engine received."""
    response_ids: list[int]
    """Ids the engine sampled (its end-of-turn token included)."""
    logprobs: list[float]
    """Engine log-prob of each response id (pi_old)."""
    logprob_mask: list[bool]
    """False where the engine log-prob was not finite."""
    weight_version: str
    """The engine's weight version of this response."""
    finish_reason: str
    engine_id: str


@dataclasses.dataclass(kw_only=True, slots=True)
class Trajectory:
    """Every turn of one trajectory id, and what happened to its calls."""

    trajectory_id: str
    turns: list[Turn] = dataclasses.field(default_factory=list)
    counts: Counter = dataclasses.field(default_factory=Counter)
    """`continued`, `replaced`, `unmatched` (calls after the first rendered whole), `refused`."""

    def final_turns(self) -> list[Turn]:
        """Turns no later call continued or replaced: one training sample each."""
        extended = {t.parent for t in self.turns if t.parent is not None}
        return [t for t in self.turns if t.index not in extended]


@dataclasses.dataclass(frozen=True, slots=True)
class Match:
    """Where a call's messages attach in a trajectory."""

    parent: int | None
    attach: Attach | None
    rest: int
    """Index of the first message after the matched part."""


class TrajectoryStore:
    """Trajectories by id, shared by the endpoint's handlers and the rollout (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Trajectory] = {}

    def get(self, trajectory_id: str) -> Trajectory:
        with self._lock:
            return self._by_id.setdefault(trajectory_id, Trajectory(trajectory_id=trajectory_id))

    def pop(self, trajectory_id: str) -> Trajectory | None:
        """Remove and return a trajectory (the rollout takes it once the agent is done)."""
        with self._lock:
            return self._by_id.pop(trajectory_id, None)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._by_id)

    @staticmethod
    def match(traj: Trajectory, keys: Sequence[Any]) -> Match:
        """The longest recorded prefix of `keys`: a continued turn beats a replaced one of the
        same turn; later turns win ties (the agent's latest branch)."""
        best = Match(parent=None, attach=None, rest=0)
        for t in traj.turns:
            n = len(t.keys)
            if tuple(keys[:n]) != t.keys:
                continue
            if len(keys) > n and keys[n] == t.answer_key:
                if n + 1 >= best.rest:
                    best = Match(parent=t.index, attach="response", rest=n + 1)
            elif n > best.rest or (n == best.rest and best.attach != "response"):
                best = Match(parent=t.index, attach="prompt", rest=n)
        return best

    def add(self, traj: Trajectory, turn: Turn) -> None:
        with self._lock:
            traj.turns.append(turn)


def _context(traj: Trajectory, turn: Turn) -> tuple[list[float], list[bool], list[int | None]]:
    """Log-probs, mask and sampling turn (index) of every id of `turn.prompt_ids`."""
    if turn.parent is None:
        n = len(turn.prompt_ids)
        return [0.0] * n, [False] * n, [None] * n
    parent = traj.turns[turn.parent]
    lp, mask, who = _context(traj, parent)
    if turn.attach == "response":
        lp = lp + parent.logprobs
        mask = mask + parent.logprob_mask
        who = who + [parent.index] * len(parent.response_ids)
    extra = len(turn.prompt_ids) - len(lp)
    if extra < 0:
        raise AssertionError(f"turn {turn.index} is shorter than the context it extends")
    return lp + [0.0] * extra, mask + [False] * extra, who + [None] * extra


def _path_ids(traj: Trajectory, turn: Turn) -> list[int]:
    if turn.parent is None:
        return []
    parent = traj.turns[turn.parent]
    return parent.prompt_ids + (parent.response_ids if turn.attach == "response" else [])


def _version(label: str) -> int | None:
    try:
        return int(label)
    except ValueError:
        return None


def to_samples(traj: Trajectory, *, prompt_index: int = 0) -> list[Sample]:
    """One training `Sample` per final turn (see the module docstring); sample indices in
    turn order. Raises AssertionError if a turn's prompt does not extend its parent's ids
    (never expected: the endpoint builds prompts that way)."""
    out = []
    for k, leaf in enumerate(traj.final_turns()):
        chain = [leaf]
        while chain[-1].parent is not None:
            chain.append(traj.turns[chain[-1].parent])
        for t in chain[:-1]:
            head = _path_ids(traj, t)
            if t.prompt_ids[: len(head)] != head:
                raise AssertionError(f"turn {t.index} does not extend the ids of turn {t.parent}")
        root = chain[-1]
        lp, mask, who = _context(traj, leaf)
        ids = leaf.prompt_ids + leaf.response_ids
        lp, mask = lp + leaf.logprobs, mask + leaf.logprob_mask
        who = who + [leaf.index] * len(leaf.response_ids)
        p = len(root.prompt_ids)
        turns: list[dict[str, Any]] = []
        for pos in range(p, len(ids)):
            w = who[pos]
            kind = "env" if w is None else "model"
            if turns and turns[-1]["kind"] == kind and turns[-1].get("turn") == w:
                turns[-1]["end"] = pos - p + 1
                continue
            seg: dict[str, Any] = {"kind": kind, "start": pos - p, "end": pos - p + 1}
            if w is not None:
                src = traj.turns[w]
                seg.update(turn=src.index, weight_version=src.weight_version)
            turns.append(seg)
        versions = _token_versions(traj, who[p:])
        out.append(
            Sample(
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                logprobs=lp[p:],
                logprob_mask=mask[p:],
                finish_reason=leaf.finish_reason,  # type: ignore[arg-type]
                truncated=leaf.finish_reason != "stop",
                weight_version=leaf.weight_version,
                engine_id=leaf.engine_id,
                prompt_index=prompt_index,
                sample_index=k,
                meta={
                    "trajectory_id": traj.trajectory_id,
                    "turns": turns,
                    "num_model_turns": sum(s["kind"] == "model" for s in turns),
                    # as `rollout/multiturn.py` counts them: `env/tool_call_rate` reads it
                    "num_env_turns": sum(s["kind"] == "env" and s["start"] > 0 for s in turns),
                    "counts": dict(traj.counts),
                },
                token_versions=versions,
            )
        )
    return out


def _token_versions(traj: Trajectory, who: Sequence[int | None]) -> list[int]:
    """Each response token's weight version: a model token's turn's; a context token that of
    the model turn before it (of the first one when none is before). Empty when a version is
    not a number (not tracked)."""
    model = [traj.turns[w] for w in who if w is not None]
    versions = [_version(t.weight_version) for t in model]
    if not model or any(v is None for v in versions):
        return []
    current = int(versions[0])  # type: ignore[arg-type]
    out = []
    for w in who:
        if w is not None:
            current = int(_version(traj.turns[w].weight_version))  # type: ignore[arg-type]
        out.append(current)
    return out
