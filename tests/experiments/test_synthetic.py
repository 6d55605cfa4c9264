"""experiments/synthetic.py: the generated induction and polynomial tasks, their data module,
metrics, floors and learning curves."""

import numpy as np
import pytest
import torch

from experiments.synthetic import (
    InductionTask,
    PolynomialTask,
    SyntheticDataModule,
    _rng,
    arithmetic_accuracy,
    induction_accuracy,
)
from mtp.config import ModelConfig

# -- induction data ---------------------------------------------------------------------------


def test_induction_targets_are_copies_of_earlier_tokens():
    task = InductionTask()
    first_ids = range(1, 1 + task.n_first)
    marked = 0
    for i in range(50):
        tokens, copy = task.sequence(_rng(3, 0, i), 64)
        assert tokens.shape == copy.shape == (64,)
        assert tokens.min() >= 1 and tokens.max() < task.vocab_size
        for t in np.flatnonzero(copy):
            a = tokens[t - 1]
            assert a in first_ids
            # an earlier occurrence of the same first token, followed by the same token
            earlier = [s for s in range(t - 1) if tokens[s] == a]
            assert earlier and all(tokens[s + 1] == tokens[t] for s in earlier)
            marked += 1
    assert marked > 50  # the task has plenty of copyable positions


def test_generators_are_deterministic_and_seed_dependent():
    task = InductionTask()
    a, _ = task.sequence(_rng(1, 0, 7), 48)
    b, _ = task.sequence(_rng(1, 0, 7), 48)
    c, _ = task.sequence(_rng(2, 0, 7), 48)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    poly = PolynomialTask()
    assert poly.example(_rng(1, 2, 3), 4) == poly.example(_rng(1, 2, 3), 4)


# -- polynomial data --------------------------------------------------------------------------


def _independent_eval(tokens: list[int], task: PolynomialTask) -> np.ndarray:
    """Evaluate prefix tokens right to left with a stack and numpy convolution."""
    stack = []
    i = len(tokens)
    # literals are m tokens < p; walk tokens from the end, grouping coefficients
    buf = []
    while i > 0:
        i -= 1
        t = tokens[i]
        if t < task.p:
            buf.insert(0, t)
            if len(buf) == task.m:
                stack.append(np.array(buf))
                buf = []
            continue
        assert not buf
        if t == task.NEG:
            stack.append((-stack.pop()) % task.p)
        else:
            x, y = stack.pop(), stack.pop()
            r = x + y if t == task.ADD else np.convolve(x, y)[: task.m]
            stack.append(r % task.p)
    assert len(stack) == 1
    return stack[0]


@pytest.mark.parametrize("p,m", [(7, 2), (5, 3), (11, 1)])
def test_polynomial_answers_match_an_independent_evaluation(p, m):
    task = PolynomialTask(p=p, m=m)
    for n_ops in range(0, 7):
        for i in range(40):
            ex, start = task.example(_rng(n_ops, 0, i), n_ops)
            assert ex[start - 1] == task.EQ and ex[-1] == task.SEP
            prompt, answer = ex[: start - 1], ex[start : start + m]
            assert sum(t in (task.ADD, task.MUL, task.NEG) for t in prompt) == n_ops
            assert list(_independent_eval(prompt, task)) == answer


def test_polynomial_windows_start_with_an_example_and_mark_answers():
    task = PolynomialTask()
    tokens, answer = task.sequence(_rng(0, 0, 0), 64)
    ex, start = task.example(_rng(0, 0, 0))
    assert list(tokens[: len(ex)]) == ex
    assert answer[start : start + task.m].all() and not answer[:start].any()


def test_datamodule_windows_shape_and_determinism():
    task = PolynomialTask()
    kw = dict(seq_len=32, n_future=4, batch_size=5, train_steps=3, seed=0)
    a = next(iter(SyntheticDataModule(task, **kw).train_dataloader()))
    b = next(iter(SyntheticDataModule(task, **kw).train_dataloader()))
    assert a.shape == (5, 36) and a.dtype == torch.int64 and torch.equal(a, b)


def test_worker_processes_generate_the_same_windows_in_the_same_order():
    task = InductionTask()
    kw = dict(seq_len=16, n_future=2, batch_size=3, train_steps=4, seed=1)
    alone = list(SyntheticDataModule(task, **kw).train_dataloader())
    workers = list(SyntheticDataModule(task, **kw, num_workers=2).train_dataloader())
    assert len(alone) == len(workers) == 4
    assert all(torch.equal(a, b) for a, b in zip(alone, workers))


class _Oracle(torch.nn.Module):
    """A stand-in for head 1 that predicts by a rule: `rule(x)` gives, for every row and
    position of the input x (B, T), the token it predicts next (B, T)."""

    def __init__(self, rule, vocab_size: int) -> None:
        super().__init__()
        self.rule, self.vocab_size = rule, vocab_size
        self.device_probe = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x, *, heads=None):
        return torch.nn.functional.one_hot(self.rule(x), self.vocab_size).float()[None]


def _copy_rule(task: InductionTask):
    """What an induction head does: after a name's first token, the token that followed its
    latest earlier occurrence."""
    def rule(x):
        out = torch.zeros_like(x)
        for r, row in enumerate(x.tolist()):
            last = {}
            for t, tok in enumerate(row):
                if t > 0:
                    last[row[t - 1]] = tok
                if 1 <= tok <= task.n_first and tok in last:
                    out[r, t] = last[tok]
        return out
    return rule


def _answer_rule(task: PolynomialTask, shift: int = 0):
    """The right answer at each answer position (an independent evaluation of the prompt),
    written `shift` positions late."""
    def rule(x):
        out = torch.full_like(x, task.SEP)
        for r, row in enumerate(x.tolist()):
            eq = row.index(task.EQ)
            for i, tok in enumerate(_independent_eval(row[:eq], task)):
                if eq + i + shift < len(row):
                    out[r, eq + i + shift] = int(tok)
        return out
    return rule


def test_an_induction_oracle_scores_one_and_a_copier_of_the_wrong_token_zero():
    task = InductionTask()
    oracle = _Oracle(_copy_rule(task), task.vocab_size)
    assert induction_accuracy(oracle, task, n_seqs=16, length=64) == 1.0
    # repeating the current token is never the copy (name tokens differ): a mask or target
    # off by one position would let it score
    echo = _Oracle(lambda x: x, task.vocab_size)
    assert induction_accuracy(echo, task, n_seqs=16, length=64) == 0.0


def test_an_arithmetic_oracle_scores_one_and_a_late_one_does_not():
    task = PolynomialTask()
    oracle = _Oracle(_answer_rule(task), task.vocab_size)
    assert arithmetic_accuracy(oracle, task, 3, n_examples=20) == (1.0, 1.0)
    late = _Oracle(_answer_rule(task, shift=1), task.vocab_size)
    exact, _ = arithmetic_accuracy(late, task, 3, n_examples=20)
    assert exact < 0.5



# -- floors and learning curves ----------------------------------------------------------------


def test_the_majority_floor_is_the_most_frequent_answer_on_the_scored_examples():
    from collections import Counter

    from experiments.synthetic import majority_accuracy, majority_answer

    task = PolynomialTask(p=5, m=2, train_ops=(1, 2))
    answer = majority_answer(task)
    assert answer == (0, 0)  # products make zero the likeliest coefficient
    exs = [task.example(_rng(10_000 + 2, 2, i), 2) for i in range(400)]
    counted = Counter(tuple(e[s : s + 2]) for e, s in exs)[answer] / 400
    assert majority_accuracy(task, 2, n_examples=400, answer=answer) == pytest.approx(counted)
    assert counted > 2 / task.p ** task.m  # well above uniform guessing


def test_learning_curves_are_probed_on_schedule_and_their_time_left_out():
    from experiments.synthetic import train_model
    from mtp.config import OptimConfig

    task = InductionTask()
    calls = []
    cfg = ModelConfig(vocab_size=task.vocab_size, d_model=16, n_layers=1, n_attn_heads=1,
                      n_future=2, max_seq_len=24)
    trained = train_model(task, cfg, OptimConfig(lr=1e-3, warmup_steps=1), seq_len=16,
                          batch_size=2, steps=7, seed=0,
                          probe=lambda m: calls.append(m.training) or len(calls),
                          probe_every=3)
    assert [s for s, _ in trained.curve] == [3, 6, 7] and calls == [False] * 3
    assert trained.model.training is False and trained.seconds > 0
