"""Models and measures the decoding tests share: random models, models trained on a cyclic
stream so that drafts are both accepted and rejected, and a chi-square test of sampled output."""

from __future__ import annotations

import copy
import itertools

import torch

from mtp.config import ModelConfig
from mtp.decoding.sampling import probs_from_logits
from mtp.model.transformer import MTPTransformer
from mtp.train.loss import naive_mtp_loss
from mtp.train.targets import mtp_inputs_targets

V_TINY, N_NEW, N_SAMPLES = 4, 4, 12000
SAMPLING = {"temperature": 0.9, "top_k": 3, "top_p": 0.8}


def random_model(seed: int = 0, **overrides) -> MTPTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_name("debug", **{"n_future": 4, "max_seq_len": 128, **overrides})
    return MTPTransformer(cfg).eval()


def random_prompts(n: int, vocab: int, seed: int, lo: int = 1, hi: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths]


def train_cyclic(steps: int = 150, snapshot: int = 9, **overrides
                 ) -> tuple[MTPTransformer, MTPTransformer]:
    """A K = 4 model trained on a cycle of 11 tokens (plus noise) for `steps` steps (heads
    nearly always right), and a snapshot after `snapshot` + 1 steps (heads right now and then)."""
    model = random_model(1, **overrides)
    cycle = torch.randperm(model.cfg.vocab_size, generator=torch.Generator().manual_seed(1))[:11]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    k, t = model.cfg.n_future, 32
    model.train()
    for step in range(steps):
        start = torch.randint(0, 11, (16, 1), generator=g)
        seq = cycle[(start + torch.arange(t + k)) % 11]  # (16, t + K)
        noise = torch.rand(seq.shape, generator=g) < 0.1  # keep the heads imperfect
        seq = torch.where(noise, torch.randint(0, 256, seq.shape, generator=g), seq)
        loss = naive_mtp_loss(model, *mtp_inputs_targets(seq, k)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == snapshot:
            early = copy.deepcopy(model).eval().requires_grad_(False)
    model.eval().requires_grad_(False)
    model.cycle = early.cycle = cycle.tolist()
    return model, early


def cyclic_prompts(model: MTPTransformer, n: int, seed: int) -> list[list[int]]:
    """Random prompts, half of them ending in a stretch of the cycle."""
    prompts = random_prompts(n, model.cfg.vocab_size, seed, hi=12)
    cycle = model.cycle
    return [p + (cycle[i % 11 :] + cycle)[: 3 + i % 5] if i % 2 else p
            for i, p in enumerate(prompts)]


def spread_prompts(model: MTPTransformer, n: int, seed: int) -> list[list[int]]:
    """`cyclic_prompts` (`random_prompts` for a model not trained on the cycle) repeated 1 to 4
    times: lengths from 1 to 76 tokens, so that a batch's prefill groups them by length."""
    prompts = cyclic_prompts(model, n, seed) if hasattr(model, "cycle") else \
        random_prompts(n, model.cfg.vocab_size, seed, hi=19)
    return [p * (1 + i % 4) for i, p in enumerate(prompts)]


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit; cells expecting fewer than 5 counts are pooled."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


def tiny_model(**overrides) -> tuple[MTPTransformer, list[int], torch.Tensor]:
    """A 4-token-vocabulary K = 4 model, a prompt, and the exact distribution of the next 4
    sampled tokens (4^4 cells), from full forwards without a cache."""
    model = random_model(11, vocab_size=V_TINY, init_std=0.5, **overrides).requires_grad_(False)
    prompt = [1, 3]
    seqs = torch.tensor([prompt + list(s) for s in itertools.product(range(V_TINY), repeat=N_NEW)])
    logits = model(seqs, heads=1)[0]  # (V^n, P + n, V)
    p = probs_from_logits(logits[:, len(prompt) - 1 : -1], **SAMPLING)  # (V^n, n, V)
    joint = p.gather(-1, seqs[:, len(prompt) :, None])[..., 0].double().prod(-1)
    return model, prompt, joint


def cell(tokens: list[list[int]]) -> torch.Tensor:
    """Each sample's index among the V_TINY ** N_NEW possible continuations."""
    t = torch.tensor(tokens)
    return (t * V_TINY ** torch.arange(N_NEW - 1, -1, -1)).sum(1)
