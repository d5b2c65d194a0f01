"""Each engine consumer is typed with the smallest protocol it uses (`engines/protocols.py`).

For every consumer: its annotation names the protocol, every engine member its source touches
(an AST scan of `<expr>.<member>` for the engine expressions it holds; the driver reaches the
scheduler's) belongs to that protocol, and no smaller protocol of its chain would do. A planted
consumer that calls a member outside its protocol, and one typed wider than it needs, are
caught.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from megatron_gspo.engines import protocols as P

ROOT = Path(__file__).resolve().parents[2] / "megatron_gspo"

# file, the engine expressions it calls members on, the protocol it is typed with
CONSUMERS = [
    ("rollout/scheduler.py", ("self.engine",), "Generator"),
    ("rollout/driver.py", ("self.scheduler.engine",), "Generator"),
    ("rollout/evaluation.py", ("self.engine",), "Sampler"),
    ("rollout/multiturn.py", ("self.engine", "client"), "Sampler"),
    ("agents/server.py", ("self.generator",), "Sampler"),
    ("weights/colocated.py", ("engine",), "MemoryControl"),
]
# smaller protocols first: a consumer must not fit an earlier one of its own chain
CHAINS = [("Sampler", "Generator", "RolloutEngine"), ("MemoryControl", "RolloutEngine")]


def _members(name: str) -> set[str]:
    return set(getattr(P, name).__protocol_attrs__)


def used_members(source: str, exprs: tuple[str, ...]) -> set[str]:
    """Names of the attributes read on any of `exprs` (e.g. `self.engine`) in `source`."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in exprs:
            used.add(node.attr)
    return used


def verdict(used: set[str], protocol: str) -> list[str]:
    """What is wrong with typing a consumer that uses `used` as `protocol` ([] = nothing)."""
    bad = [f"{m} is not in {protocol}" for m in sorted(used - _members(protocol))]
    for chain in CHAINS:
        if protocol in chain:
            for smaller in chain[: chain.index(protocol)]:
                if used and used <= _members(smaller):
                    bad.append(f"{protocol} is wider than needed: {smaller} has {sorted(used)}")
    return bad


@pytest.mark.parametrize(("path", "exprs", "protocol"), CONSUMERS)
def test_consumer_uses_only_its_smallest_protocol(
    path: str, exprs: tuple[str, ...], protocol: str
) -> None:
    source = (ROOT / path).read_text()
    used = used_members(source, exprs)
    assert used, f"{path}: no member of {exprs} used (is the table stale?)"
    assert verdict(used, protocol) == []


def test_the_annotations_name_the_protocols() -> None:
    from megatron_gspo.agents.runner import make_agent_rollout
    from megatron_gspo.agents.server import AgentEndpoint
    from megatron_gspo.rollout.evaluation import Evaluator
    from megatron_gspo.rollout.multiturn import MultiTurn
    from megatron_gspo.rollout.scheduler import GroupScheduler
    from megatron_gspo.weights.colocated import resume_engines

    def ann(fn: object, name: str) -> str:
        return str(inspect.signature(fn).parameters[name].annotation)  # type: ignore[arg-type]

    assert ann(GroupScheduler.__init__, "engine") == "Generator"
    assert ann(Evaluator.__init__, "engine") == "Sampler"
    assert ann(MultiTurn, "engine") == "Sampler"
    assert ann(MultiTurn, "engines") == "tuple[Sampler, ...]"
    assert ann(AgentEndpoint.__init__, "generator") == "Sampler"
    assert ann(make_agent_rollout, "engine") == "Sampler"  # handed to the AgentEndpoint
    assert ann(resume_engines, "engine") == "MemoryControl | None"


def test_the_check_can_fail() -> None:
    planted = "async def f(self):\n    await self.engine.agenerate([], s)\n    self.engine.health()"
    used = used_members(planted, ("self.engine",))
    assert used == {"agenerate", "health"}
    assert verdict(used, "Generator") == ["health is not in Generator"]
    # typed wider than it uses: a Generator consumer that only samples
    assert verdict({"agenerate"}, "Generator") == [
        "Generator is wider than needed: Sampler has ['agenerate']"
    ]
    assert verdict({"agenerate", "abort"}, "Generator") == []
