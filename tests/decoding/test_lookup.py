"""Prompt lookup: the continuation it copies, and decoding with it alone or beside the heads."""

from __future__ import annotations

import itertools

import pytest
import torch
from decoding_helpers import random_model, train_cyclic

from mtp.decoding.generation import generate
from mtp.decoding.lookup import continuation

torch.set_num_threads(1)


def _reference(seq: list[int], most: int, ngram: int) -> list[int]:
    """Every earlier occurrence of every suffix, by brute force: the longest suffix (<= ngram)
    that occurs with a token after it, at its latest such start."""
    for n in range(ngram, 0, -1):
        if n >= len(seq):
            continue
        starts = [i for i in range(len(seq) - n) if seq[i : i + n] == seq[len(seq) - n :]]
        if starts:
            i = max(starts)
            return seq[i + n : i + n + most]
    return []


def test_continuation_matches_brute_force() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        seq = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),),
                            generator=g).tolist()
        for most, ngram in itertools.product((1, 3, 10), (1, 2, 3)):
            assert continuation(seq, most, ngram) == _reference(seq, most, ngram), (seq, most)
    assert continuation([5, 6, 7, 5, 6], 10, 2) == [7, 5, 6]  # the match that ends at 6
    assert continuation([1, 2, 3, 9, 2, 3, 8, 2, 3], 1, 2) == [8]  # the latest, not the first
    assert continuation([1, 2, 3], 10, 2) == [] and continuation([4, 4], 0, 2) == []


@pytest.fixture(scope="module")
def cyclic():
    return train_cyclic()[1]  # heads right now and then: both branches matter


def test_lookup_keeps_greedy_output_and_drafts(cyclic) -> None:
    """A prompt holding the cycle twice: lookup drafts are taken, output stays greedy's."""
    cycle = cyclic.cycle
    prompts = [cycle * 2 + cycle[:3], [7, 3] + cycle[4:] + cycle, [9, 9, 9]]
    ref, _ = generate(cyclic, prompts, 40)
    heads_only = generate(cyclic, prompts, 40, decoder="tree")[1]
    for kwargs in ({"decoder": "lookup"}, {"decoder": "lookup", "lookup": 3},
                   {"decoder": "self-spec", "lookup": 8}, {"decoder": "tree", "lookup": 8},
                   {"decoder": "self-spec", "heads": 1, "lookup": 4}):
        out, stats = generate(cyclic, prompts, 40, **kwargs)
        assert out == ref, kwargs
        assert stats.tokens_per_forward > 1.5, kwargs
    # The lookup branch adds what the heads missed.
    both = generate(cyclic, prompts, 40, decoder="tree", lookup=8)[1]
    assert both.tokens_per_forward > heads_only.tokens_per_forward


def test_lookup_on_text_that_never_repeats_is_plain_decoding() -> None:
    model = random_model(n_future=1)
    prompt = [list(range(40))]  # no token twice; greedy may still repeat itself
    ref, _ = generate(model, prompt, 1)
    out, stats = generate(model, prompt, 1, decoder="lookup")
    assert out == ref and stats.tokens_per_forward == 1.0


def test_lookup_errors_name_the_argument() -> None:
    model = random_model()
    with pytest.raises(ValueError, match="takes no temperature"):
        generate(model, [[1, 2]], 4, decoder="lookup", temperature=0.5)
    with pytest.raises(ValueError, match="not with 'greedy'"):
        generate(model, [[1, 2]], 4, lookup=4)
    with pytest.raises(ValueError, match="lookup must be >= 0"):
        generate(model, [[1, 2]], 4, decoder="tree", lookup=-1)
    with pytest.raises(ValueError, match="DeepSeek.s modules .* parallel or eagle heads"):
        generate(random_model(head_type="deepseek"), [[1, 2]], 4, decoder="tree", lookup=4)
