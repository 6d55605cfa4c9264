"""The tokenizer's side of a model: the id of its end-of-text token, and the check that every id
the tokenizer can produce has a row in the model's embedding. `mtp.model.checkpoint` and
`mtp.interop.hf_export` both apply it to what they read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtp.config import ModelConfig
from mtp.util.errors import InputError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["check_vocab", "eot_id"]


def check_vocab(tokenizer: Tokenizer, cfg: ModelConfig, *, source: str) -> None:
    """Raise if the tokenizer can produce ids the model has no embedding for."""
    n = tokenizer.get_vocab_size()
    if n > cfg.vocab_size:
        raise InputError(
            f"tokenizer from {source} has {n} tokens but the model's vocabulary "
            f"(--model.vocab_size) is {cfg.vocab_size}"
        )
    eot_id(tokenizer, cfg, source=source)


def eot_id(tokenizer: Tokenizer, cfg: ModelConfig, *, source: str = "the checkpoint") -> int:
    """The id of the model's end-of-text token (`cfg.eot_token`) in `tokenizer`."""
    i = tokenizer.token_to_id(cfg.eot_token)
    if i is None:
        raise InputError(f"tokenizer from {source} has no end-of-text token {cfg.eot_token!r} "
                         f"(--model.eot_token)")
    return i
