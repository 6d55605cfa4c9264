"""Simulated acceptance (`mtp.loss.simulated_acceptance`), logged at validation (checked in
test_training's end-to-end fit): the chance that a chain of drafts is accepted under teacher
forcing, against all heads' full logits."""

from __future__ import annotations

import pytest
import torch

from mtp.config import ModelConfig
from mtp.decoding import generate
from mtp.loss import simulated_acceptance
from mtp.model import MTPTransformer


def _reference(model: MTPTransformer, window: torch.Tensor) -> list[float]:
    """From forward()'s logits (K, B, S, V) of window[:, :-1]: head 1's argmax as the greedy
    tokens, each head's argmax as its draft, the chain accepted while every draft matches."""
    K = model.cfg.n_future
    T = window.shape[1] - K
    logits = model(window[:, :-1])
    greedy = logits[0].argmax(-1)  # (B, S): greedy[:, s] is the token after s
    ok = torch.ones(window.shape[0], T, dtype=torch.bool)
    out = []
    for i in range(1, K):
        ok &= logits[i, :, :T].argmax(-1) == greedy[:, i:i + T]
        out.append(ok.float().mean().item())
    return out


@pytest.mark.parametrize("head_type, draft_vocab", [("block", 0), ("medusa", 0), ("linear", 40)])
def test_parallel_heads_match_the_full_logits(head_type, draft_vocab):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=4, n_future=4,
                      max_seq_len=64, head_type=head_type, draft_vocab=draft_vocab)
    model = MTPTransformer(cfg).eval()
    for head in model.heads[1:]:  # copies of head 1: where greedy repeats a token they agree
        head.load_state_dict(model.heads[0].state_dict())
    if draft_vocab:
        model.draft_ids.copy_(torch.randperm(97)[:draft_vocab].sort().values)
    prompts = [[3, 1, 4], [2, 7, 1], [8, 2, 8]]
    cont, _ = generate(model, prompts, 20, decoder="greedy")
    window = torch.tensor([p + c for p, c in zip(prompts, cont)])
    with torch.no_grad():
        got = simulated_acceptance(model, window, chunk=7).tolist()
        want = _reference(model, window)
    assert got == pytest.approx(want, abs=1e-6)
    assert got == sorted(got, reverse=True)  # a chain only shortens
    if head_type == "block":  # here the greedy text loops on one token: drafts are accepted
        assert got[0] > 0


def test_chained_heads_read_the_greedy_tokens():
    """On the model's own greedy text, teacher forcing with the data is teacher forcing with
    the greedy tokens, so forward()'s logits are the reference for chained heads too."""
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=4, n_future=3,
                      max_seq_len=64, head_type="deepseek")
    model = MTPTransformer(cfg).eval()
    cont, _ = generate(model, [[5, 6, 7]], 24, decoder="greedy")
    window = torch.tensor([cont[0]])  # greedy text from its first token on
    with torch.no_grad():
        got = simulated_acceptance(model, window).tolist()
        want = _reference(model, window)
    assert got == pytest.approx(want, abs=1e-6) and len(got) == 2

