"""Create the CPU demo's inputs: a tiny random Qwen3-MoE with the toy tokenizer, and the toy
prompt dataset. Everything is generated locally (nothing is downloaded).

    python tools/make_tiny_toy.py --out runs/tiny_toy [--seed 0] [--n 2000] [--ops copy]
    python tools/make_tiny_toy.py --out runs/evidence_task --task pattern --length 64
    python tools/make_tiny_toy.py --out runs/tiny_toy_agent --ops add --max-len 3 --chat

--chat saves the character chat tokenizer (`megatron_gspo.data.chat_toy`: same ids, plus a
chat template and newline) instead of the plain toy tokenizer: the agent example's model.

--task pattern writes the long-response repeat task (`megatron_gspo.data.pattern`) instead of the
digit toy: answers of --length characters, patterns of --min-len..--max-len digits.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: this checkout's package, Ctrl-C as one line
    import sys
    from pathlib import Path

    _root = str(Path(__file__).resolve().parents[1])
    if _root not in sys.path:
        sys.path.insert(0, _root)
    from megatron_gspo.run.interrupt import quiet_ctrl_c

    quiet_ctrl_c(Path(__file__).name)

import argparse
import json
from pathlib import Path

from megatron_gspo.data.pattern import PatternTaskConfig, write_pattern_dataset
from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.data.toy import save_toy_tokenizer, write_toy_dataset


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/tiny_toy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=2000, help="toy prompts")
    p.add_argument("--ops", default="copy", help="comma-separated toy ops")
    p.add_argument("--min-len", type=int, default=1)
    p.add_argument("--max-len", type=int, default=2)
    p.add_argument("--task", choices=("toy", "pattern"), default="toy")
    p.add_argument("--length", type=int, default=64, help="--task pattern: answer length")
    p.add_argument("--chat", action="store_true", help="the chat tokenizer (agent example)")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    model_dir, data = out / "model", out / f"{args.task}.jsonl"
    if (model_dir / "config.json").exists() and data.exists() and not args.force:
        print(f"[make_tiny_toy] {out} exists (use --force to rebuild)")
        return out
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a sub-second "Writing model shards" bar is noise here
    save_tiny_hf_checkpoint(model_dir, seed=args.seed, perturb_norms=False)
    if args.chat:
        from megatron_gspo.data.chat_toy import build_chat_toy_tokenizer

        build_chat_toy_tokenizer().save_pretrained(model_dir)
    else:
        save_toy_tokenizer(model_dir)
    if args.task == "pattern":
        task = PatternTaskConfig(
            length=args.length,
            pattern_min=args.min_len,
            pattern_max=args.max_len,
            n=args.n,
            seed=args.seed,
        )
        write_pattern_dataset(data, task)
    else:
        write_toy_dataset(
            data,
            args.n,
            seed=args.seed,
            ops=tuple(args.ops.split(",")),
            min_len=args.min_len,
            max_len=args.max_len,
        )
    (out / "README.json").write_text(json.dumps(vars(args), indent=1))
    print(f"[make_tiny_toy] wrote {model_dir} and {data}")
    return out


if __name__ == "__main__":
    main()
