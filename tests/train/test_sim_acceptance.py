"""Simulated acceptance (`mtp.train.loss.simulated_acceptance`), logged at validation (checked in
test_training's end-to-end fit): the chance that a chain of drafts is accepted under teacher
forcing, against all heads' full logits; and `mtp bench decode`'s count of it over the
positions decoding drafts from, against the rounds decoding runs."""

from __future__ import annotations

import pytest
import torch

from mtp.bench.validation import chain_acceptance
from mtp.config import ModelConfig
from mtp.decoding.generation import generate
from mtp.model.transformer import MTPTransformer
from mtp.train.loss import simulated_acceptance


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
    cfg = ModelConfig(vocab_size=97, d_model=48, n_layers=3, n_attn_heads=4, n_future=4,
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


def test_cascaded_heads_read_the_greedy_tokens():
    """On the model's own greedy text, teacher forcing with the data is teacher forcing with
    the greedy tokens, so forward()'s logits are the reference for cascaded heads too."""
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=97, d_model=48, n_layers=3, n_attn_heads=4, n_future=3,
                      max_seq_len=64, head_type="deepseek")
    model = MTPTransformer(cfg).eval()
    cont, _ = generate(model, [[5, 6, 7]], 24, decoder="greedy")
    window = torch.tensor([cont[0]])  # greedy text from its first token on
    with torch.no_grad():
        got = simulated_acceptance(model, window).tolist()
        want = _reference(model, window)
    assert got == pytest.approx(want, abs=1e-6) and len(got) == 2



def _chains(model: MTPTransformer, seq: list[int], first: int) -> list[int]:
    """From forward()'s logits of `seq`, per position t = first, first + 1, ...: how many drafts
    of heads 2..K at t in a row are greedy's tokens (the drafts a round at t keeps)."""
    K = model.cfg.n_future
    with torch.no_grad():
        logits = model(torch.tensor([seq]))[:, 0]  # (K, S, V)
    greedy, drafts = logits[0].argmax(-1), logits.argmax(-1)  # (S,), (K, S)
    out = []
    for t in range(first, len(seq)):
        n = 0
        while n + 1 < K and t + n + 1 < len(seq) and drafts[n + 1, t] == greedy[t + n + 1]:
            n += 1
        out.append(n)
    return out


def _forwards(chains: list[int], new: int, h: int) -> int:
    """The forwards of self-spec with h heads, replayed from the chains at each position: the
    prefill makes one token, a round at t keeps chains[t] drafts (h - 1 at most, and no more
    than the tokens left want) and adds one, and the next round drafts from its last token."""
    forwards, made, t = 1, 1, 0
    while made < new:
        n = min(chains[t], h - 1, new - made - 1)
        made, t, forwards = made + n + 1, t + n + 1, forwards + 1
    return forwards


def test_bench_simulated_acceptance_counts_the_positions_rounds_draft_from():
    """`mtp bench decode`'s simulated acceptance (`chain_acceptance`) is the share of positions
    from each prompt's last token on whose chain of drafts teacher forcing accepts; replaying
    the rounds over those chains gives the decoded forwards exactly. The simulated L averages
    over positions and decoding over rounds, which skip the positions a long chain jumps:
    here the two L differ (prompts whose greedy text loops accept every draft, the others
    none), while each is exact."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=48, n_layers=3, n_attn_heads=4, n_future=4,
                      max_seq_len=64)
    model = MTPTransformer(cfg).eval()
    for head in model.heads[1:]:  # copies of head 1: where greedy repeats a token they agree
        head.load_state_dict(model.heads[0].state_dict())
    prompts, new = [[3, 1, 4], [2, 7, 1], [8, 2, 8], [5, 9, 2, 6], [1, 1, 2, 3, 5]], 30
    out, _ = generate(model, prompts, new, decoder="greedy")
    seqs = [p + o for p, o in zip(prompts, out, strict=True)]
    chains = [_chains(model, s, len(p) - 1) for s, p in zip(seqs, prompts, strict=True)]
    # the positions whose K - 1 next tokens the text holds
    counted = [c[:len(c) - cfg.n_future + 1] for c in chains]
    got, n = chain_acceptance(model, seqs, [len(p) - 1 for p in prompts])
    assert n == sum(map(len, counted))
    want = [sum(a >= d for c in counted for a in c) / n for d in range(1, cfg.n_future)]
    assert got.tolist() == pytest.approx(want, abs=1e-12) and 0 < want[-1] < 1
    for h in (2, 3, 4):
        _, stats = generate(model, prompts, new, decoder="self-spec", heads=h)
        assert stats.row_forwards == sum(_forwards(c, new, h) for c in chains), h
        assert stats.tokens_per_forward < 1 + got[:h - 1].sum().item()
