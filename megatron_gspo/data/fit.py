"""What the prompts must fit, decided from the config alone, and checked before anything starts.

The rollout (rank 0, once the engines are up) drops the prompts that cannot be served or
trained: longer than `data.max_prompt_tokens`, than the engine's context less the response
budget, or than a micro-batch (`train.micro_batch_tokens`) less a whole response. When none is
left, that was found only after the engines had started (issue 40); so was a
`rollout.turn_stop` entry that is not one token. `check_prompts_fit` (called by `preflight`
on the launcher and every rank, before a model is built or an engine starts) applies the same
limits, `prompt_limits`, with the same tokenizer, and refuses in the same one line; the drops
themselves are reported once, by the rollout. The tokenizer is loaded here once
(`load_run_tokenizer`: a directory without one is refused) and handed on to the rollout.

    tokenizer = check_prompts_fit(cfg)  # or ConfigError / DatasetError (one line, exit code 2)
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import TYPE_CHECKING, cast

from megatron_gspo.config_io import ConfigError

if TYPE_CHECKING:
    from megatron_gspo.config import Config
    from megatron_gspo.data.tokenizer import Tokenizer
    from megatron_gspo.rollout.config import RolloutConfig

__all__ = [
    "TOKENIZER_FILES",
    "check_prompts_fit",
    "load_run_tokenizer",
    "prompt_limits",
    "tokenizer_source",
    "turn_stop_ids",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which one marks a directory that holds a Hugging Face tokenizer."""


def prompt_limits(
    hf_path: str, rollout: RolloutConfig, micro_batch_tokens: int
) -> tuple[tuple[int, int, str] | None, tuple[int, str]]:
    """(`context`, `fit`) for `PromptDataset`: the engine's context length with the response
    budget (None when the model's config names no context length), and the most prompt tokens
    a training micro-batch holds with a whole response (episode). `rollout`: the `rollout`
    section (preflight and the rollout take the same limits from here)."""
    from megatron_gspo.data.prompts import engine_context_length

    r = rollout
    context_len = engine_context_length(
        hf_path, r.launch.extra_args if r.launch is not None else ()
    )
    context = (
        None if context_len is None else (context_len, r.max_new_tokens, "rollout.max_new_tokens")
    )
    fit = (
        micro_batch_tokens - r.episode_tokens,
        f"train.micro_batch_tokens={micro_batch_tokens} with {r.episode_tokens} response tokens",
    )
    return context, fit


def turn_stop_ids(tokenizer: Tokenizer, turn_stop: list[str]) -> list[int]:
    """The token id of each `rollout.turn_stop` text; ConfigError for one that is not a single
    token of the tokenizer."""
    ids = []
    for text in turn_stop:
        got = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(got) != 1:
            raise ConfigError(
                f"rollout.turn_stop entry {text!r} is {len(got)} tokens of the tokenizer, not "
                "one; change rollout.turn_stop"
            )
        ids.append(int(got[0]))
    return ids


def tokenizer_source(hf_path: str, tokenizer_path: str | None) -> tuple[Path, str]:
    """The directory the run's tokenizer is read from and the key that names it
    (`model.tokenizer_path`, else `model.hf_path`)."""
    if tokenizer_path:
        return Path(tokenizer_path), "model.tokenizer_path"
    return Path(hf_path), "model.hf_path"


def load_run_tokenizer(hf_path: str, tokenizer_path: str | None) -> Tokenizer:
    """The run's tokenizer, or one ConfigError line naming the directory and the key: a
    directory without tokenizer files (was: preflight passed it and rank 0's rollout failed in
    `AutoTokenizer`'s traceback once the engines had started), or one its loader refuses."""
    where, key = tokenizer_source(hf_path, tokenizer_path)
    if not any((where / name).is_file() for name in TOKENIZER_FILES):
        fix = (
            f"change {key}"
            if key == "model.tokenizer_path"
            else "add them, or set model.tokenizer_path to the directory of the model's tokenizer"
        )
        raise ConfigError(
            f"{where}: no tokenizer ({' / '.join(TOKENIZER_FILES)} absent), the rollout "
            f"reads prompts and responses with it; {fix}"
        )
    from transformers import AutoTokenizer

    try:  # its methods are annotated with every return they can have; ours return text
        return cast("Tokenizer", AutoTokenizer.from_pretrained(str(where)))  # data/tokenizer.py
    except Exception as e:  # any loader failure is this input's: one line, not a traceback
        text = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"{where}: the tokenizer cannot be loaded ({type(e).__name__}: {text}); check {key}"
        ) from None


def check_prompts_fit(cfg: Config) -> Tokenizer:
    """The training prompts against `prompt_limits` and `data.max_prompt_tokens`, the held-out
    prompts (`eval.path`) against `data.max_prompt_tokens`, and `rollout.turn_stop`, with the
    run's tokenizer (`load_run_tokenizer`): a ConfigError where no prompt is left or a stop
    text is not one token. Returns the tokenizer, which the rollout takes (`make_rollout`)
    instead of loading it again."""
    from megatron_gspo.data.prompts import PromptDataset

    tokenizer = load_run_tokenizer(cfg.model.hf_path, cfg.model.tokenizer_path)
    context, fit = prompt_limits(cfg.model.hf_path, cfg.rollout, cfg.train.micro_batch_tokens)
    # The drops are counted and printed by the rollout, once; here only "none left" matters.
    with contextlib.redirect_stderr(io.StringIO()):
        PromptDataset.from_config(cfg.data, tokenizer, context, fit=fit)
        if cfg.eval.path is not None:
            PromptDataset.from_config(cfg.data, tokenizer, path=cfg.eval.path, key="eval.path")
    if cfg.rollout.env is not None:
        turn_stop_ids(tokenizer, cfg.rollout.turn_stop)
    return tokenizer
