"""A verifiable task with long responses: repeat a short digit pattern to a target length.

    prompt "rep 38 x48="   answer "383838...38" (48 characters: "38" repeated, cut at 48)

The response length is the knob (`PatternTaskConfig.length`, L): responses are L tokens long
(one token per character with the toy tokenizer of `megatron_gspo.data.toy`), so with
rollout.max_new_tokens = L the study of engine/trainer mismatch can move the response length
from 32 to 256 tokens while the task stays the same. The reward
(`megatron_gspo.rewards.pattern.pattern_reward`) is graded per position, so a tiny model gets
partial credit from its first steps: first for answering in digits, then for every position it
gets right.

The prompt holds only the pattern and L: the tiny MoE learns to copy the pattern's digits from
the prompt and to keep repeating them, which it does within about 100 GSPO steps on CPU
(examples/evidence_cpu.yaml).

    python -m megatron_gspo.data.pattern --out runs/evidence_task/pattern.jsonl --length 64
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gspo.config_io import build_dataclass, require

__all__ = [
    "PatternTaskConfig",
    "make_pattern_example",
    "pattern_answer",
    "pattern_task_config",
    "write_pattern_dataset",
]


@dataclass(kw_only=True, slots=True)
class PatternTaskConfig:
    """The repeat-a-pattern task (the `task:` keys of tools/evidence_study.py)."""

    length: int = 32
    """L: characters (= tokens with the toy tokenizer) of every answer; set
    rollout.max_new_tokens to at least this (the study sets it to exactly L; its default is
    rollout.max_new_tokens of examples/evidence_cpu.yaml, 32)."""
    pattern_min: int = 1
    """Fewest digits of the pattern that is repeated."""
    pattern_max: int = 2
    """Most digits of the pattern that is repeated."""
    n: int = 2000
    """Prompts in the dataset."""
    seed: int = 0
    """Seed of the dataset (the same config writes the same file)."""

    def __post_init__(self) -> None:
        require(
            1 <= self.pattern_min <= self.pattern_max <= 8,
            f"task.pattern_min={self.pattern_min} / task.pattern_max={self.pattern_max} must "
            "satisfy 1 <= pattern_min <= pattern_max <= 8; change them",
        )
        require(
            self.pattern_max <= self.length <= 4096,
            f"task.length={self.length} must be in [task.pattern_max, 4096]; change task.length",
        )
        require(self.n >= 1, f"task.n={self.n} must be >= 1; change task.n")


def pattern_task_config(values: dict[str, Any] | None = None) -> PatternTaskConfig:
    """Build the task config from a mapping (unknown keys name the closest `task.` key)."""
    return build_dataclass(PatternTaskConfig, dict(values or {}), prefix="task")


def pattern_answer(pattern: str, length: int) -> str:
    """`pattern` repeated and cut to exactly `length` characters."""
    if not pattern:
        raise ValueError("pattern_answer: the pattern is empty")
    return (pattern * (length // len(pattern) + 1))[:length]


def make_pattern_example(rng: random.Random, cfg: PatternTaskConfig) -> dict[str, str]:
    """One JSONL record: {"prompt", "answer", "task"}."""
    k = rng.randint(cfg.pattern_min, cfg.pattern_max)
    pattern = "".join(rng.choice("0123456789") for _ in range(k))
    return {
        "prompt": f"rep {pattern} x{cfg.length}=",
        "answer": pattern_answer(pattern, cfg.length),
        "task": "pattern",
    }


def write_pattern_dataset(path: str | Path, cfg: PatternTaskConfig) -> Path:
    """Write `cfg.n` records to a JSONL file; the same config gives the same file."""
    rng = random.Random(cfg.seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(cfg.n):
            f.write(json.dumps(make_pattern_example(rng, cfg)) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSONL file to write")
    d = PatternTaskConfig()
    p.add_argument("--length", type=int, default=d.length, help="answer length L (tokens)")
    p.add_argument("--pattern-min", type=int, default=d.pattern_min)
    p.add_argument("--pattern-max", type=int, default=d.pattern_max)
    p.add_argument("--n", type=int, default=d.n, help="number of prompts")
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    cfg = PatternTaskConfig(
        length=a.length, pattern_min=a.pattern_min, pattern_max=a.pattern_max, n=a.n, seed=a.seed
    )
    write_pattern_dataset(a.out, cfg)
    print(f"wrote {cfg.n} prompts (answers of {cfg.length} characters) to {a.out}")


if __name__ == "__main__":
    main()
