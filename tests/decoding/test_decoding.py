"""Decoding: speculative greedy equals greedy, speculative sampling is exact, batches, stops.

Random models rarely agree with their own heads, so the equality tests also use a model trained
for a few seconds on a cyclic token stream: its heads are right most of the time, drafts are
accepted (L > 1) and sometimes rejected, and an off-by-one in acceptance or in the cache would
change the output.
"""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from decoding_helpers import (
    N_NEW,
    N_SAMPLES,
    SAMPLING,
    V_TINY,
    cell,
    chi2_pvalue,
    cyclic_prompts,
    random_model,
    random_prompts,
    spread_prompts,
    tiny_model,
    train_cyclic,
)

from mtp.decoding import acceptance, engine, sampling, stacked
from mtp.decoding import tree as tree_mod
from mtp.decoding.generation import generate
from mtp.decoding.sampling import probs_from_logits
from mtp.decoding.tree import Tree, head_accuracy
from mtp.model.transformer import KVCache, MTPTransformer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trained() -> tuple[MTPTransformer, MTPTransformer]:
    return train_cyclic()


@pytest.fixture(scope="module")
def cyclic_model(trained) -> MTPTransformer:
    return trained[0]


@pytest.fixture(scope="module")
def early_model(trained) -> MTPTransformer:
    return trained[1]


# --------------------------------------------------------------------------------------------
# Greedy exactness


@pytest.mark.parametrize("decoder", ["self-spec", "tree"])
def test_speculative_greedy_equals_greedy_on_a_random_model(decoder: str) -> None:
    """An untrained K = 4 model: its greedy text falls into short cycles, and its heads, near
    copies of one another at initialisation, sometimes draft them."""
    model = random_model()
    prompts = random_prompts(32, model.cfg.vocab_size, seed=3)
    ref, _ = generate(model, prompts, 48)
    out, stats = generate(model, prompts, 48, decoder=decoder)
    assert out == ref
    assert all(len(o) == 48 for o in out)
    assert stats.tokens == 32 * 48
    # The equality says something only where drafts were accepted: some rounds took one or more
    # drafts, some all K - 1 of them.
    assert stats.tokens_per_forward > 1 and sum(stats.accepted[2:]) > 0, stats.accepted
    assert len(stats.accepted) == model.cfg.n_future + 1 and stats.accepted[-1] > 0, stats.accepted


@pytest.mark.parametrize(
    ("decoder", "kwargs"),
    [
        ("self-spec", {}),
        ("self-spec", {"heads": 2}),
        ("tree", {}),
        ("tree", {"heads": 3, "tree": Tree.from_widths([4, 3])}),
        ("tree", {"tree": Tree.from_paths([(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)])}),
        ("lookup", {}),
        ("self-spec", {"lookup": 5}),
        ("tree", {"lookup": 6, "lookup_ngram": 3}),
    ],
)
@pytest.mark.parametrize("which", ["cyclic_model", "early_model"])
def test_speculative_greedy_equals_greedy_with_acceptance(request, which, decoder, kwargs) -> None:
    model = request.getfixturevalue(which)
    prompts = cyclic_prompts(model, 24, seed=4)
    ref, base = generate(model, prompts, 48)
    out, stats = generate(model, prompts, 48, decoder=decoder, **kwargs)
    assert out == ref
    assert base.tokens_per_forward == 1.0
    # The comparison is only meaningful if drafts were accepted and rejected: some forwards
    # (besides the prefills) produced one token, some took every draft.
    assert stats.tokens_per_forward > 1.1
    assert stats.accepted[1] > len(prompts) and stats.accepted[-1] > 0 and len(stats.accepted) > 2


def test_draft_model_greedy_equals_greedy(cyclic_model) -> None:
    # The target drafting for itself accepts everything; a random draft model almost nothing.
    prompts = cyclic_prompts(cyclic_model, 12, seed=5)
    ref, _ = generate(cyclic_model, prompts, 40)
    out, stats = generate(cyclic_model, prompts, 40, decoder="draft", draft_model=cyclic_model,
                          gamma=3)
    assert out == ref
    # Each row: the prefill (1 token), 9 rounds of 3 drafts + 1, a last round cut to 3 tokens.
    assert stats.accepted == [0, 12, 0, 12, 9 * 12]
    draft = random_model(7, n_future=1)
    out, stats = generate(cyclic_model, prompts, 40, decoder="draft", draft_model=draft, gamma=2)
    assert out == ref
    assert stats.draft_forwards > 0


def _reference_accepted(drafter, prompt, ref, n_draft):
    """Tokens per forward of greedy speculation, recomputed with full forwards (no cache).

    At a step with `pos` tokens out (the pending one is ref[pos - 1]), draft i (1-based) guesses
    ref[pos - 1 + i]: `drafter(seq, i)` gives its candidates from the committed tokens seq.
    Drafts are accepted while they hold the right token; the step adds one token of its own.
    """
    hist, pos = [0, 1], 1  # the prefill gives one token
    while pos < len(ref):
        n = min(n_draft, len(ref) - pos - 1)
        a = 0
        while a < n and ref[pos + a] in drafter(prompt + ref[: pos - 1], prompt + ref[:pos], a + 1):
            a += 1
        hist.extend([0] * (a + 2 - len(hist)))
        hist[a + 1] += 1
        pos += a + 1
    return hist


def test_acceptance_lengths_match_a_reference(cyclic_model, early_model) -> None:
    """L itself is right: each forward accepts what full forwards say it should."""

    def heads(model, widths):
        def drafter(before, _, i):  # head i + 1 at the pending token's predecessor
            logits = model(torch.tensor([before]))[i, 0, -1]
            return logits.topk(widths[i - 1]).indices.tolist()
        return drafter

    def chain(model):
        def drafter(_, seq, i):  # the draft model continues its own guesses
            guess = list(seq)
            for _ in range(i):
                guess.append(int(model(torch.tensor([guess]), heads=1)[0, 0, -1].argmax()))
            return [guess[-1]]
        return drafter

    cases = [
        (early_model, "self-spec", {}, heads(early_model, [1, 1, 1]), 3),
        (early_model, "self-spec", {"heads": 3}, heads(early_model, [1, 1]), 2),
        (early_model, "tree", {"tree": Tree.from_widths([3, 2, 2])},
         heads(early_model, [3, 2, 2]), 3),
        (cyclic_model, "draft", {"draft_model": early_model, "gamma": 3}, chain(early_model), 3),
    ]
    for prompt in cyclic_prompts(cyclic_model, 4, seed=10):
        for model, decoder, kwargs, drafter, n in cases:
            ref = generate(model, [prompt], 24)[0][0]
            out, stats = generate(model, [prompt], 24, decoder=decoder, **kwargs)
            assert out[0] == ref
            expected = _reference_accepted(drafter, prompt, ref, n)
            assert stats.accepted == expected, (decoder, prompt)
            assert expected[1] > 1 and len(expected) > 2  # drafts rejected and accepted


@pytest.mark.parametrize(
    ("decoder", "kwargs"),
    [("self-spec", {}), ("tree", {"tree": Tree.from_widths([3, 2, 2])}), ("draft", {}),
     ("self-spec", {"adaptive": "alternate"}), ("tree", {"adaptive": "alternate"}),
     ("tree", {"lookup": 4}), ("lookup", {})],
)
def test_cache_holds_exactly_the_committed_tokens(early_model, monkeypatch, decoder, kwargs):
    """After decoding, every layer's cache (trunk, head 1, draft heads; the draft model's too)
    holds the keys and values a fresh forward over the committed tokens computes: rejected
    drafts and tree branches left nothing behind, and the accepted path sits in order."""
    caches = []
    new_cache = engine.new_cache

    def spy(model, batch, max_len):
        caches.append((model, new_cache(model, batch, max_len)))
        return caches[-1][1]

    # Every cache of a call, the target's and the draft model's, comes from engine.new_cache.
    monkeypatch.setattr(engine, "new_cache", spy)
    monkeypatch.setattr("mtp.decoding.generation.new_cache", spy)
    monkeypatch.setattr("mtp.decoding.drafters.new_cache", spy)
    if decoder == "draft":
        kwargs = {"draft_model": random_model(5, n_future=1), "gamma": 3}
    if kwargs.get("adaptive") == "alternate":
        # Rounds without drafts between rounds with them: heads 2..h skip the former and must
        # catch up on their tokens before drafting again.
        from mtp.decoding.policy import Adaptive

        class Alternate(Adaptive):
            def choose(self, ctx, most):
                self.rounds += 1
                return ctx.room(most) if self.rounds % 2 else 0

        kwargs = {"adaptive": Alternate()}
    # Tokens of the last rounds that drafted nothing, which heads 2..h have not seen: the
    # round(s) after the last drafting one (one with no room for drafts; one more alternating).
    unseen = 2 if "adaptive" in kwargs else 1
    prompt = cyclic_prompts(early_model, 2, seed=15)[1]
    out, stats = generate(early_model, [prompt], 30, decoder=decoder, **kwargs)
    assert stats.tokens_per_forward > 1.1 or decoder == "draft"
    seq = prompt + out[0]
    for model, cache in caches:
        n = int(cache.lengths[0])
        if model is early_model:
            assert n == len(seq) - 1  # all but the pending token
        else:  # all but the last two; one fewer if the last round drafted nothing
            assert len(seq) - 3 <= n <= len(seq) - 2
        ref = KVCache(model.cfg, 1, n)
        x = torch.tensor([seq[:n]])
        with torch.no_grad():
            model(x, cache=ref, slots=torch.arange(n)[None],
                  mask=torch.ones(1, 1, n, n, dtype=torch.bool).tril())
        # The draft and lookup decoders run the target's trunk and head 1 only. Heads 2..h hold
        # every committed token but the unseen ones (they run only when drafts are wanted).
        target = model.cfg.n_trunk_layers + 1
        layers = target if decoder in ("draft", "lookup") else \
            model.cfg.n_trunk_layers + model.cfg.n_future
        for got, want in ((cache.k, ref.k), (cache.v, ref.v)):
            torch.testing.assert_close(got[:target, :, :, :n], want[:target], atol=2e-4,
                                       rtol=1e-4)
            torch.testing.assert_close(got[target:layers, :, :, : n - unseen],
                                       want[target:layers, :, :, : n - unseen], atol=2e-4,
                                       rtol=1e-4)


@pytest.mark.parametrize("group_cost", [0, 10**9])
def test_batched_greedy_equals_each_row_alone(cyclic_model, monkeypatch, group_cost) -> None:
    """Prompts of 1 to 76 tokens, prefilled in a forward per length (group cost 0) or all in
    one (the padding free), rows leaving the batch as they emit the end token, a live row
    taking each one's place: each row's output is what it decodes alone."""
    monkeypatch.setattr(engine, "GROUP_COST", group_cost)
    grouped, length_groups = [], engine.length_groups

    def recording(lengths, cost=engine.GROUP_COST):
        grouped.append(length_groups(lengths, cost))
        return grouped[-1]

    monkeypatch.setattr(engine, "length_groups", recording)
    random = random_model(2)  # its output hangs on every cached entry, the cycle's does not
    for model in (cyclic_model, random):
        prompts = spread_prompts(model, 8, seed=6)
        free, _ = generate(model, prompts, 32)
        # the batch's prefill ran a forward per length, or one
        assert len(grouped[-1]) == (len({len(p) for p in prompts}) if group_cost == 0 else 1)
        eot = collections.Counter(t for o in free for t in set(o)).most_common(1)[0][0]
        for decoder in ("greedy", "self-spec", "tree"):
            batched, _ = generate(model, prompts, 32, decoder=decoder, eot_id=eot)
            alone = [generate(model, [p], 32, decoder=decoder, eot_id=eot)[0][0]
                     for p in prompts]
            assert batched == alone, decoder
            assert len({len(o) for o in batched}) > 2  # rows ended at different rounds


def test_length_groups_are_the_cheapest_grouping() -> None:
    """Against every way of cutting the prompts, in length order, into groups."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = 1 + trial % 7
        lengths = torch.randint(1, 300, (n,), generator=g).tolist()
        cost = [0, 16, 64, 1000][trial % 4]
        groups = engine.length_groups(lengths, cost)
        assert sorted(r for grp in groups for r in grp) == list(range(n))

        def total(gs):
            return sum(len(gr) * max(lengths[r] for r in gr) + cost for gr in gs)

        order = sorted(range(n), key=lengths.__getitem__)
        best = min(total([order[a:b] for a, b in zip((0, *cuts), (*cuts, n))])
                   for k in range(n) for cuts in itertools.combinations(range(1, n), k))
        assert total(groups) == best


def test_fill_order_moves_one_row_per_finished_row() -> None:
    for alive in ([0, 1, 2], [1, 2], [0, 2, 4, 5, 6], [5], [0, 3, 4, 7, 8, 9]):
        order = engine.fill_order(alive)
        assert sorted(order) == alive
        moved = [i for i, r in enumerate(order) if r != i]
        assert len(moved) == sum(i not in alive for i in range(len(alive)))


def test_greedy_matches_uncached_forward() -> None:
    """The cached greedy baseline against argmax over a full forward each step."""
    model = random_model(2)
    prompt = random_prompts(1, model.cfg.vocab_size, seed=8)[0]
    out, _ = generate(model, [prompt], 12)
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(model(torch.tensor([seq]), heads=1)[0, 0, -1].argmax()))
    assert out[0] == seq[len(prompt):]


def test_heads_used_and_tree_from_accuracies(cyclic_model) -> None:
    prompts = cyclic_prompts(cyclic_model, 8, seed=9)
    ref, _ = generate(cyclic_model, prompts, 32)
    ls = [generate(cyclic_model, prompts, 32, decoder="self-spec", heads=h)[1].tokens_per_forward
          for h in (1, 2, 4)]
    assert ls[0] == 1.0 and ls[0] < ls[1] < ls[2]
    acc = head_accuracy(cyclic_model, [p + o for p, o in zip(prompts, ref, strict=True)],
                        start=[len(p) for p in prompts], max_rank=4)
    assert acc.shape == (3, 4) and acc[:, 0].min() > 0.5 and (acc.sum(1) <= 1 + 1e-6).all()
    tree = Tree.from_accuracies(acc, n_nodes=6)
    assert len(tree.paths) == 7 and tree.paths[1] == (0,)
    out, stats = generate(cyclic_model, prompts, 32, decoder="tree", tree=tree)
    assert out == ref and stats.tokens_per_forward > 1.5


def test_tree_shapes() -> None:
    tree = Tree.from_widths([3, 2])
    assert len(tree.paths) == 1 + 3 + 6 and tree.widths() == [3, 2] and tree.depth == 2
    assert tree.pruned(1).paths == ((), (0,), (1,), (2,))
    with pytest.raises(ValueError, match="no parent"):
        Tree(((), (0, 1)))
    tt = tree_mod.TreeTensors.build(Tree.from_paths([(0,), (1,), (0, 0)]), torch.device("cpu"))
    assert tt.ancestors.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    assert tt.path[3].tolist() == [0, 1, 3] and tt.path[2].tolist() == [0, 2, 2]


# --------------------------------------------------------------------------------------------
# Sampling exactness


@pytest.fixture(scope="module")
def tiny() -> tuple[MTPTransformer, list[int], torch.Tensor]:
    return tiny_model()


@pytest.mark.parametrize("decoder", ["sample", "self-spec", "tree", "draft", "adaptive"])
def test_speculative_sampling_is_exact(tiny, decoder: str) -> None:
    model, prompt, joint = tiny
    kwargs = {}
    if decoder == "adaptive":  # rounds verify as many drafts as the policy finds pay
        decoder, kwargs = "self-spec", {"adaptive": True}
    if decoder == "draft":
        kwargs = {"draft_model": random_model(12, vocab_size=V_TINY, n_future=1, init_std=0.5),
                  "gamma": 3}
    if decoder == "tree":
        kwargs = {"tree": Tree.from_widths([2, 1, 1])}
    out, stats = generate(model, [prompt] * N_SAMPLES, N_NEW, decoder=decoder,
                          generator=torch.Generator().manual_seed(13), **SAMPLING, **kwargs)
    counts = torch.bincount(cell(out), minlength=V_TINY**N_NEW)
    assert chi2_pvalue(counts, joint) > 1e-3
    if decoder != "sample":
        # Drafts were rejected in some forwards (besides the prefill) and all taken in others.
        assert stats.accepted[1] > N_SAMPLES and stats.accepted[-1] > 0
        assert stats.tokens_per_forward > 1.1


def test_chi_square_catches_a_missing_residual(tiny, monkeypatch) -> None:
    """Negative control: resampling from p instead of norm(max(0, p - q)) after a rejection
    biases the output, and the test above would see it."""
    model, prompt, joint = tiny
    exact = acceptance.accept_chain

    def biased(logits, drafts, q, rule, generator):
        a, _ = exact(logits, drafts, q, rule, generator)
        p = rule.probs(logits)[torch.arange(len(a)), a]
        return a, sampling.multinomial(p, generator)

    monkeypatch.setattr(engine, "accept_chain", biased)
    out, _ = generate(model, [prompt] * N_SAMPLES, N_NEW, decoder="self-spec",
                      generator=torch.Generator().manual_seed(13), **SAMPLING)
    counts = torch.bincount(cell(out), minlength=V_TINY**N_NEW)
    assert chi2_pvalue(counts, joint) < 1e-6


def test_probs_from_logits_filters() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = probs_from_logits(logits, 1.0, top_k=2)
    assert p[0, 2:].sum() == 0 and torch.allclose(p.sum(), torch.tensor(1.0))
    p = probs_from_logits(logits, 1.0, top_p=0.5)  # the top token alone holds 0.64
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    full = logits.softmax(-1)[0]
    p = probs_from_logits(logits, 1.0, top_p=0.9)
    assert torch.allclose(p[0, :3], full[:3] / full[:3].sum()) and p[0, 3] == 0


# --------------------------------------------------------------------------------------------
# Stop conditions


def test_stop_conditions(cyclic_model) -> None:
    prompt = cyclic_model.cycle[:5]
    ref, _ = generate(cyclic_model, [prompt], 30)
    eot = ref[0][6]
    for decoder in ("greedy", "self-spec", "tree"):
        out, stats = generate(cyclic_model, [prompt], 30, decoder=decoder, eot_id=eot)
        assert out[0] == ref[0][: ref[0].index(eot) + 1], decoder
        assert stats.tokens == len(out[0])

    def decode(ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    stop = f"<{ref[0][3]}><{ref[0][4]}>"
    for decoder in ("greedy", "self-spec", "tree"):
        out, _ = generate(cyclic_model, [prompt, prompt[:2]], 30, decoder=decoder, stop=[stop],
                          decode=decode)
        assert out[0] == ref[0][:5], decoder
        # Stop strings are searched in the new text only, and rows stop on their own.
        assert len(out[1]) == 30 or stop in decode(out[1]), decoder
        out, _ = generate(cyclic_model, [prompt], 7, decoder=decoder)
        assert out[0] == ref[0][:7]


def test_context_window_ends_generation() -> None:
    model = random_model(3, max_seq_len=40)
    prompts = [[1] * 30, [2] * 10]
    ref, _ = generate(model, prompts, 100)
    assert [len(r) for r in ref] == [10, 30]  # prompt + new tokens fill the window
    for decoder in ("self-spec", "tree"):
        assert generate(model, prompts, 100, decoder=decoder)[0] == ref


# --------------------------------------------------------------------------------------------
# Errors


def test_bad_input_gives_clear_errors() -> None:
    model = random_model()
    single = random_model(n_future=1)
    with pytest.raises(ValueError, match="single head"):
        generate(single, [[1, 2]], 4, decoder="self-spec")
    with pytest.raises(ValueError, match="single head"):
        generate(single, [[1, 2]], 4, decoder="tree")
    with pytest.raises(ValueError, match="context length"):
        generate(model, [[1] * 128], 4)
    with pytest.raises(ValueError, match=r"heads must lie in \[1, 4\]"):
        generate(model, [[1, 2]], 4, decoder="self-spec", heads=5)
    with pytest.raises(ValueError, match="unknown decoder 'beam'"):
        generate(model, [[1, 2]], 4, decoder="beam")
    with pytest.raises(ValueError, match="needs draft_model"):
        generate(model, [[1, 2]], 4, decoder="draft")
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[1, 2]], 4, decoder="sample", top_p=1.5)
    with pytest.raises(ValueError, match="decode"):
        generate(model, [[1, 2]], 4, stop=["x"])


# --------------------------------------------------------------------------------------------
# The batched draft heads


@pytest.mark.parametrize(
    "overrides", [{}, {"n_attn_kv_heads": 1, "n_attn_heads": 4}, {"head_type": "linear"},
                  {"head_type": "medusa1"}]
)
def test_batched_draft_heads_match_the_model(overrides) -> None:
    """Heads 2..h run as one batched block compute `model.head_norm` of `model.head_output`, and
    write the same keys and values into their cache layers."""
    model = random_model(4, **overrides)
    if model.cfg.head_type == "medusa1":  # away from their zero start, so that the heads differ
        with torch.no_grad():
            for p in model.heads.parameters():
                p.normal_(0, 0.1)
    tokens = torch.tensor(random_prompts(3, model.cfg.vocab_size, seed=14, lo=9, hi=10))  # (3, 9)
    mask = engine.chain_mask(torch.zeros(3, dtype=torch.long), 9)
    slots = torch.arange(9).expand(3, -1)
    ours, theirs = KVCache(model.cfg, 3, 16), KVCache(model.cfg, 3, 16)
    with torch.no_grad():
        h, rope = model.trunk(tokens, positions=slots, cache=ours, slots=slots, mask=mask)
        batched = stacked.stacked_heads(model, 4)(h, rope, ours, slots, mask)  # (3, B, T, d)
        for i in range(1, 4):
            ref = model.head_norm(model.head_output(i, h, rope, cache=theirs, slots=slots,
                                                    mask=mask))
            torch.testing.assert_close(batched[i - 1], ref, atol=1e-5, rtol=1e-5)
    first = model.cfg.n_trunk_layers + 1
    torch.testing.assert_close(ours.k[first:], theirs.k[first:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.v[first:], theirs.v[first:], atol=1e-5, rtol=1e-5)
    if model.cfg.head_type == "block":
        assert ours.k[first:].abs().sum() > 0


# --------------------------------------------------------------------------------------------
# The loop's measurements: oracle drafts, adaptive speculation, draft markers


def test_oracle_drafts_are_all_accepted(cyclic_model) -> None:
    """Drafting the tokens greedy emits: every draft is accepted, the output is greedy's."""
    prompts = cyclic_prompts(cyclic_model, 6, seed=20)
    ref, _ = generate(cyclic_model, prompts, 30)
    out, stats = generate(cyclic_model, prompts, 30, decoder="oracle", reference=ref, gamma=3)
    assert out == ref
    assert stats.acceptance == [1.0, 1.0, 1.0]
    # Per row: the prefill's token, 7 rounds of 3 drafts + 1, and a last round with no room
    # for drafts.
    assert stats.accepted == [0, 6 + 6, 0, 0, 6 * 7]


@pytest.mark.parametrize(
    ("decoder", "kwargs"),
    [("self-spec", {}), ("tree", {}), ("draft", {"gamma": 3})],
)
def test_adaptive_speculation_keeps_greedy_output(cyclic_model, early_model, decoder, kwargs):
    for model in (cyclic_model, early_model):
        prompts = cyclic_prompts(model, 8, seed=22)
        if decoder == "draft":
            kwargs = {**kwargs, "draft_model": early_model}
        ref, _ = generate(model, prompts, 40)
        out, stats = generate(model, prompts, 40, decoder=decoder, adaptive=True, **kwargs)
        assert out == ref
        alone = [generate(model, [p], 40, decoder=decoder, adaptive=True, **kwargs)[0][0]
                 for p in prompts[:3]]
        assert alone == ref[:3]
        # Every round after the prefill is counted under the number of drafts it verified.
        assert sum(stats.drafts_chosen) == stats.forwards - 1


def test_adaptive_policy_drafts_only_what_pays() -> None:
    """The decision rule on given costs and acceptance: long chains when drafts are accepted and
    forwards cost little more per token, none when drafts are rejected or every token costs."""
    from types import SimpleNamespace

    from mtp.decoding.policy import Adaptive
    from mtp.decoding.stats import DecodeStats

    def choice(rate: float, cost: dict[int, float], batch: int) -> int:
        stats = DecodeStats(offered=[1000] * 3, taken=[int(1000 * rate)] * 3)
        ctx = SimpleNamespace(stats=stats, rows=list(range(batch)), room=lambda most: most)
        policy = Adaptive(probe_every=10**9)
        policy.cost = {(batch, n): c for n, c in cost.items()}
        return policy.choose(ctx, 3)

    flat = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}  # overhead-bound: a forward's tokens cost little
    linear = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}  # compute-bound: each token costs a forward
    assert choice(0.9, flat, 1) == 3
    assert choice(0.02, flat, 1) == 0
    assert choice(0.4, {0: 1.0, 1: 1.1, 2: 1.5, 3: 2.0}, 1) == 1
    assert choice(0.9, linear, 16) == 0


def test_adaptive_policy_scales_costs_to_a_new_batch_size() -> None:
    """When rows leave the batch, costs the new batch size has not measured are scaled from the
    nearest one by the ratio of a choice both measured, so the new size explores nothing."""
    from mtp.decoding.policy import Adaptive

    policy = Adaptive()
    policy.cost = {(8, 0): 10.0, (8, 1): 15.0, (8, 2): 20.0, (7, 0): 9.0}
    assert policy.estimate(7, 2) == pytest.approx(9.0 * 20.0 / 10.0)
    assert policy.estimate(7, 1) == pytest.approx(9.0 * 15.0 / 10.0)
    assert policy.estimate(3, 1) is None  # nothing measured at 3 to scale from


def test_adaptive_policy_carries_acceptance_across_calls(cyclic_model) -> None:
    """One policy over many calls judges from all of them, and the output stays greedy's."""
    from mtp.decoding.policy import Adaptive

    policy = Adaptive()
    prompts = cyclic_prompts(cyclic_model, 4, seed=23)
    for p in prompts:
        ref, _ = generate(cyclic_model, [p], 24)
        out, stats = generate(cyclic_model, [p], 24, decoder="self-spec", adaptive=policy)
        assert out == ref
    assert sum(policy.offered) > sum(stats.offered) and policy.cost
