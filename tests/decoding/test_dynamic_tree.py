"""Dynamic trees (`DynamicTree`; parallel heads, DeepSeek's modules, eagle's layer): each
round's tree is the set of likeliest paths whose size maximises expected tokens per second, and
greedy output is unchanged whatever tree a round grows."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from decoding_helpers import cyclic_prompts, random_model, random_prompts, train_cyclic

from mtp.decoding import generate
from mtp.decoding.cost import cost_lines, verify_seconds
from mtp.decoding.tree import DynamicTree, Tree, best_first


def _brute_force(chances: torch.Tensor, seconds: list[float], max_nodes: int,
                 extra: float = 0.0) -> tuple:
    """Every prefix-closed set of paths up to max_nodes nodes, scored by (1 + extra + the sum of
    its paths' chances) / seconds[its size]: the best score and the sets that reach it."""
    depth, top = chances.shape
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(top), repeat=d)]
    chance = {p: float(torch.prod(chances[torch.arange(len(p)), torch.tensor(p)])) for p in paths}
    best, argbest = -1.0, []
    for n in range(max_nodes + 1):
        for subset in itertools.combinations(paths, n):
            chosen = set(subset)
            if any(p[:-1] and p[:-1] not in chosen for p in chosen):
                continue
            rate = (1 + extra + sum(chance[p] for p in chosen)) / seconds[n]
            if rate > best + 1e-12:
                best, argbest = rate, [chosen]
            elif abs(rate - best) <= 1e-12:
                argbest.append(chosen)
    return best, argbest


@pytest.mark.parametrize("slope", [0.0, 0.02, 0.2, 2.0])
def test_the_grown_tree_is_the_best_tree_for_the_measured_cost(slope):
    """Against every tree of at most 5 nodes over 2 heads' top 3: the tree grown has the best
    expected tokens per second, whatever the forward's cost per token."""
    g = torch.Generator().manual_seed(0)
    chances = torch.rand(2, 3, generator=g).sort(descending=True).values * 0.9
    seconds = [1.0 + slope * n for n in range(6)]
    tree, m = DynamicTree(max_nodes=5, top=3).grow(chances, seconds)
    assert m == 0
    nodes = set(tree.paths[1:])
    best, argbest = _brute_force(chances, seconds, 5)
    assert nodes in argbest
    if slope == 0.0:  # a free node is always worth its chance
        assert len(nodes) == 5
    if slope == 2.0:  # no node is worth twice the forward
        assert nodes == set()


@pytest.mark.parametrize("slope", [0.0, 0.05, 0.3, 2.0])
def test_the_grown_tree_and_the_branch_beside_it_are_the_best_for_the_measured_cost(slope):
    """With a branch beside the tree whose i-th token adds gains[i - 1] (prompt lookup's): the
    tree and branch length chosen have the best expected tokens per second of every tree of at
    most 4 nodes and every branch length."""
    g = torch.Generator().manual_seed(1)
    chances = torch.rand(2, 3, generator=g).sort(descending=True).values * 0.9
    gains = [0.6, 0.1, 0.4]  # a later token may add more than an earlier one
    seconds = [1.0 + slope * t for t in range(8)]
    tree, m = DynamicTree(max_nodes=4, top=3).grow(chances, seconds, gains)
    rate = (1 + sum(float(torch.prod(chances[torch.arange(len(p)), torch.tensor(p)]))
                    for p in tree.paths[1:]) + sum(gains[:m])) / seconds[len(tree.paths) - 1 + m]
    best = max(_brute_force(chances, seconds[k:], 4, extra=sum(gains[:k]))[0] for k in range(4))
    assert rate == pytest.approx(best)
    if slope == 0.0:  # free tokens: all of them
        assert (len(tree.paths), m) == (5, 3)
    if slope == 2.0:
        assert (len(tree.paths), m) == (1, 0)
    # the ablation: the branch whole, and the best tree beside it
    tree, m = DynamicTree(max_nodes=4, top=3, whole_branch=True).grow(chances, seconds, gains)
    rate = (1 + sum(float(torch.prod(chances[torch.arange(len(p)), torch.tensor(p)]))
                    for p in tree.paths[1:]) + sum(gains)) / seconds[len(tree.paths) + 2]
    assert m == 3
    assert rate == pytest.approx(_brute_force(chances, seconds[3:], 4, extra=sum(gains))[0])


def test_best_first_lists_paths_by_chance_and_every_prefix_is_a_tree():
    chances = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]])
    listed = best_first(chances, 12)
    values = [c for c, _ in listed]
    assert values == sorted(values, reverse=True)
    for n in range(len(listed) + 1):
        Tree.from_paths([p for _, p in listed[:n]])  # raises if a path lacks its parent
    assert listed[0] == (pytest.approx(0.6), (0,)) and listed[1][1] == (0, 0)


@pytest.fixture(scope="module", params=["block", "deepseek", "eagle"])
def cyclic(request):
    """Heads trained to be right most of the time (`train_cyclic`): parallel block heads, and
    DeepSeek's modules and eagle's layer, whose trees grow a level at a time from their own
    drafts."""
    return train_cyclic(head_type=request.param)[0]


@pytest.mark.parametrize("lookup", [0, 4])
def test_dynamic_trees_decode_exactly_greedys_tokens(cyclic, lookup):
    """A batch of prompts of different lengths: the output equals greedy's token for token, and
    the heads' drafts are accepted."""
    from mtp.decoding import RequestError

    model = cyclic
    prompts = cyclic_prompts(model, 6, seed=3)
    if lookup and model.cfg.head_type == "deepseek":
        with pytest.raises(RequestError, match="lookup beside DeepSeek's modules"):
            generate(model, prompts, 30, decoder="tree", tree=DynamicTree(), lookup=lookup)
        return
    want, _ = generate(model, prompts, 30)
    got, stats = generate(model, prompts, 30, decoder="tree", tree=DynamicTree(max_nodes=16),
                          lookup=lookup)
    assert got == want
    assert stats.tokens_per_forward > 1.5


@pytest.mark.parametrize("cyclic", ["block", "eagle"], indirect=True)  # DeepSeek's: no lookup
@pytest.mark.parametrize(("slope", "whole"), [(0.0, False), (2.0, False), (2.0, True)])
def test_beside_a_dynamic_tree_lookup_verifies_the_tokens_worth_their_time(cyclic, slope, whole,
                                                                          monkeypatch):
    """Lookup's branch is as long as pays for the forward's time: all of it where tokens cost
    nothing, none of it (and no tree) where each costs two forwards; with `whole_branch` all of
    it whatever it costs (the ablation); greedy's output every way."""
    from mtp.decoding import cost
    from mtp.decoding.lookup import Lookup

    model = cyclic
    prompts = cyclic_prompts(model, 4, seed=5)
    most = 8 + 1 + 4  # the tree's nodes, the root, the branch
    cost._measured.setdefault(model, {})[(len(prompts), most, torch.get_num_threads())] = \
        [1.0 + slope * t for t in range(most)]
    offered, verified = [], []  # each round's longest continuation, the tokens verified
    continuations, pad = Lookup.continuations, Lookup.pad

    def offer(self, ctx, most):
        rows = continuations(self, ctx, most)
        offered.append(max(map(len, rows), default=0))
        return rows

    def verify(rows, device, m=None):
        verified.append(m)
        return pad(rows, device, m)

    monkeypatch.setattr(Lookup, "continuations", offer)
    monkeypatch.setattr(Lookup, "pad", staticmethod(verify))
    try:
        want, _ = generate(model, prompts, 30)
        got, stats = generate(model, prompts, 30, decoder="tree",
                              tree=DynamicTree(max_nodes=8, whole_branch=whole), lookup=4)
    finally:
        del cost._measured[model]
    assert got == want
    assert any(offered)
    if slope == 0.0 or whole:
        assert verified == [m for m in offered if m]
    else:
        assert not verified and stats.tokens_per_forward == 1.0


@pytest.mark.parametrize("cyclic", ["block", "eagle"], indirect=True)
def test_lookup_kinds_compare_the_branch_with_the_heads_first_draft(cyclic, monkeypatch):
    """The heads' first draft that a continuation's kind is judged against is the token of the
    round's tree node at depth 1 and rank 0 (head 2's likeliest, or the root's likeliest child
    for eagle's layer), row by row; the decode's stats keep the kinds it scored."""
    from mtp.decoding import cost
    from mtp.decoding.lookup import LookupWorth

    model = cyclic
    prompts = cyclic_prompts(model, 4, seed=5)
    most = 8 + 1 + 4
    cost._measured.setdefault(model, {})[(len(prompts), most, torch.get_num_threads())] = \
        [1.0] * most  # every node free: the tree holds its likeliest first-level node
    firsts, checked = [], []
    gains, observe = LookupWorth.gains, LookupWorth.observe

    def record(self, rows, first=None):
        firsts.append(first)
        return gains(self, rows, first)

    def check(self, ctx, v, n_tree):
        tt = v.proposal.tree
        node = [j for j in range(n_tree) if tt.depth[j] == 1 and tt.rank[j] == 0]
        if node:
            checked.append(firsts[-1] == v.proposal.tokens[:, node[0]].tolist())
        return observe(self, ctx, v, n_tree)

    monkeypatch.setattr(LookupWorth, "gains", record)
    monkeypatch.setattr(LookupWorth, "observe", check)
    try:
        want, _ = generate(model, prompts, 30)
        got, stats = generate(model, prompts, 30, decoder="tree",
                              tree=DynamicTree(max_nodes=8), lookup=4)
    finally:
        del cost._measured[model]
    assert got == want
    assert checked and all(checked)
    assert stats.lookup_worth and {n for n, _ in stats.lookup_worth} <= {1, 2}


@pytest.mark.parametrize("head_type", ["block", "deepseek", "eagle"])
def test_dynamic_trees_of_untrained_heads_keep_greedys_output(head_type):
    model = random_model(0, head_type=head_type)
    prompts = random_prompts(4, model.cfg.vocab_size, seed=1)
    want, _ = generate(model, prompts, 20)
    got, _ = generate(model, prompts, 20, decoder="tree", tree=DynamicTree(max_nodes=8, top=3))
    assert got == want


def test_the_verify_cost_is_measured_once_per_model_and_batch():
    model = random_model(0)
    first = verify_seconds(model, 1, 10)
    assert len(first) == 10 and all(s > 0 for s in first)
    assert verify_seconds(model, 1, 10) is first  # kept, not measured again
    assert verify_seconds(model, 2, 10) is not first
    # what `mtp bench decode` prints of it: a line per batch size, each count against one token
    lines = cost_lines(model)
    threads = torch.get_num_threads()
    assert [line.split(":")[0] for line in lines] == \
        [f"verify forward (batch {b}, {threads} threads)" for b in (1, 2)]
    assert "t: 1: 1.00x, 2: " in lines[0] and lines[0].endswith(
        f"8: {first[7] / first[0]:.2f}x")
    assert cost_lines(random_model(0)) == []


def test_the_verify_cost_keeps_each_counts_fastest_time_never_above_a_larger_counts(
        monkeypatch):
    """A forward over t tokens costs 1 + t / 100 on a scripted clock, 10 more in the first two
    passes through the grid (a slow stretch of the machine), and 6 tokens always 5 (slower
    than 8)."""
    clock = [0.0]
    passes: dict[int, int] = {}

    def forward(model, cache, tokens, positions, mask):
        t = tokens.shape[1]
        passes[t] = passes.get(t, 0) + 1
        clock[0] += 5.0 if t == 6 else 1 + t / 100 + (10 if passes[t] <= 2 else 0)
        return torch.zeros(*tokens.shape, model.cfg.d_model), None

    monkeypatch.setattr("mtp.decoding.cost.forward", forward)
    monkeypatch.setattr("mtp.decoding.cost.time", SimpleNamespace(perf_counter=lambda: clock[0]))
    seconds = verify_seconds(random_model(0), 1, 10)
    want = {1: 1.01, 2: 1.02, 3: 1.03, 4: 1.04, 6: 1.08, 8: 1.08, 10: 1.10}
    assert seconds[5] == pytest.approx(want[6])  # 6 tokens charged as 8
    for t, s in want.items():
        assert seconds[t - 1] == pytest.approx(s)
    assert seconds[4] == pytest.approx((want[4] + want[6]) / 2)  # interpolated
    assert all(a <= b for a, b in zip(seconds, seconds[1:]))
