"""Split a toy prompt file into training prompts and held-out prompts that the training file
never holds (for `eval.path`; `scripts/main.sh --eval`).

    python tools/make_held_out.py runs/tiny_toy/toy.jsonl --train runs/tiny_toy/toy_train.jsonl \
        --held-out runs/tiny_toy/toy_eval.jsonl [--suffix 7]

Held out: every record whose answer has at least two characters and ends with SUFFIX (for the
1-2 digit copy task and suffix 7: the ten prompts "cpy 07=" ... "cpy 97="), each distinct
prompt written once; every other record goes to the training file, in order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def split(src: Path, train: Path, held_out: Path, suffix: str) -> tuple[int, int]:
    """Write the two files; returns (training records, held-out prompts)."""
    kept: list[str] = []
    held: dict[str, str] = {}
    for line in src.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        answer = str(json.loads(line)["answer"])
        if len(answer) >= 2 and answer.endswith(suffix):
            held.setdefault(json.loads(line)["prompt"], line)
        else:
            kept.append(line)
    if not held or not kept:
        raise SystemExit(f"{src}: suffix {suffix!r} leaves {len(kept)} training, {len(held)} held")
    train.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    held_out.write_text("".join(x + "\n" for x in held.values()), encoding="utf-8")
    return len(kept), len(held)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("--train", required=True)
    p.add_argument("--held-out", required=True)
    p.add_argument("--suffix", default="7")
    a = p.parse_args(argv)
    n_train, n_held = split(Path(a.src), Path(a.train), Path(a.held_out), a.suffix)
    print(
        f"[make_held_out] {n_train} training records -> {a.train}, {n_held} held-out prompts "
        f"-> {a.held_out}"
    )


if __name__ == "__main__":
    main()
