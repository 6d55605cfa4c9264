"""The tokenizer: training a byte-level BPE, and a given tokenizer checked against the model."""

import pytest
from data_helpers import datamodule

from mtp.config import DataConfig
from mtp.data import MTPDataModule
from mtp.data.bpe import LONGEST_WORD, split_long_runs, train_tokenizer
from mtp.model.checkpoint import EOT_TOKEN


def test_tokenizer_round_trips_and_has_end_of_text():
    text = "def add(a, b):\n    return a + b\n" * 20
    tok = train_tokenizer([text], 300, 10_000)
    assert tok.token_to_id(EOT_TOKEN) == 0
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() <= 300


def test_a_line_of_a_million_letters_reaches_the_trainer_in_pieces():
    """The trainer's time is quadratic in a word's length: a run longer than LONGEST_WORD
    reaches it in pieces (of the byte-level pre-tokenizer's words, none longer), and the
    tokenizer trained on it still encodes the run whole."""
    import random

    from tokenizers import pre_tokenizers

    rng = random.Random(0)
    word = rng.randbytes(1 << 20).translate(bytes(97 + b % 26 for b in range(256))).decode()
    text = f"BLOB = '{word}'\n" + "x = '" + "7" * 5000 + "' + '" + "." * 3000 + "'\n"
    pieces = list(split_long_runs(text))
    assert "".join(pieces) == text
    words = [w for p in pieces
             for w, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(p)]
    assert max(len(w) for w in words) <= LONGEST_WORD + 1  # (with the space before a word)
    whole = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
    assert max(len(w) for w, _ in whole) > 1 << 19  # without the cut, one word of the run
    tok = train_tokenizer([text], 300, 2 << 20)
    assert tok.decode(tok.encode(text).ids) == text


def test_given_tokenizer_must_fit_model_vocabulary(tiny_corpus, tmp_path):
    dm = datamodule(tiny_corpus, tmp_path)
    path = tmp_path / "tok.json"
    dm.tokenizer.save(str(path))
    cfg = DataConfig(source=str(tiny_corpus), cache_dir=str(tmp_path / "cache"),
                     tokenizer=str(path))
    n = dm.tokenizer.get_vocab_size()
    with pytest.raises(ValueError, match="--model.vocab_size"):
        MTPDataModule(cfg, vocab_size=n - 1, n_future=2)._prepare()
    # fewer tokens than embedding rows is fine: pretrained models pad their embeddings
    MTPDataModule(cfg, vocab_size=n + 64, n_future=2)._prepare()
    with pytest.raises(FileNotFoundError, match="--data.tokenizer"):
        MTPDataModule(DataConfig(tokenizer=str(tmp_path / "missing.json")), vocab_size=300,
                      n_future=2)._prepare()


def test_a_tokenizer_that_is_a_device_or_a_pipe_is_named_for_what_it_is(tmp_path):
    import os

    from mtp.data.bpe import load_tokenizer
    from mtp.util.errors import InputError, MissingInput

    os.mkfifo(tmp_path / "tok.json")
    with pytest.raises(InputError, match=f"--data.tokenizer {tmp_path / 'tok.json'} is a named "
                                         "pipe, not a tokenizer file"):
        load_tokenizer(tmp_path / "tok.json")
    with pytest.raises(InputError, match="--data.tokenizer /dev/zero is a character device"):
        load_tokenizer("/dev/zero")
    with pytest.raises(MissingInput, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
