"""What loading the run's tokenizer costs rank 0 at start-up, once (now: preflight loads it and
hands it to the rollout) against twice (before: preflight loaded it for its prompt checks, then
`make_rollout` loaded it again).

    python benchmarks/tokenizer_load.py [--model DIR] [--repeat 20]

`--model`: a Hugging Face model directory with its tokenizer (default: the tiny toy model,
written to a temporary directory by tools/make_tiny_toy.py). Prints the first load in a fresh
interpreter (the `transformers` import included, paid once either way), the median of
`--repeat` later loads in this process (what the second load cost), and the two start-ups.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_COLD = """
import sys, time
t = time.perf_counter()
from megatron_gspo.data.fit import load_run_tokenizer
load_run_tokenizer(sys.argv[1], None)
print(time.perf_counter() - t)
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory with a tokenizer (default: the tiny toy)")
    ap.add_argument("--repeat", type=int, default=20, help="warm loads to take the median of")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tools import make_tiny_toy

            make_tiny_toy.main(["--out", f"{tmp}/toy", "--n", "8"])
            model = f"{tmp}/toy/model"
        cold = float(
            subprocess.run(
                [sys.executable, "-c", _COLD, model],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            ).stdout.split()[-1]
        )
        from megatron_gspo.data.fit import load_run_tokenizer

        load_run_tokenizer(model, None)  # this process's transformers import
        warm = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            load_run_tokenizer(model, None)
            warm.append(time.perf_counter() - t)
    second = statistics.median(warm)
    print(f"tokenizer of {model if args.model else 'the tiny toy model'}")
    print(f"{'what':<44} {'wall s':>8}")
    print(f"{'first load (fresh interpreter, with import)':<44} {cold:>8.3f}")
    print(f"{f'a later load (median of {args.repeat})':<44} {second:>8.3f}")
    print(f"{'rank 0 before: preflight + make_rollout':<44} {cold + second:>8.3f}")
    print(f"{'rank 0 now: preflight, handed on':<44} {cold:>8.3f}")
    print(f"saved per run on rank 0: {second:.3f} s ({second / (cold + second):.1%})")


if __name__ == "__main__":
    main()
