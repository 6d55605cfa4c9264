"""Generated tasks of the small-scale studies of Gloeckle et al. (2024), and how to train on them.

Two tasks, each generated on the fly from a seed (example i of a split is a pure function of
(seed, split, i), so data never touch the disk and every run sees exactly the same examples):

- `InductionTask`: streams of random filler tokens and two-token "names". A sequence uses a few
  names, each drawn afresh per sequence, so once a name's first token reappears, its second
  token can only be predicted by copying the token that followed it earlier (an induction head).
- `PolynomialTask`: expressions over the ring F_p[X]/(X^m) in prefix notation with the
  operations +, *, and unary negation, followed by `=` and the m coefficients of the result.
  The number of operations separates in-distribution from out-of-distribution examples.

`SyntheticDataModule` turns a task into windows of shape (B, T + K) for `MTPModule`, whose step
is the one every other mtp run uses (`mtp_inputs_targets(window, K)`); `train_model` calls
`lightning.Trainer.fit` on it. Evaluation scores head 1 teacher-forced on the positions that
matter (copied name tokens, answer coefficients): for an exact-match answer, teacher-forced argmax
and greedy decoding agree, since greedy only continues an answer whose prefix is right.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mtp.config import LossConfig, ModelConfig, OptimConfig
from mtp.model.transformer import MTPTransformer
from mtp.train.module import MTPModule

TRAIN, VAL, TEST = 0, 1, 2


def _rng(seed: int, split: int, index: int) -> np.random.Generator:
    # One independent stream per example: the data do not depend on batch size, order or workers.
    return np.random.default_rng([seed, split, index])


# -- induction --------------------------------------------------------------------------------


@dataclass
class InductionTask:
    """Filler tokens with repeated two-token names; the name's second token must be copied.

    Token ids: 0 is unused (kept free as a separator), first name tokens are [1, 1 + n_first),
    second name tokens follow, then the filler tokens. A sequence is a stream of "words": with
    probability `name_prob` one of its `names_per_seq` names (first token a, second token b,
    distinct first tokens within a sequence), otherwise one filler token.
    """

    n_first: int = 16
    """Distinct first tokens of names."""
    n_second: int = 32
    """Distinct second tokens of names (chance level of a copy is 1 / n_second)."""
    n_filler: int = 64
    """Distinct filler tokens."""
    names_per_seq: int = 3
    """Names used in one sequence."""
    name_prob: float = 0.3
    """Probability that the next word is a name rather than a filler token."""

    @property
    def vocab_size(self) -> int:
        return 1 + self.n_first + self.n_second + self.n_filler

    def sequence(self, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (length,) and a mask of the positions whose token is a copyable name token.

        A position is marked when it holds the second token of a name whose two tokens already
        appeared together earlier in the sequence: only there does copying determine the answer.
        """
        first = rng.choice(self.n_first, self.names_per_seq, replace=False) + 1
        second = rng.integers(0, self.n_second, self.names_per_seq) + 1 + self.n_first
        filler0 = 1 + self.n_first + self.n_second
        tokens = np.empty(length, dtype=np.int64)
        copy = np.zeros(length, dtype=bool)
        seen = np.zeros(self.names_per_seq, dtype=bool)
        t = 0
        while t < length:
            if rng.random() < self.name_prob:
                j = rng.integers(self.names_per_seq)
                tokens[t] = first[j]
                if t + 1 < length:
                    tokens[t + 1] = second[j]
                    copy[t + 1] = seen[j]
                seen[j] = True
                t += 2
            else:
                tokens[t] = filler0 + rng.integers(self.n_filler)
                t += 1
        return tokens, copy


# -- polynomial arithmetic ---------------------------------------------------------------------


@dataclass
class PolynomialTask:
    """Prefix-notation expressions over F_p[X]/(X^m) followed by `=` and the result.

    A polynomial literal is its m coefficients (lowest degree first), one token each; operators
    are `+`, `*` (binary) and `~` (unary negation). An example is
    `<expression> = c_0 ... c_{m-1} ;` and windows are examples packed back to back.
    """

    p: int = 7
    """The prime modulus of the coefficients."""
    m: int = 2
    """Coefficients per polynomial: the ring is F_p[X]/(X^m)."""
    train_ops: tuple[int, int] = (1, 3)
    """Operations per training example (inclusive range): the training distribution."""
    neg_prob: float = 0.2
    """Probability that an operation is a negation rather than + or *."""

    @property
    def ADD(self) -> int:  # noqa: N802 (token ids read as constants)
        return self.p

    @property
    def MUL(self) -> int:  # noqa: N802
        return self.p + 1

    @property
    def NEG(self) -> int:  # noqa: N802
        return self.p + 2

    @property
    def EQ(self) -> int:  # noqa: N802
        return self.p + 3

    @property
    def SEP(self) -> int:  # noqa: N802
        return self.p + 4

    @property
    def vocab_size(self) -> int:
        return self.p + 5

    def expression(self, rng: np.random.Generator, n_ops: int) -> list:
        """A random expression tree with exactly `n_ops` operations.

        Trees are nested lists: `["+", a, b]`, `["*", a, b]`, `["~", a]`, or a literal (a tuple
        of m coefficients).
        """
        if n_ops == 0:
            return tuple(int(c) for c in rng.integers(0, self.p, self.m))
        if rng.random() < self.neg_prob:
            return ["~", self.expression(rng, n_ops - 1)]
        left = int(rng.integers(0, n_ops))  # operations in the left operand
        op = "+" if rng.random() < 0.5 else "*"
        return [op, self.expression(rng, left), self.expression(rng, n_ops - 1 - left)]

    def tokens(self, tree) -> list[int]:
        """Prefix-notation tokens of an expression tree."""
        if isinstance(tree, tuple):
            return list(tree)
        op = {"+": self.ADD, "*": self.MUL, "~": self.NEG}[tree[0]]
        return [op] + [t for child in tree[1:] for t in self.tokens(child)]

    def evaluate(self, tree) -> tuple[int, ...]:
        """The value of an expression tree: m coefficients in [0, p)."""
        if isinstance(tree, tuple):
            return tree
        args = [self.evaluate(c) for c in tree[1:]]
        if tree[0] == "~":
            return tuple((-c) % self.p for c in args[0])
        a, b = args
        if tree[0] == "+":
            return tuple((x + y) % self.p for x, y in zip(a, b))
        out = [0] * self.m
        for i, x in enumerate(a):
            for j, y in enumerate(b[: self.m - i]):  # X^(i + j) vanishes once i + j >= m
                out[i + j] = (out[i + j] + x * y) % self.p
        return tuple(out)

    def example(self, rng: np.random.Generator, n_ops: int | None = None
                ) -> tuple[list[int], int]:
        """Tokens of one example (ending in SEP) and the index of its first answer token."""
        if n_ops is None:
            n_ops = int(rng.integers(self.train_ops[0], self.train_ops[1] + 1))
        tree = self.expression(rng, n_ops)
        prompt = self.tokens(tree) + [self.EQ]
        return prompt + list(self.evaluate(tree)) + [self.SEP], len(prompt)

    def sequence(self, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Training examples packed from position 0 (the last one cut off), and an answer mask."""
        tokens, answer = [], []
        while len(tokens) < length:
            ex, start = self.example(rng)
            tokens += ex
            answer += [start <= i < start + self.m for i in range(len(ex))]
        return np.array(tokens[:length], dtype=np.int64), np.array(answer[:length])


# -- Lightning plumbing ------------------------------------------------------------------------


class _Windows(Dataset):
    def __init__(self, task, seed: int, split: int, n: int, width: int) -> None:
        self.task, self.seed, self.split, self.n, self.width = task, seed, split, n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        tokens, _ = self.task.sequence(_rng(self.seed, self.split, i), self.width)
        return torch.from_numpy(tokens)


class SyntheticDataModule(L.LightningDataModule):
    """Windows (B, T + K) of a generated task, deterministic in `seed`."""

    def __init__(self, task, *, seq_len: int, n_future: int, batch_size: int, train_steps: int,
                 seed: int, val_windows: int = 64, num_workers: int = 0) -> None:
        super().__init__()
        width = seq_len + n_future
        self.tokenizer = None  # no text: checkpoints of these runs are never written
        self.train_set = _Windows(task, seed, TRAIN, train_steps * batch_size, width)
        self.val_set = _Windows(task, seed, VAL, val_windows, width)
        self.batch_size, self.num_workers = batch_size, num_workers

    def train_dataloader(self) -> DataLoader:
        # Every index is a fresh example, so reading them in order is already a random stream;
        # worker processes generate the same windows in the same order.
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False,
                          drop_last=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=0)


class _Probe(L.Callback):
    """Scores the model every `every` optimizer steps while it trains: a learning curve.

    The time spent scoring is kept apart, so the training time of a run does not depend on how
    often it is probed.
    """

    def __init__(self, score: Callable[[MTPTransformer], float], every: int) -> None:
        self.score, self.every = score, every
        self.curve: list[tuple[int, float]] = []
        self.seconds = 0.0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every and step != trainer.max_steps:
            return
        start = time.perf_counter()
        module.model.eval()
        self.curve.append((step, float(self.score(module.model))))
        module.model.train()
        self.seconds += time.perf_counter() - start


@dataclass
class Trained:
    """What `train_model` returns."""

    model: MTPTransformer
    """The trained model, in eval mode, on the device it trained on."""
    seconds: float
    """Training wall time, probing excluded."""
    curve: list[tuple[int, float]]
    """(optimizer step, probe score) every `probe_every` steps and at the last step; empty
    without a probe."""


def train_model(task, model_cfg: ModelConfig, optim_cfg: OptimConfig, *, seq_len: int,
                batch_size: int, steps: int, seed: int, log_dir: str | None = None,
                accelerator: str = "cpu", precision: str = "32-true", data_workers: int = 0,
                probe: Callable[[MTPTransformer], float] | None = None,
                probe_every: int = 100) -> Trained:
    """Train an MTP model on a generated task with `MTPModule` and `lightning.Trainer` (at a
    Lightning `precision`, its windows generated by `data_workers` processes, 0: in the
    training process), scoring it with `probe` every `probe_every` steps (a learning curve)
    when one is given."""
    L.seed_everything(seed, verbose=False)
    module = MTPModule(model_cfg, optim_cfg, LossConfig())
    dm = SyntheticDataModule(task, seq_len=seq_len, n_future=model_cfg.n_future,
                             batch_size=batch_size, train_steps=steps, seed=seed,
                             num_workers=data_workers)
    logger = False
    if log_dir is not None:
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(log_dir, name="", version="", default_hp_metric=False)
    probes = [] if probe is None else [_Probe(probe, probe_every)]
    trainer = L.Trainer(max_steps=steps, accelerator=accelerator, precision=precision,
                        devices=1, logger=logger,
                        callbacks=probes, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, gradient_clip_val=1.0,
                        log_every_n_steps=max(1, steps // 20), use_distributed_sampler=False)
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    seconds = time.perf_counter() - start - sum(p.seconds for p in probes)
    # Lightning hands the module back on the CPU; evaluate where it trained.
    return Trained(module.model.to(trainer.strategy.root_device).eval(), seconds,
                   probes[0].curve if probes else [])


# -- evaluation --------------------------------------------------------------------------------


@torch.no_grad()
def induction_accuracy(model: MTPTransformer, task: InductionTask, *, n_seqs: int,
                       length: int, seed: int = 10_000, batch: int = 64) -> float:
    """Head-1 top-1 accuracy on copyable name tokens of held-out sequences (teacher-forced)."""
    hits = total = 0
    for a in range(0, n_seqs, batch):
        seqs = [task.sequence(_rng(seed, TEST, i), length) for i in range(a, min(a + batch,
                                                                                 n_seqs))]
        device = next(model.parameters()).device
        x = torch.from_numpy(np.stack([s[0] for s in seqs])).to(device)
        copy = torch.from_numpy(np.stack([s[1] for s in seqs])).to(device)
        pred = model(x[:, :-1], heads=1)[0].argmax(-1)  # (B, T - 1): prediction of t + 1
        mask = copy[:, 1:]
        hits += int((pred == x[:, 1:])[mask].sum())
        total += int(mask.sum())
    return hits / max(total, 1)


def induction_bag_baseline(task: InductionTask, *, n_seqs: int, length: int,
                           seed: int = 10_000) -> float:
    """Expected copy accuracy of guessing uniformly among the second name tokens seen so far.

    This is what a model reaches by knowing *which* names occur in the context without pairing
    first and second tokens (no induction head): the level to beat for real copying.
    """
    total, expected = 0, 0.0
    for i in range(n_seqs):
        tokens, copy = task.sequence(_rng(seed, TEST, i), length)
        seen: set[int] = set()
        for t in range(1, length):
            if copy[t]:
                expected += 1 / len(seen)  # the true token is among those seen (it is a copy)
                total += 1
            if tokens[t] > task.n_first and tokens[t] <= task.n_first + task.n_second:
                seen.add(int(tokens[t]))
    return expected / max(total, 1)


@torch.no_grad()
def arithmetic_accuracy(model: MTPTransformer, task: PolynomialTask, n_ops: int, *,
                        n_examples: int, seed: int = 10_000, batch: int = 128
                        ) -> tuple[float, float]:
    """Exact-match and per-coefficient accuracy of head 1 on answers of `n_ops`-operation examples.

    Each example starts at position 0, as the first example of every training window does.
    Teacher-forced argmax exact match equals greedy-decoding exact match (see module docstring).
    """
    exact = coef = 0
    for a in range(0, n_examples, batch):
        exs = [task.example(_rng(seed + n_ops, TEST, i), n_ops)
               for i in range(a, min(a + batch, n_examples))]
        width = max(len(e) for e, _ in exs)
        # Right padding is invisible to the causal answer positions before it.
        x = torch.full((len(exs), width), task.SEP, dtype=torch.long)
        for r, (e, _) in enumerate(exs):
            x[r, : len(e)] = torch.tensor(e)
        pred = model(x.to(next(model.parameters()).device), heads=1)[0].argmax(-1).cpu()
        # pred (B, W): the prediction of the next token at every position
        for r, (e, start) in enumerate(exs):
            ok = pred[r, start - 1 : start - 1 + task.m] == x[r, start : start + task.m]
            exact += int(ok.all())
            coef += int(ok.sum())
    return exact / n_examples, coef / (n_examples * task.m)


def majority_answer(task: PolynomialTask, *, n_examples: int = 20_000,
                    seed: int = 20_000) -> tuple[int, ...]:
    """The most frequent answer of the training distribution, counted on examples of a stream
    of their own (neither training nor evaluation examples)."""
    counts = Counter(tuple(ex[start : start + task.m])
                     for ex, start in (task.example(_rng(seed, TRAIN, i))
                                       for i in range(n_examples)))
    return counts.most_common(1)[0][0]


def majority_accuracy(task: PolynomialTask, n_ops: int, *, n_examples: int,
                      seed: int = 10_000, answer: tuple[int, ...] | None = None) -> float:
    """Exact-match accuracy of always giving `answer` (default: `majority_answer`), on the
    very examples that `arithmetic_accuracy` scores: the floor of a model that ignores the
    question (products make some answers, (0, 0) above all, far likelier than 1 / p^m)."""
    answer = answer or majority_answer(task)
    return sum(tuple(ex[start : start + task.m]) == answer
               for ex, start in (task.example(_rng(seed + n_ops, TEST, i), n_ops)
                                 for i in range(n_examples))) / n_examples
