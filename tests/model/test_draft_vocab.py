"""`--model.draft_vocab N`: heads 2..K predict over the N most frequent training tokens.

The loss of a head with a draft vocabulary is the cross-entropy over those N classes (targets
outside it ignored), the same in the naive and sequential passes; drafting picks only from it;
head 1 verifies over the whole vocabulary, so greedy speculation still equals greedy and
speculative sampling keeps the distribution of plain sampling."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from decoding_helpers import (
    N_NEW,
    N_SAMPLES,
    SAMPLING,
    V_TINY,
    cell,
    chi2_pvalue,
    random_model,
    random_prompts,
    tiny_model,
    train_cyclic,
)

from mtp.config import ModelConfig
from mtp.decoding.generation import generate
from mtp.decoding.tree import Tree
from mtp.model.transformer import MTPTransformer
from mtp.train.loss import mtp_loss, naive_mtp_loss, sequential_mtp_loss
from mtp.train.targets import IGNORE_INDEX, mtp_inputs_targets
from mtp.util.errors import ConfigError

torch.set_num_threads(1)


def _model(head_type: str, K: int = 3, V: int = 61, n: int = 17) -> MTPTransformer:
    torch.manual_seed(0)
    model = MTPTransformer(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_attn_heads=2,
                                       n_future=K, max_seq_len=64, head_type=head_type,
                                       draft_vocab=n))
    model.draft_ids.copy_(torch.randperm(V)[:n])  # not a prefix of the ids, not sorted
    return model


@pytest.mark.parametrize("head_type", ["block", "medusa", "medusa1", "deepseek"])
def test_losses_and_gradients_over_the_draft_vocabulary(head_type):
    model = _model(head_type)
    V, ids = model.cfg.vocab_size, model.draft_ids
    window = torch.randint(0, V, (3, 20 + 3))
    window[:, ::2] = ids[torch.randint(0, len(ids), window[:, ::2].shape)]  # half in the vocab
    inputs, targets = mtp_inputs_targets(window, 3)
    targets = targets.clone()
    targets[1, 0, :4] = IGNORE_INDEX
    naive = naive_mtp_loss(model, inputs, targets)
    # An independent reference: the full logits' columns of the draft vocabulary, targets
    # as indices into it, those outside it dropped.
    with torch.no_grad():
        full = torch.stack([model.unembed(z) for z in model.head_states(
            *model.trunk(inputs), targets)])  # (K, B, T, V)
    for i in range(3):
        t = targets[i].flatten()
        logits = full[i].flatten(0, 1)
        if i:
            where = (t[:, None] == ids).float()  # (N, Vd)
            keep = where.any(1)
            logits, t = logits[keep][:, ids], where[keep].argmax(1)
        else:
            logits, t = logits[t != IGNORE_INDEX], t[t != IGNORE_INDEX]
        want = F.cross_entropy(logits.double(), t)
        torch.testing.assert_close(naive.head_losses[i].double(), want, rtol=1e-5, atol=0)
    seq = sequential_mtp_loss(model, inputs, targets)
    torch.testing.assert_close(seq.head_losses, naive.head_losses, rtol=1e-6, atol=0)
    metrics = mtp_loss(model, inputs, targets, path="metrics")
    torch.testing.assert_close(metrics.head_losses, naive.head_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(metrics.head_accuracies, naive.head_accuracies)

    def grads(fn):
        model.zero_grad()
        fn(model, inputs, targets).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want, got = grads(naive_mtp_loss), grads(sequential_mtp_loss)
    for name in want:
        err = (got[name] - want[name]).norm() / want[name].norm().clamp(min=1e-30)
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    # heads 2..K reach only the draft rows of the unembedding; head 1 every row
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert want["unembed.weight"][outside].abs().sum() > 0
    model.zero_grad()
    sequential_mtp_loss(model, inputs, targets, [0.0, 1.0, 1.0]).loss.backward()
    assert model.unembed.weight.grad[outside].abs().max() == 0
    assert model.unembed.weight.grad[ids].abs().max() > 0


@pytest.mark.parametrize("head_type", ["block", "medusa1", "deepseek", "eagle"])
@pytest.mark.parametrize(("decoder", "kwargs"), [("self-spec", {}), ("tree", {}),
                                                 ("tree", {"tree": Tree.from_widths([3, 2, 1])})])
def test_speculative_greedy_equals_greedy_with_a_draft_vocabulary(head_type, decoder, kwargs):
    full, _ = train_cyclic(steps=60, head_type=head_type)
    model = random_model(1, head_type=head_type, draft_vocab=64)
    model.load_state_dict(full.state_dict() | {"draft_ids": torch.arange(64) * 4}, strict=True)
    cycle = set(full.cycle)
    assert 0 < len(cycle & set(model.draft_ids.tolist())) < len(cycle)  # some cycle tokens left out
    prompts = [p + full.cycle[i % 11:] for i, p in enumerate(random_prompts(8, 256, seed=5,
                                                                            hi=8))]
    want, _ = generate(model, prompts, 24, decoder="greedy")
    got, stats = generate(model, prompts, 24, decoder=decoder, **kwargs)
    assert got == want
    assert stats.tokens_per_forward > 1.2  # the drafts of the cycle's in-vocabulary tokens land
    drafted = set(model(torch.tensor([prompts[0]]))[1:].argmax(-1).flatten().tolist())
    assert drafted <= set(model.draft_ids.tolist())


@pytest.mark.parametrize("draft_vocab", [17, None])
def test_drafts_over_the_draft_vocabulary_are_those_of_the_whole_logits(draft_vocab):
    """`DraftVocab` ranks the draft vocabulary's columns alone; the reference is the logits over
    the whole vocabulary, -inf outside it (`draft_logits`), softmaxed and ranked there."""
    from mtp.decoding.drafters import DraftVocab

    model = _model("block") if draft_vocab else random_model(3, head_type="block")
    vocab = DraftVocab(model)
    z = model.head_norm(torch.randn(2, 5, model.cfg.d_model))
    with torch.no_grad():
        logits = model.draft_logits(z)  # (2, 5, V)
        ref_probs, ref_ids = logits.float().softmax(-1).topk(4, dim=-1)
        probs, ids = vocab.top_chances(z, 4)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(probs, ref_probs)
        assert torch.equal(vocab.top(z, 4), ref_ids)
        assert torch.equal(vocab.argmax(z), logits.argmax(-1))
        assert torch.equal(vocab.logits(z), logits)
    if draft_vocab:
        assert set(ids.flatten().tolist()) <= set(model.draft_ids.tolist())


def test_speculative_sampling_with_a_draft_vocabulary_is_exact():
    model, prompt, joint = tiny_model(draft_vocab=V_TINY - 1)
    model.draft_ids.copy_(torch.tensor([3, 0, 2]))  # token 1 is never drafted
    out, stats = generate(model, [prompt] * N_SAMPLES, N_NEW, decoder="self-spec",
                          generator=torch.Generator().manual_seed(13), **SAMPLING)
    counts = torch.bincount(cell(out), minlength=V_TINY**N_NEW)
    assert chi2_pvalue(counts, joint) > 1e-3
    assert stats.tokens_per_forward > 1.1
    assert any(1 in row for row in out)  # head 1 still emits the token no head drafts


@pytest.mark.parametrize("head_type", ["block", "deepseek", "eagle"])
def test_draft_logits_under_bf16_autocast(head_type):
    """Under bf16 autocast heads 2..K give logits in the product's dtype, as head 1 does: the
    fp32 forward's over the draft vocabulary (to bf16's precision), -inf elsewhere."""
    model = _model(head_type)
    x = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        ref = model(x, heads=3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, heads=3)
    assert out.dtype == torch.bfloat16
    outside = torch.ones(model.cfg.vocab_size, dtype=torch.bool)
    outside[model.draft_ids] = False
    assert torch.isneginf(out[1:, ..., outside]).all()
    ids = model.draft_ids
    torch.testing.assert_close(out[1:, ..., ids].float(), ref[1:, ..., ids], atol=0.05, rtol=0.05)
    torch.testing.assert_close(out[0].float(), ref[0], atol=0.05, rtol=0.05)

def test_fit_takes_the_most_frequent_training_tokens(tiny_corpus, tmp_path, monkeypatch):
    from mtp.cli import main
    from mtp.model.checkpoint import load_checkpoint

    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(REPO / "configs/debug.yaml"),
                 "--model.draft_vocab", "50", "--trainer.max_steps", "2",
                 "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
                 "--data.source", str(tiny_corpus), "--data.cache_dir", str(tmp_path / "cache"),
                 "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]) == 0
    model, _ = load_checkpoint(next((tmp_path / "runs").rglob("last.ckpt")))
    (meta_file,) = (tmp_path / "cache").rglob("meta.json")
    dtype = json.loads(meta_file.read_text())["dtype"]
    train = np.fromfile(meta_file.parent / "train.bin", dtype=dtype)
    ids, counts = np.unique(train, return_counts=True)
    top = ids[np.lexsort((ids, -counts))][:50]  # by count, ties by id
    assert model.draft_ids.tolist() == top.tolist()


def test_bad_draft_vocabularies_name_the_flag():
    with pytest.raises(ConfigError, match=r"--model.draft_vocab must be in \[0, "
                                          r"--model.vocab_size = 300\] \(got 301\)"):
        ModelConfig(vocab_size=300, draft_vocab=301)
    with pytest.raises(ConfigError, match="--model.draft_vocab applies to heads 2..K, but "
                                          "--model.n_future is 1"):
        ModelConfig(n_future=1, draft_vocab=10)
