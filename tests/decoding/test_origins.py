"""The streaming hook: `generate(..., on_tokens=...)` hears each round's tokens with each one's
origin (`mtp.decoding.origin`), for every drafter, and listening changes nothing."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
import torch
from decoding_helpers import cyclic_prompts, train_cyclic

from mtp.decoding.generation import generate
from mtp.decoding.origin import DRAFT_MODEL, HEAD_1, LOOKUP, ORACLE, origin_name
from mtp.decoding.stopper import Stopper
from mtp.decoding.tree import DynamicTree, Tree

torch.set_num_threads(1)

HEADS = {2, 3, 4}
#: decoder, its arguments, the origins its drafts may have
CASES = {
    "greedy": ("greedy", {}, set()),
    "sample": ("sample", {"temperature": 0.9}, set()),
    "chain": ("self-spec", {}, HEADS),
    "chain sampled": ("self-spec", {"temperature": 0.9}, HEADS),
    "chain adaptive": ("self-spec", {"adaptive": True}, HEADS),
    "tree": ("tree", {"tree": Tree.from_widths([3, 2, 1])}, HEADS),
    "dynamic tree": ("tree", {"tree": DynamicTree(max_nodes=8)}, HEADS),
    "chain + lookup": ("self-spec", {"lookup": 6}, HEADS | {LOOKUP}),
    "tree + lookup": ("tree", {"lookup": 6}, HEADS | {LOOKUP}),
    "lookup": ("lookup", {}, {LOOKUP}),
    "draft": ("draft", {"gamma": 3}, {DRAFT_MODEL}),
    "oracle": ("oracle", {"gamma": 3}, {ORACLE}),
}


@pytest.fixture(scope="module")
def models():
    return train_cyclic()


@pytest.fixture(scope="module")
def cascaded():
    return train_cyclic(steps=120, snapshot=2, head_type="deepseek")[0]


def _listen(model, prompts, n, decoder, kwargs, early=None, seed=0):
    """Decode with a listener: (outputs, stats, each row's rounds as (tokens, origins))."""
    heard = defaultdict(list)
    kwargs = dict(kwargs)
    if decoder == "draft":
        kwargs["draft_model"] = early
    if decoder == "oracle":
        kwargs["reference"] = generate(model, prompts, n)[0]
    out, stats = generate(model, prompts, n, decoder=decoder,
                          generator=torch.Generator().manual_seed(seed),
                          on_tokens=lambda row, t, o: heard[row].append((t, o)), **kwargs)
    return out, stats, heard


def _check_rounds(rounds, allowed, cut_last: bool) -> None:
    """Each round: its drafts, then the verifier's token; drafts of one branch, heads in depth
    order (head d + 1 at depth d)."""
    for i, (tokens, origins) in enumerate(rounds):
        assert len(origins) == len(tokens) > 0
        *drafts, last = origins
        if not (cut_last and i == len(rounds) - 1):
            assert last == HEAD_1
        else:
            drafts = origins[:-1] if last == HEAD_1 else origins
        assert set(drafts) <= allowed
        if drafts and drafts[0] != LOOKUP and drafts[0] in HEADS:
            assert drafts == list(range(2, 2 + len(drafts)))  # the heads' chain or tree path
        elif drafts:
            assert len(set(drafts)) == 1  # a round keeps one branch


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_token_carries_its_origin_one_prompt_at_a_time(models, case) -> None:
    """One prompt at a time, nothing cuts a round (no end-of-text, no stop; a round never drafts
    past max_new_tokens): the origins counted are the call's statistics exactly."""
    model, early = models
    decoder, kwargs, allowed = CASES[case]
    seen = Counter()
    for prompt in cyclic_prompts(model, 4, seed=31):
        out, stats, heard = _listen(model, [prompt], 30, decoder, kwargs, early)
        rounds = heard[0]
        assert [t for toks, _ in rounds for t in toks] == out[0]
        _check_rounds(rounds, allowed, cut_last=False)
        counts = Counter(o for _, origins in rounds for o in origins)
        assert counts[HEAD_1] == stats.row_forwards == len(rounds)
        assert sum(counts.values()) == stats.tokens
        # taken[i]: rounds that accepted a draft at depth i + 1
        depths = Counter(i for _, origins in rounds for i in range(len(origins) - 1))
        assert [depths[i] for i in range(len(stats.taken))] == stats.taken
        if allowed == HEADS:
            assert [counts[k] for k in range(2, 2 + len(stats.taken))] == stats.taken
        assert Counter(len(t) for t, _ in rounds) == Counter(
            {n: c for n, c in enumerate(stats.accepted) if c})
        seen.update(counts)
    if allowed and not kwargs.get("temperature"):
        assert set(seen) - {HEAD_1}, f"{case}: no draft was accepted, the test shows nothing"


@pytest.mark.parametrize("case", ["chain", "tree + lookup", "draft", "chain sampled"])
def test_a_batchs_rows_each_hear_their_own_tokens(models, case) -> None:
    """Rows of a batch accept different drafts per round; each row's listener calls rebuild its
    output, and listening changes neither the output nor the random draws."""
    model, early = models
    decoder, kwargs, allowed = CASES[case]
    prompts = cyclic_prompts(model, 5, seed=32)
    out, stats, heard = _listen(model, prompts, 24, decoder, kwargs, early, seed=3)
    for row, rounds in heard.items():
        assert [t for toks, _ in rounds for t in toks] == out[row]
        # a row may end mid-round where the longest row still had room for more drafts
        _check_rounds(rounds, allowed, cut_last=True)
    assert sum(len(r) for r in heard.values()) == stats.row_forwards
    kwargs = {**kwargs, "draft_model": early} if decoder == "draft" else kwargs
    alone, _ = generate(model, prompts, 24, decoder=decoder,
                        generator=torch.Generator().manual_seed(3), **kwargs)
    assert alone == out


@pytest.mark.parametrize("decoder,kwargs", [("self-spec", {}),
                                            ("tree", {"tree": Tree.from_widths([2, 2, 1])})])
def test_cascaded_heads_report_their_depth(cascaded, decoder, kwargs) -> None:
    """Cascaded heads: the draft at depth d is head d + 1's."""
    prompts = cyclic_prompts(cascaded, 3, seed=33)
    drafted = 0
    for prompt in prompts:
        out, stats, heard = _listen(cascaded, [prompt], 24, decoder, kwargs)
        _check_rounds(heard[0], HEADS, cut_last=False)
        assert [t for toks, _ in heard[0] for t in toks] == out[0]
        drafted += stats.tokens - stats.row_forwards
    assert drafted > 0


def test_the_stopper_hands_over_the_kept_tokens_origins() -> None:
    """A stop cuts a round: the listener hears the kept tokens and their origins only; tokens
    handed in without origins are the verifier's."""
    heard = []
    stopper = Stopper(1, 100, None, ["bc"], lambda t: "".join(map(chr, t)),
                      lambda row, toks, origins: heard.append((toks, origins)))
    assert stopper.listening
    assert stopper.extend(0, [ord("a")]) == (1, False)
    assert stopper.extend(0, [ord(c) for c in "bcbd"], [2, 3, LOOKUP, HEAD_1]) == (2, True)
    assert heard == [([ord("a")], [HEAD_1]), ([ord("b"), ord("c")], [2, 3])]
    assert not Stopper(1, 5, None, [], None, None).listening


def test_origin_names() -> None:
    assert [origin_name(o) for o in (HEAD_1, 2, 7, LOOKUP, DRAFT_MODEL, ORACLE)] == [
        "head 1", "head 2", "head 7", "lookup", "draft model", "oracle"]
    with pytest.raises(ValueError, match="no token origin has the code 0"):
        origin_name(0)
