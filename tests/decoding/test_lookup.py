"""Prompt lookup: the continuation it copies, and decoding with it alone or beside the heads."""

from __future__ import annotations

import itertools

import pytest
import torch
from decoding_helpers import random_model, train_cyclic

from mtp.decoding.generation import generate
from mtp.decoding.lookup import continuation, match

torch.set_num_threads(1)


def _reference(seq: list[int], most: int, ngram: int) -> tuple[list[int], int]:
    """Every earlier occurrence of every suffix, by brute force: the longest suffix (<= ngram)
    that occurs with a token after it, at its latest such start, and its length."""
    for n in range(ngram, 0, -1):
        if n >= len(seq):
            continue
        starts = [i for i in range(len(seq) - n) if seq[i : i + n] == seq[len(seq) - n :]]
        if starts:
            i = max(starts)
            return seq[i + n : i + n + most], n if most > 0 else 0
    return [], 0


def test_continuation_matches_brute_force() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        seq = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),),
                            generator=g).tolist()
        for most, ngram in itertools.product((1, 3, 10), (1, 2, 3)):
            want = _reference(seq, most, ngram)
            assert match(seq, most, ngram) == want, (seq, most)
            assert continuation(seq, most, ngram) == want[0]
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


def _round(worth, ctx, branch, tree_tokens, parent, emitted, ngram=2, first=None):
    """One scripted round of a batch of one: the branch offered (matched after an `ngram`, the
    heads' first draft `first`), the heads' tree (tokens, root first, and parents) and the
    tokens the round emitted; `ctx.stopper.out` then takes them in, as the loop's stopper
    does."""
    from types import SimpleNamespace

    worth.lookup.matched = [ngram if branch else 0]
    worth.gains([branch], None if first is None else [first])
    tree = SimpleNamespace(parent=torch.tensor(parent))
    v = SimpleNamespace(proposal=SimpleNamespace(tokens=torch.tensor([tree_tokens]), tree=tree),
                        emitted=[emitted])
    worth.observe(ctx, v, len(tree_tokens))
    ctx.stopper.out[0] += emitted


def _gains(worth, rows, ngrams, first=None):
    """What `worth` offers for continuations `rows` matched after `ngrams`."""
    worth.lookup.matched = ngrams
    return worth.gains(rows, first)


def test_lookup_worth_learns_what_the_branch_adds_beyond_the_tree() -> None:
    """Token i of the branch is credited where the branch's first i tokens are right and the
    heads' tree alone accepted fewer than i; a round is scored once the text has gone past its
    branch, whether the branch was verified or not (every round pooled: `by_kind=False`)."""
    from types import SimpleNamespace

    from mtp.decoding.lookup import PRIOR_GAIN, Lookup, LookupWorth, tree_accepted
    from mtp.decoding.stats import DecodeStats

    assert tree_accepted([4, 5, 9, 6], [0, 0, 1, 1], [5, 6, 8]) == 2  # root, 5, then 6
    assert tree_accepted([4, 5, 9], [0, 0, 1], [7]) == 0
    lookup = Lookup(tokens=3)
    lookup.start([[1, 2, 3]])
    ctx = SimpleNamespace(rows=[0], stopper=SimpleNamespace(out=[[4]]), stats=DecodeStats())
    worth = LookupWorth(lookup, ctx.stats.lookup_worth, by_kind=False)
    assert _gains(worth, [[5, 6]], [2]) == [PRIOR_GAIN, PRIOR_GAIN]
    # The target writes 5, 6, 8: the branch 5, 6, 7 has two right, the tree 5 -> 9 one.
    _round(worth, ctx, [5, 6, 7], [4, 5, 9], [0, 0, 1], [5, 6, 8])
    prior = (PRIOR_GAIN, 1.0)
    want = [(prior[0] + g) / (prior[1] + 1) for g in (0, 1, 0)]
    assert _gains(worth, [[1, 2, 3]], [1]) == pytest.approx(want)
    # A round offers 9, 9, 9 but verifies no token of it (the tree is the root): the next two
    # rounds write 9, then 9, 9, and only then is it scored: all three would have been taken.
    _round(worth, ctx, [9, 9, 9], [8], [0], [9], ngram=1, first=9)
    assert _gains(worth, [[1, 2, 3]], [2]) == pytest.approx(want)
    _round(worth, ctx, [], [9], [0], [9, 9])
    want = [(prior[0] + g) / (prior[1] + 2) for g in (1, 2, 1)]
    assert _gains(worth, [[1, 2, 3]], [2]) == pytest.approx(want)
    # One branch for a batch: a row without an i-th token adds nothing at i.
    assert _gains(worth, [[1, 2], [3]], [2, 1]) == pytest.approx([want[0], want[1] / 2])
    # The decode's stats keep the scored rounds by kind, whatever the learner draws on.
    assert ctx.stats.lookup_worth == {(2, False): ([1, 1, 1], [0, 1, 0]),
                                      (1, True): ([1, 1, 1], [1, 1, 1])}


def test_lookup_worth_by_kind_of_match_draws_each_kind_towards_the_pooled_estimate() -> None:
    """Per kind of match (n-gram length, first token the heads' first draft or not), a kind's
    estimate at position i is (its gains + KIND_PRIOR x the pooled estimate) / (its rounds +
    KIND_PRIOR); a kind never seen takes the pooled estimate; rows of a batch take their own
    kind's; `DecodeStats.add` sums the kinds' counts and `lookup_lines` prints them."""
    from types import SimpleNamespace

    from mtp.decoding.lookup import KIND_PRIOR, PRIOR_GAIN, Lookup, LookupWorth
    from mtp.decoding.stats import DecodeStats

    lookup = Lookup(tokens=2)
    lookup.start([[1, 2, 3]])
    ctx = SimpleNamespace(rows=[0], stopper=SimpleNamespace(out=[[4]]), stats=DecodeStats())
    worth = LookupWorth(lookup, ctx.stats.lookup_worth)
    # Three rounds of 2-grams that contradict the heads (first draft 7) and are right where
    # the tree accepts nothing; one 1-gram round that agrees with them (first draft 5) and is
    # wrong at its second token.
    for _ in range(3):
        _round(worth, ctx, [5, 6], [4, 7], [0, 0], [5, 6, 1], ngram=2, first=7)
    _round(worth, ctx, [5, 9], [4, 5], [0, 0], [5, 6, 1], ngram=1, first=5)
    # what each position saw, pooled: the prior round, then 4 rounds
    pooled = [(PRIOR_GAIN + 3) / 5, (PRIOR_GAIN + 3) / 5]
    contradict = [(3 + KIND_PRIOR * p) / (3 + KIND_PRIOR) for p in pooled]
    agree = [(0 + KIND_PRIOR * p) / (1 + KIND_PRIOR) for p in pooled]
    assert _gains(worth, [[1, 2]], [2], first=[8]) == pytest.approx(contradict)
    assert _gains(worth, [[1, 2]], [1], first=[1]) == pytest.approx(agree)
    assert _gains(worth, [[1, 2]], [2], first=[1]) == pytest.approx(pooled)  # never seen
    assert _gains(worth, [[1, 2]], [1], first=None) == pytest.approx(pooled)  # no heads
    assert _gains(worth, [[1, 2], [3]], [2, 1], first=[8, 3]) == pytest.approx(
        [(contradict[0] + agree[0]) / 2, contradict[1] / 2])
    # the ablation: every round pooled
    worth.by_kind = False
    assert _gains(worth, [[1, 2]], [2], first=[8]) == pytest.approx(pooled)
    counts = {(2, False): ([3, 3], [3, 3]), (1, True): ([1, 1], [0, 0])}
    assert ctx.stats.lookup_worth == counts
    total = DecodeStats()
    total.add(ctx.stats)
    total.add(ctx.stats)
    assert total.lookup_worth == {k: ([2 * r for r in rounds], [2 * a for a in added])
                                  for k, (rounds, added) in counts.items()}
    assert total.lookup_lines() == [
        "1-gram match, first token = the heads' first draft: 2 rounds; tokens added by "
        "position 0.00 0.00",
        "2-gram match, first token != the heads' first draft: 6 rounds; tokens added by "
        "position 1.00 1.00"]


