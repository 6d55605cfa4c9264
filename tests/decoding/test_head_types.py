"""Every decoder with every head type, and the cascaded drafters (deepseek's modules, eagle's
unrolled layer) against the model's own teacher-forced forward. Block heads are covered the same
way in tests/decoding/test_decoding.py."""

from __future__ import annotations

import functools
from collections import Counter

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
from torch import nn

from mtp.decoding import arithmetic, cascaded, eagle
from mtp.decoding.generation import generate
from mtp.decoding.tree import DynamicTree, Tree

torch.set_num_threads(1)

OTHER_TYPES = ["linear", "medusa", "medusa1", "deepseek", "eagle"]
DRAFTERS = {"deepseek": cascaded.CascadedHeads, "eagle": eagle.EagleHeads}
DECODERS = [
    ("self-spec", {}),
    ("tree", {}),
    ("self-spec", {"heads": 3, "adaptive": True}),
    ("tree", {"heads": 3, "tree": Tree.from_widths([3, 2])}),
]


@functools.cache
def _trained(head_type: str):
    """(full, early) models of one head type trained on the cyclic stream. Cascaded heads learn
    the cycle within a few steps, so their early snapshot is taken sooner."""
    return train_cyclic(steps=120, snapshot=2 if head_type in DRAFTERS else 9,
                        head_type=head_type)


@pytest.fixture(params=OTHER_TYPES)
def trained(request):
    return _trained(request.param)


@pytest.fixture(params=list(DRAFTERS))
def cascaded_trained(request):
    return _trained(request.param)


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("head_type", OTHER_TYPES)
@pytest.mark.parametrize(("decoder", "kwargs"), DECODERS[:2])
def test_speculative_greedy_equals_greedy_random_model(head_type, K, decoder, kwargs):
    model = random_model(head_type=head_type, n_future=K)
    prompts = random_prompts(12, model.cfg.vocab_size, seed=3)
    ref, _ = generate(model, prompts, 32)
    out, _ = generate(model, prompts, 32, decoder=decoder, **kwargs)
    assert out == ref


@pytest.mark.parametrize(("decoder", "kwargs"), DECODERS)
def test_speculative_greedy_equals_greedy_with_acceptance(trained, decoder, kwargs):
    rejected, per_forward = 0, []
    for model in trained:
        prompts = cyclic_prompts(model, 12, seed=4)
        ref, _ = generate(model, prompts, 32)
        out, stats = generate(model, prompts, 32, decoder=decoder, **kwargs)
        assert out == ref, model.cfg.head_type
        rejected += stats.accepted[1] - len(prompts)  # rounds (besides prefills) of one token
        per_forward.append(stats.tokens_per_forward)
    if not kwargs.get("adaptive"):  # an adaptive round drafts only what it measures to pay
        # drafts were accepted (by the trained model, mostly) and rejected (by the early one)
        assert per_forward[0] > 1.3 and rejected > 0, per_forward


def test_batched_decoding_equals_each_row_alone(cascaded_trained, monkeypatch):
    """Prompts of 1 to 76 tokens prefilled in a forward per length, rows ending at different
    rounds (`test_decoding.test_batched_greedy_equals_each_row_alone` for parallel heads, and
    prefills of one forward): each row decodes what it decodes alone, with the drafters that
    keep a state per row (DeepSeek's modules' cells, eagle's root)."""
    from mtp.decoding import engine
    from mtp.decoding.tree import DynamicTree

    monkeypatch.setattr(engine, "GROUP_COST", 0)
    model = cascaded_trained[0]
    prompts = spread_prompts(model, 6, seed=7)
    eot = model.cycle[4]
    for decoder, kwargs in [("self-spec", {}), ("tree", {"tree": DynamicTree(max_nodes=8)})]:
        batched, _ = generate(model, prompts, 24, decoder=decoder, eot_id=eot, **kwargs)
        alone = [generate(model, [p], 24, decoder=decoder, eot_id=eot, **kwargs)[0][0]
                 for p in prompts]
        assert batched == alone, decoder
        assert len({len(o) for o in batched}) > 2  # rows ended at different rounds


def test_draft_model_decoding_with_a_chained_target_and_draft(trained):
    full, early = trained
    prompts = cyclic_prompts(full, 8, seed=5)
    ref, _ = generate(full, prompts, 32)
    out, stats = generate(full, prompts, 32, decoder="draft", draft_model=early, gamma=3)
    assert out == ref and stats.draft_forwards > 0


@pytest.mark.parametrize(("decoder", "kwargs"), [("self-spec", {}),
                                                 ("tree", {"tree": Tree.from_widths([2, 1, 1])})])
@pytest.mark.parametrize("head_type", list(DRAFTERS))
def test_cascaded_speculative_sampling_is_exact(decoder, kwargs, head_type):
    model, prompt, joint = tiny_model(head_type=head_type)
    out, stats = generate(model, [prompt] * N_SAMPLES, N_NEW, decoder=decoder,
                          generator=torch.Generator().manual_seed(13), **SAMPLING, **kwargs)
    counts = torch.bincount(cell(out), minlength=V_TINY**N_NEW)
    assert chi2_pvalue(counts, joint) > 1e-3
    assert stats.accepted[1] > N_SAMPLES and stats.accepted[-1] > 0


def _teacher_forced(model, seq: list[int], head: int) -> torch.Tensor:
    """Logits of head `head` (0-based) at the position before seq's last `head` tokens: the
    model's plain forward, teacher-forced on seq (no cache, no drafter); eagle's layer is
    unrolled as far as `head` asks, past K too."""
    logits = model(torch.tensor([seq]), heads=max(head + 1, model.cfg.n_future))  # (h, 1, T, V)
    return logits[head, 0, len(seq) - 1 - head]


@pytest.mark.parametrize("tree", ["2,2,1", "dynamic"])
def test_cascaded_drafts_condition_on_their_own_drafts(cascaded_trained, monkeypatch, tree):
    """Every node of every round's tree, fixed or grown where the heads are sure, is the right
    rank of the model's own distribution at that depth given the node's path. In the fixed
    tree, siblings at depth 2 hold different tokens, and their depth-3 children differ: the
    depth-3 proposal follows the depth-2 draft."""
    from mtp.decoding.tree import DynamicTree

    full, early = cascaded_trained
    fixed = tree != "dynamic"
    tree = Tree.from_widths([2, 2, 1]) if fixed else DynamicTree(max_nodes=12, top=3)
    # a verify forward costs the same over any number of tokens: every full round's tree has
    # 12 nodes, whatever this machine's timings (measured, they make the trees' size vary by run)
    monkeypatch.setattr("mtp.decoding.cost.verify_seconds",
                        lambda model, batch, most, **kw: [1.0] * most)
    seen, children_differ = 0, 0
    proposals = []
    drafter = DRAFTERS[full.cfg.head_type]
    propose = drafter.propose

    def recording(self, ctx, pending, n):
        prop = propose(self, ctx, pending, n)
        seqs = [list(prompts[r]) + ctx.stopper.out[r] for r in ctx.rows]  # ends with pending
        proposals.append((seqs, prop))
        return prop

    monkeypatch.setattr(drafter, "propose", recording)
    for model in (early, full):
        prompts = cyclic_prompts(model, 4, seed=7)
        proposals.clear()
        generate(model, prompts, 24, decoder="tree", tree=tree)
        for seqs, prop in proposals:
            if prop.n == 0:
                continue
            tt = prop.tree
            for b, seq in enumerate(seqs):
                assert prop.tokens[b, 0] == seq[-1]
                for m in range(1, len(tt.depth)):
                    path = [int(prop.tokens[b, a]) for a in tt.path[m].unique_consecutive()]
                    # node m at depth l holds rank r of head l + 1 given the path above it
                    level, rank = int(tt.depth[m]), int(tt.rank[m])
                    ref = _teacher_forced(model, seq + path[1:-1], level)
                    best = ref.sort(descending=True).values
                    assert abs(ref[path[-1]] - best[rank]) < 1e-4, (b, m)
                    seen += 1
                # the depth-3 nodes under the two depth-2 siblings of the first branch
                kids = [int(prop.tokens[b, m]) for m in range(len(tt.depth))
                        if int(tt.depth[m]) == 3 and int(tt.path[m][1]) == 1]
                children_differ += len(kids) == 2 and kids[0] != kids[1]
    assert seen > 100 and (children_differ > 0 or not fixed)


def test_cascaded_chain_drafts_are_the_teacher_forced_chain(cascaded_trained, monkeypatch):
    """A chain's drafts d1, d2, ...: d_i is head i + 1's argmax given pending, d1 .. d_(i-1),
    in rounds after accepted and rejected drafts and with rows of different lengths."""
    full, early = cascaded_trained
    checked = []
    for model in (early, full):
        prompts = cyclic_prompts(model, 6, seed=8) + [[3]]  # a prompt shorter than the chain
        ref, _ = generate(model, prompts, 24)
        with monkeypatch.context() as m:
            _check_chain_drafts(m, DRAFTERS[full.cfg.head_type], model, prompts, checked)
            out, _ = generate(model, prompts, 24, decoder="self-spec")
        assert out == ref
    assert len(checked) > 100


def _check_chain_drafts(monkeypatch, drafter, model, prompts, checked: list) -> None:
    """Make `drafter.propose` assert that each chain draft d_i is head i + 1's teacher-forced
    argmax given the row's text and d1 .. d_(i-1), appending to `checked` per draft."""
    propose = drafter.propose

    def checking(self, ctx, pending, n):
        prop = propose(self, ctx, pending, n)
        for b, r in enumerate(ctx.rows):
            seq = list(prompts[r]) + ctx.stopper.out[r]
            drafts = prop.tokens[b, 1:].tolist()
            for i, d in enumerate(drafts, start=1):
                ref = _teacher_forced(model, seq + drafts[: i - 1], i)
                assert ref[d] >= ref.max() - 1e-4
                checked.append(d)
        return prop

    monkeypatch.setattr(drafter, "propose", checking)


def test_eagle_drafts_past_the_steps_it_was_trained_over(monkeypatch):
    """Eagle's one layer drafts h - 1 >= K steps when asked (`UNROLLED_MAX_HEADS`): each chain
    draft d_i is the argmax of the layer unrolled i steps, teacher-forced on the text and
    d1 .. d_(i-1), as the plain forward computes it; every decoder's output equals greedy's."""
    from mtp.decoding.names import UNROLLED_MAX_HEADS
    from mtp.decoding.request import RequestError
    from mtp.decoding.tree import DynamicTree

    full, _ = _trained("eagle")
    k = full.cfg.n_future
    prompts = cyclic_prompts(full, 6, seed=8) + [[3]]
    ref, _ = generate(full, prompts, 24)
    checked = []
    with monkeypatch.context() as m:
        _check_chain_drafts(m, eagle.EagleHeads, full, prompts, checked)
        out, stats = generate(full, prompts, 24, decoder="self-spec", heads=k + 2)
    assert out == ref
    assert len(stats.acceptance) == k + 1  # depths past K - 1 were drafted and verified
    assert stats.taken[k - 1] > 0 and len(checked) > 100
    for tree in (Tree.from_widths([2, 1, 1, 1, 1]), DynamicTree(max_nodes=12, top=3)):
        assert generate(full, prompts, 24, decoder="tree", heads=k + 2, tree=tree)[0] == ref
    assert generate(full, prompts, 24, decoder="self-spec", heads=k + 2, lookup=4)[0] == ref
    with pytest.raises(RequestError, match="heads must lie in"):
        generate(full, prompts, 4, decoder="self-spec", heads=UNROLLED_MAX_HEADS + 1)


def test_eagle_with_feature_layers_drafts_its_teacher_forced_chain(monkeypatch):
    """`--model.feature_layers`: drafting feeds the first step the fused blocks' outputs as the
    plain forward does, so each chain draft is the teacher-forced argmax given the drafts
    before it; every decoder's output equals greedy's."""
    from mtp.decoding.tree import DynamicTree

    model = random_model(head_type="eagle", feature_layers=[1])
    with torch.no_grad():  # away from its start (the last block's output alone)
        model.heads[1].fuse.weight.normal_(0, 0.3)
    prompts = random_prompts(6, model.cfg.vocab_size, seed=9) + [[3]]
    checked = []
    ref, _ = generate(model, prompts, 16)
    with monkeypatch.context() as m:
        _check_chain_drafts(m, eagle.EagleHeads, model, prompts, checked)
        assert generate(model, prompts, 16, decoder="self-spec")[0] == ref
    assert len(checked) > 50
    for kwargs in ({"decoder": "tree", "tree": Tree.from_widths([2, 2, 1])},
                   {"decoder": "tree", "tree": DynamicTree(max_nodes=8, top=3)},
                   {"decoder": "self-spec", "lookup": 4}):
        assert generate(model, prompts, 16, **kwargs)[0] == ref, kwargs


@pytest.fixture
def int8_calls(monkeypatch) -> Counter:
    """Calls of each module's int8 product (`int8_products`) from here on, by module."""
    real, calls = arithmetic._int8_forward, Counter()

    def counted(module):
        forward = real(module)

        def count(x):
            calls[module] += 1
            return forward(x)
        return count

    monkeypatch.setattr(arithmetic, "_int8_forward", counted)
    return calls


def _int8_decode(model, prompts, calls: Counter, decoder: str, kwargs: dict, drafting: set):
    """Decode with `draft_int8`: greedy's output, every module of `drafting` in int8, and
    besides them only the draft vocabulary's rows (a drafter's own layer, where the model has
    one), nothing of the model itself; the statistics."""
    ref, _ = generate(model, prompts, 24)
    calls.clear()
    out, stats = generate(model, prompts, 24, decoder=decoder, draft_int8=True, **kwargs)
    assert out == ref
    rows = set(calls) - drafting
    assert drafting and drafting <= set(calls) and not rows & set(model.modules())
    if model.cfg.draft_vocab:
        assert len(rows) == 1 and torch.equal(rows.pop().weight, model.head_unembed(1))
    else:
        assert not rows
    return stats


@pytest.mark.parametrize(("decoder", "kwargs"), [
    ("self-spec", {}), ("tree", {}), ("tree", {"tree": DynamicTree(max_nodes=8), "lookup": 4})])
def test_eagle_drafting_in_int8_keeps_greedys_output(int8_calls, decoder, kwargs):
    """`draft_int8`: greedy's output, drafts still accepted, and every product of eagle's
    layer and the draft vocabulary in int8 but `fuse` (the trunk's features), nothing else."""
    featured = random_model(head_type="eagle", feature_layers=[1], draft_vocab=64)
    for model in (*_trained("eagle"), featured):
        prompts = random_prompts(6, model.cfg.vocab_size, seed=5) if model is featured else \
            cyclic_prompts(model, 6, seed=5)
        layer = model.heads[1]
        drafting = {m for m in layer.modules() if isinstance(m, nn.Linear) and m is not layer.fuse}
        stats = _int8_decode(model, prompts, int8_calls, decoder, kwargs, drafting)
        assert not any("forward" in vars(m) for m in model.modules())
        if model is _trained("eagle")[0]:
            assert stats.tokens_per_forward > 1.5
    assert featured.heads[1].fuse is not None


@pytest.mark.parametrize("head_type", ["block", "linear", "medusa", "medusa1"])
@pytest.mark.parametrize(("decoder", "kwargs"), [
    ("self-spec", {}), ("tree", {"tree": DynamicTree(max_nodes=8), "lookup": 4})])
def test_parallel_heads_drafting_in_int8_keep_greedys_output(int8_calls, head_type, decoder,
                                                              kwargs):
    """`draft_int8` with parallel heads: greedy's output, drafts still accepted, and in int8
    the stacked heads 2..h and the draft vocabulary's rows, nothing of the model itself (head
    1 and the unembedding verify)."""
    from mtp.decoding.stacked import StackedLinear, stacked_heads

    trained = _trained(head_type)[0]
    for model in (trained, random_model(head_type=head_type, draft_vocab=64)):
        prompts = cyclic_prompts(model, 6, seed=5) if model is trained else \
            random_prompts(6, model.cfg.vocab_size, seed=5)
        stacked = stacked_heads(model, model.cfg.n_future).stacked
        drafting = {m for m in stacked.modules() if isinstance(m, StackedLinear)}
        stats = _int8_decode(model, prompts, int8_calls, decoder, kwargs, drafting)
        assert not any("forward" in vars(m) for m in (*model.modules(), *stacked.modules()))
        if model is trained:
            assert stats.tokens_per_forward > 1.5


@pytest.mark.parametrize(("decoder", "kwargs"), [
    ("self-spec", {}), ("tree", {}), ("tree", {"tree": DynamicTree(max_nodes=8)})])
def test_deepseek_modules_drafting_in_int8_keep_greedys_output(int8_calls, decoder, kwargs):
    """`draft_int8` with DeepSeek's modules: greedy's output, drafts still accepted, and in int8
    every product of modules 2..h and the draft vocabulary's rows, nothing of the trunk or head
    1 (which verify)."""
    trained = _trained("deepseek")[0]
    for model in (trained, random_model(head_type="deepseek", draft_vocab=64)):
        prompts = cyclic_prompts(model, 6, seed=5) if model is trained else \
            random_prompts(6, model.cfg.vocab_size, seed=5)
        drafting = {m for m in model.heads[1:].modules() if isinstance(m, nn.Linear)}
        stats = _int8_decode(model, prompts, int8_calls, decoder, kwargs, drafting)
        assert not any("forward" in vars(m) for m in model.modules())
        if model is trained:
            assert stats.tokens_per_forward > 1.5


def test_draft_int8_is_refused_where_no_head_drafts():
    from mtp.decoding import RequestError

    with pytest.raises(RequestError, match="draft_int8 is how the heads draft with decoder "
                       "self-spec and tree: decoder greedy drafts with no head"):
        generate(_trained("eagle")[0], [[1, 2, 3]], 4, draft_int8=True)
