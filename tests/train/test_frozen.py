"""Frozen-trunk training (`mtp.train.frozen_trunk`): the same gradients as the sequential path
with head 1's weight at zero, from trunk outputs computed once and kept."""

from __future__ import annotations

import functools

import pytest
import torch

from mtp.config import ModelConfig
from mtp.model.transformer import MTPTransformer
from mtp.train.frozen_trunk import FrozenTrunk
from mtp.train.loss import heads_loss, naive_mtp_loss, sequential_mtp_loss
from mtp.train.targets import IGNORE_INDEX, mtp_inputs_targets, self_targets


def _frozen_model(head_type: str, **kw) -> MTPTransformer:
    """A model whose heads 2..K alone train; `eagle-features` is eagle with
    `--model.feature_layers [1]`, its fusing map away from its start."""
    torch.manual_seed(0)
    if head_type == "eagle-features":
        head_type, kw = "eagle", {**kw, "feature_layers": [1]}
    model = MTPTransformer(ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_attn_heads=2,
                                       n_future=3, max_seq_len=64, head_type=head_type, **kw))
    if model.cfg.feature_layers:
        with torch.no_grad():
            model.heads[1].fuse.weight.normal_(0, 0.2)
    new = {id(p) for head in model.heads[1:] for p in head.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in new)
    return model


def _head_grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("head_type", ["block", "medusa", "medusa1", "deepseek", "eagle",
                                       "eagle-features"])
@pytest.mark.parametrize("targets", ["data", "self", "greedy"])
@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_the_frozen_trunk_path_equals_the_sequential_path(head_type, targets, draft_vocab):
    model = _frozen_model(head_type, draft_vocab=draft_vocab)
    window = torch.randint(0, 97, (4, 21 + 3))
    inputs, data_targets = mtp_inputs_targets(window, 3)
    want_targets = data_targets if targets == "data" else self_targets(
        model, window, on_greedy_path=targets == "greedy")
    weights = [0.0, 1.0, 0.5]
    # eagle's unrolled steps train by the naive path (the sequential one refuses them)
    reference = naive_mtp_loss if head_type.startswith("eagle") else functools.partial(
        sequential_mtp_loss, with_accuracy=True)
    want = reference(model, inputs, want_targets, weights)
    want_grads = _head_grads(model, want.loss)

    cache = FrozenTrunk(model, targets=targets, max_bytes=1 << 30)
    h, rope, got_targets = cache(window)
    assert torch.equal(got_targets, want_targets)
    got = heads_loss(model, h, rope, got_targets, weights, path="frozen_trunk",
                     with_accuracy=True)
    assert got.first == 1 and got.head_losses.shape == (2,)
    torch.testing.assert_close(got.head_losses, want.head_losses[1:], rtol=1e-5, atol=0)
    torch.testing.assert_close(got.head_accuracies, want.head_accuracies[1:])
    got_grads = _head_grads(model, got.loss)
    assert got_grads.keys() == want_grads.keys() and all(n.startswith("heads.") for n in got_grads)
    for name, g in want_grads.items():
        err = (got_grads[name] - g).norm() / g.norm().clamp(min=1e-30)
        assert err < 1e-5, f"{name}: {err:.2e}"


def test_the_cache_computes_each_window_once_within_its_budget(monkeypatch):
    model = _frozen_model("block")
    windows = torch.randint(0, 97, (6, 16 + 3))
    calls = []
    cache = FrozenTrunk(model, targets="self", max_bytes=1 << 30)
    compute = cache._compute
    monkeypatch.setattr(cache, "_compute", lambda w: calls.append(len(w)) or compute(w))
    first = cache(windows[:4])
    again = cache(windows[[3, 4, 1, 5]])  # two kept, two new
    assert calls == [4, 2] and (cache.hits, cache.misses) == (2, 6)
    (h1, _, t1), (h2, _, t2) = first, again
    assert torch.equal(h2[0], h1[3]) and torch.equal(t2[:, 0], t1[:, 3])  # kept entries
    assert torch.equal(h2[2], h1[1]) and torch.equal(t2[:, 2], t1[:, 1])
    fresh = FrozenTrunk(model, targets="self", max_bytes=0)._compute(windows[[4, 5]])
    assert torch.equal(h2[[1, 3]], fresh[0]) and torch.equal(t2[:, [1, 3]], fresh[1])
    per_window = cache.store.bytes // 6
    small = FrozenTrunk(model, targets="self", max_bytes=2 * per_window)
    small(windows)
    assert len(small.store.entries) == 2 and small.store.bytes <= 2 * per_window


def test_greedy_targets_are_the_greedy_continuation_where_the_data_follow_it():
    """`--loss.targets greedy` against greedy decoding itself: where the data's next tokens are
    the model's greedy ones, head i's target is token i of the greedy continuation; elsewhere
    ignored. The model is trained a little on a repeating text, so the data follow it often."""
    from decoding_helpers import train_cyclic

    from mtp.decoding.generation import generate
    from mtp.train.targets import IGNORE_INDEX

    model, _ = train_cyclic(steps=40)
    K, T = model.cfg.n_future, 14
    cycle = torch.tensor(model.cycle)
    window = cycle[torch.arange(T + K) % 11][None].clone()
    window[0, 6] = (window[0, 6] + 1) % 256  # a token off the greedy path
    targets = self_targets(model, window, on_greedy_path=True)  # (K, 1, T)
    on, off = 0, 0
    for t in range(T):
        chain, _ = generate(model, [window[0, :t + 1].tolist()], K, decoder="greedy")
        for i in range(K):
            follows = window[0, t + 1:t + 1 + i].tolist() == chain[0][:i]
            want = chain[0][i] if follows else IGNORE_INDEX
            assert targets[i, 0, t] == want, (t, i)
            on, off = on + (follows and i > 0), off + (not follows)
    assert on > 10 and off > 3  # both cases occur


@pytest.mark.parametrize("head_type", ["block", "eagle-features"])
def test_features_kept_on_disk_equal_recomputed_ones(tmp_path, monkeypatch, head_type):
    """`--optim.trunk_cache_dir`: a later run of the same frozen model reads every window back
    from disk without running the trunk, and what it reads is the trunk's output (with
    `--model.feature_layers`, every listed block's) rounded to half precision, the targets
    exactly."""
    model = _frozen_model(head_type)
    windows = torch.randint(0, 97, (5, 16 + 3))
    first = FrozenTrunk(model, targets="greedy", max_bytes=0, folder=tmp_path)
    h1, _, t1 = first(windows)
    first.store.close()
    later = FrozenTrunk(model, targets="greedy", max_bytes=0, folder=tmp_path)
    monkeypatch.setattr(later, "_compute", lambda w: pytest.fail("the trunk ran again"))
    h2, _, t2 = later(windows[[4, 0, 2]])
    assert (later.hits, later.misses) == (3, 0)
    fresh_h, fresh_t = FrozenTrunk(model, targets="greedy", max_bytes=0)._compute(windows)
    assert torch.equal(h2, fresh_h[[4, 0, 2]].half().float())
    assert torch.equal(t2, fresh_t[:, [4, 0, 2]])
    assert torch.equal(h2, h1[[4, 0, 2]])  # the first run trained on the same rounded features
    assert h2.shape[-1] == model.trunk_width


def test_the_disk_store_is_per_model_and_survives_a_torn_row(tmp_path):
    model = _frozen_model("block")
    windows = torch.randint(0, 97, (3, 16 + 3))
    cache = FrozenTrunk(model, targets="data", max_bytes=0, folder=tmp_path)
    cache(windows)
    cache.store.close()
    folder = cache.store.folder
    # a run killed while writing a row: features of a fourth row, its key never written
    with open(folder / "features.f16", "ab") as f:
        f.write(b"\0" * 100)
    again = FrozenTrunk(model, targets="data", max_bytes=0, folder=tmp_path)
    again(windows)
    assert (again.hits, again.misses) == (3, 0)
    assert (folder / "features.f16").stat().st_size == 3 * 16 * 32 * 2
    # another model (or other targets) has a folder of its own
    other = _frozen_model("medusa")
    elsewhere = FrozenTrunk(other, targets="data", max_bytes=0, folder=tmp_path)
    elsewhere(windows)
    assert elsewhere.misses == 3 and elsewhere.store.folder != folder
    data_vs_self = FrozenTrunk(model, targets="self", max_bytes=0, folder=tmp_path)
    data_vs_self(windows)
    assert data_vs_self.misses == 3


@pytest.mark.parametrize("head_type", ["block", "eagle"])
@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_soft_targets_are_the_frozen_models_own_distributions(head_type, draft_vocab):
    """The `frozen_trunk_soft` loss and gradients against a reference from the model's plain
    forward: head i at t against head 1's distribution at t + i, both over the draft vocabulary,
    where the hard target is scored."""
    model = _frozen_model(head_type, draft_vocab=draft_vocab)
    if draft_vocab:
        model.draft_ids.copy_(torch.randperm(97)[:draft_vocab])
    ids = model.draft_ids if draft_vocab else torch.arange(97)
    window = torch.randint(0, 97, (3, 16 + 3))
    inputs, targets = mtp_inputs_targets(window, 3)
    targets = targets.clone()
    targets[2, 1, :5] = IGNORE_INDEX
    weights = [0.0, 1.0, 0.5]

    def reference():
        logits = model(inputs)[..., ids]  # (K, B, T, Vd): teacher-forced, as training reads
        p = logits[0].detach().softmax(-1)
        losses = []
        for i in (1, 2):
            log_q = logits[i, :, :-i].log_softmax(-1)
            valid = targets[i][:, :-i] != IGNORE_INDEX
            losses.append((-(p[:, i:] * log_q).sum(-1) * valid).sum() / valid.sum())
        return torch.stack(losses)

    want = reference()
    want_grads = _head_grads(model, (torch.tensor(weights[1:]) * want).sum())
    h, rope, _ = FrozenTrunk(model, targets="data", max_bytes=0)(window)
    got = heads_loss(model, h, rope, targets, weights, path="frozen_trunk_soft")
    torch.testing.assert_close(got.head_losses, want.detach(), rtol=1e-5, atol=0)
    got_grads = _head_grads(model, got.loss)
    for name, g in want_grads.items():
        err = (got_grads[name] - g).norm() / g.norm().clamp(min=1e-30)
        assert err < 1e-5, f"{name}: {err:.2e}"
