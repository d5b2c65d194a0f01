"""Shared fixtures of the trainer-part tests."""

import pytest


@pytest.fixture(scope="session")
def toy_tokenizer():
    """The character-level toy tokenizer (transformers import: a few seconds, paid once)."""
    from megatron_gspo.data.toy import build_toy_tokenizer

    return build_toy_tokenizer()
