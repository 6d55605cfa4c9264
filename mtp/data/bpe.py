"""The tokenizer: a byte-level BPE trained on a bounded sample of the training split, or loaded.

`tokenizer_sample` draws the training text from the sources by weight; `train_tokenizer` trains
on at most a given number of bytes of it; `load_tokenizer` reads a `tokenizer.json`, and
`check_tokenizer` checks a given one against the model's vocabulary and end-of-text token.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtp.data.corpus import DocumentReader, SourceSpec, in_validation
from mtp.model.checkpoint import EOT_TOKEN
from mtp.util.errors import InputError, MissingInput
from mtp.util.paths import not_a_file

#: The longest run of one kind of character (letters, digits, other symbols, whitespace: the
#: byte-level pre-tokenizer's words) that the trainer sees whole. Its merges take time quadratic
#: in a word's length, so one long line without a break would train for hours; a longer run
#: reaches it in pieces of this length. A text without such a run trains as before.
LONGEST_WORD = 1000
_LONG_RUN = re.compile("|".join(f"{kind}{{{LONGEST_WORD},}}"
                                for kind in (r"[^\W\d_]", r"\d", r"(?:[^\w\s]|_)", r"\s")))


def split_long_runs(text: str) -> Iterator[str]:
    """`text`, cut inside each run longer than `LONGEST_WORD` into runs of that length."""
    start = 0
    for run in _LONG_RUN.finditer(text):
        for cut in range(run.start() + LONGEST_WORD, run.end(), LONGEST_WORD):
            yield text[start:cut]
            start = cut
    yield text[start:]


def train_tokenizer(texts: Iterable[str], vocab_size: int, max_bytes: int,
                    eot_token: str = EOT_TOKEN) -> Tokenizer:
    """A byte-level BPE with the end-of-text token `eot_token` (id 0), trained on at most
    `max_bytes`.

    `texts` may be a stream: it is read only up to `max_bytes`. A run of one kind of character
    longer than `LONGEST_WORD` is seen in pieces.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eot_token], show_progress=True,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def sample() -> Iterator[str]:
        seen = 0
        for text in texts:
            if seen >= max_bytes:
                return
            seen += len(text)
            yield from split_long_runs(text)

    tok.train_from_iterator(sample(), trainer=trainer)
    return tok


def tokenizer_sample(specs: list[SourceSpec], max_bytes: int) -> Iterator[str]:
    """Training documents for the tokenizer: source j's first max_bytes * w_j / sum(w)."""
    total = sum(spec.weight for spec in specs)
    for spec in specs:
        budget, seen = max_bytes * spec.weight / total, 0
        for name, text in DocumentReader(spec):
            if seen >= budget:
                break
            if not in_validation(name, spec.val_fraction):
                seen += len(text)
                yield text


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A `tokenizer.json`, or the tokenizer a GGUF file holds, with a message naming the file
    when it is missing or malformed."""
    path = Path(path)
    problem = not_a_file(path)
    if problem == "does not exist":
        raise MissingInput(f"--data.tokenizer {path} does not exist")
    if problem is not None:
        raise InputError(f"--data.tokenizer {path} {problem}, not a tokenizer file")
    if path.suffix.lower() == ".gguf":
        from mtp.model import gguf

        return gguf.read_tokenizer(path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise InputError(f"--data.tokenizer {path} is not a valid tokenizer.json: {err}") from err


def check_tokenizer(tok: Tokenizer, vocab_size: int, source: str, eot_token: str) -> None:
    if tok.token_to_id(eot_token) is None:
        raise InputError(f"--data.tokenizer {source} has no end-of-text token {eot_token!r} "
                         f"(--model.eot_token)")
    # fewer tokens than embedding rows is fine (pretrained models pad their embeddings)
    if tok.get_vocab_size() > vocab_size:
        raise InputError(f"--data.tokenizer {source} has a vocabulary of {tok.get_vocab_size()} "
                         f"tokens but --model.vocab_size is {vocab_size}")
