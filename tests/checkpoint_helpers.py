"""What the tests of a saved model share: a small byte-level BPE and an untrained debug
checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from mtp.config import ModelConfig


def bpe_tokenizer(texts: list[str] | None = None):
    """A byte-level BPE of 300 tokens, with the end-of-text token, trained on `texts` (default:
    one function, ten times)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mtp.model.checkpoint import EOT_TOKEN

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts or ["def add(a, b):\n    return a + b\n"] * 10, trainer)
    return tok


def debug_checkpoint(path: Path) -> Path:
    """An untrained debug checkpoint with a 32-token context length (K = 2), written to `path`."""
    from mtp.model.checkpoint import save_checkpoint
    from mtp.model.transformer import MTPTransformer

    torch.manual_seed(0)
    cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=2, max_seq_len=32)
    save_checkpoint(path, MTPTransformer(cfg), bpe_tokenizer())
    return path
