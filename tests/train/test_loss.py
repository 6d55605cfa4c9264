"""The sequential head pass against the naive reference: values, every gradient, memory, DDP."""

import re

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtp.config import HEAD_TYPES, LossConfig, ModelConfig, OptimConfig
from mtp.model.transformer import MTPTransformer
from mtp.train.loss import (
    mtp_loss,
    naive_mtp_loss,
    scheduled_head_weights,
    sequential_mtp_loss,
    soft_cross_entropy_fwd_bwd,
    soft_sequential_path,
)
from mtp.train.module import MTPModule
from mtp.train.targets import IGNORE_INDEX, FrozenTeacher, mtp_inputs_targets
from mtp.util.errors import ConfigError


def _setup(K, *, seed=0, V=101, B=3, T=17, ignore=True, **cfg_kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_attn_heads=2, n_future=K,
                      max_seq_len=64, **cfg_kw)
    model = MTPTransformer(cfg)
    inputs, targets = mtp_inputs_targets(torch.randint(0, V, (B, T + K)), K)
    targets = targets.clone()
    if ignore:
        targets[0, 0, :5] = IGNORE_INDEX  # some ignored positions
        targets[-1, 1] = IGNORE_INDEX  # a whole row ignored for the last head
    return model, inputs, targets


def _grads(model, loss_fn, batches, weights=None):
    model.zero_grad()
    for inputs, targets in batches:
        loss_fn(model, inputs, targets, weights).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_grads_close(got, want, rel):
    for name in want:
        err = (got[name] - want[name]).norm() / want[name].norm().clamp(min=1e-30)
        assert err <= rel, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_sequential_equals_naive(K, head_type):
    model, inputs, targets = _setup(K, head_type=head_type)
    naive = naive_mtp_loss(model, inputs, targets)
    if head_type == "eagle" and K > 1:
        with pytest.raises(ValueError, match="unrolled step attends to the steps before it"):
            sequential_mtp_loss(model, inputs, targets)
        return
    seq = sequential_mtp_loss(model, inputs, targets)
    torch.testing.assert_close(seq.loss, naive.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(seq.head_losses, naive.head_losses, rtol=1e-6, atol=0)
    want = _grads(model, naive_mtp_loss, [(inputs, targets)])
    got = _grads(model, sequential_mtp_loss, [(inputs, targets)])
    # trunk blocks, every head, the shared norm and unembedding, the embedding
    assert any(n.startswith("blocks.") for n in want) and "unembed.weight" in want
    _assert_grads_close(got, want, 1e-5)


@pytest.mark.parametrize("head_type", ["block", "deepseek"])
def test_sequential_equals_naive_with_head_weights_and_tied_embeddings(head_type):
    # deepseek heads also embed tokens with the tied matrix: both gradients reach it
    model, inputs, targets = _setup(3, tie_embeddings=True, head_type=head_type)
    w = [1.0, 0.5, 0.25]
    _assert_grads_close(_grads(model, sequential_mtp_loss, [(inputs, targets)], w),
                        _grads(model, naive_mtp_loss, [(inputs, targets)], w), 1e-5)


def test_soft_cross_entropy_matches_autograd_in_chunks():
    """The chunked soft cross-entropy's loss, dL/dhidden and its addition into dL/dW against
    autograd over the whole logits, with unscored rows and a head weight."""
    torch.manual_seed(0)
    x, W = torch.randn(37, 16, dtype=torch.float64), torch.randn(50, 16, dtype=torch.float64)
    xt, Wt = torch.randn(37, 8, dtype=torch.float64), torch.randn(50, 8, dtype=torch.float64)
    scored = torch.rand(37) > 0.3
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    p = (xt @ Wt.T).softmax(-1)[scored]
    want = -(p * (xr @ Wr.T)[scored].log_softmax(-1)).sum(-1).mean()
    (0.7 * want).backward()
    acc = torch.ones_like(W)  # the gradient is added to what is there
    loss, dx = soft_cross_entropy_fwd_bwd(x, W, xt, Wt, scored, acc, scale=0.7, chunk_size=8)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(acc, 1 + Wr.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("head_type", ["block", "medusa1", "deepseek"])
@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_joint_soft_targets_are_the_frozen_models_distributions(head_type, draft_vocab):
    """`soft_sequential_path` (joint training under --loss.soft_targets) against a reference by
    autograd over every head's logits: head i at t learns the frozen model's head-1
    distribution at t + i, over head i's vocabulary, where its hard target is scored; every
    parameter's gradient, the trunk's included."""
    model, inputs, targets = _setup(3, head_type=head_type, draft_vocab=draft_vocab, V=97,
                                    ignore=False)
    targets[2, 1, :5] = IGNORE_INDEX  # (cascaded heads read targets 1..K-1 as their tokens)
    if draft_vocab:
        model.draft_ids.copy_(torch.randperm(97)[:draft_vocab])
    teacher = FrozenTeacher(model)
    with torch.no_grad():  # the model moves away from the teacher, as in training
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
    weights = [1.0, 0.8, 0.64]
    T = inputs.shape[1]

    def reference():
        logits = model(inputs)  # (K, B, T, V); head 1's over V, the others over the draft ids
        t_logits = teacher.model(inputs, heads=1)[0]
        losses = []
        for i in range(3):
            ids = model.draft_ids if i and draft_vocab else torch.arange(97)
            p = t_logits[:, i:, ids].softmax(-1)
            log_q = logits[i, :, :T - i, ids].log_softmax(-1)
            scored = targets[i][:, :T - i] != IGNORE_INDEX
            losses.append((-(p * log_q).sum(-1) * scored).sum() / scored.sum())
        return torch.stack(losses)

    model.zero_grad()
    want = reference()
    (torch.tensor(weights) * want).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = mtp_loss(model, inputs, targets, weights, path=soft_sequential_path(teacher(inputs)))
    got.loss.backward()
    torch.testing.assert_close(got.head_losses, want.detach(), rtol=1e-5, atol=0)
    assert any(n.startswith("blocks.") for n in want_grads)
    _assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want_grads, 1e-5)


def test_joint_training_learns_from_the_model_as_it_started(tiny_corpus, tmp_path, monkeypatch):
    """Joint training under --loss.soft_targets through Lightning: every step scores the heads
    against the teacher's distributions of its batch, the trunk and heads move, the teacher
    stays the model as it started, and checkpoints hold the trained model alone."""
    import mtp.train.module as module_mod
    from mtp.config import DataConfig
    from mtp.data import MTPDataModule

    taught = []

    def recording(teacher):
        taught.append(teacher)
        return soft_sequential_path(teacher)

    monkeypatch.setattr(module_mod, "soft_sequential_path", recording)

    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_attn_heads=2, n_future=3,
                      max_seq_len=32)
    L.seed_everything(0)
    module = MTPModule(cfg, OptimConfig(lr=1e-2, warmup_steps=1, pretrained_lr_scale=0.1),
                       LossConfig(soft_targets=True))
    start = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    dm = MTPDataModule(DataConfig(source=str(tiny_corpus), cache_dir=str(tmp_path), seq_len=16,
                                  batch_size=4, val_fraction=0.1), vocab_size=300, n_future=3)
    L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0).fit(module, datamodule=dm)
    assert len(taught) == 2 and all(t.z.shape == (4, 16, 32) for t in taught)
    assert all(torch.equal(t.W, start["unembed.weight"]) for t in taught)
    now = dict(module.model.named_parameters())
    for name in ("blocks.0.attn.qkv.weight", "heads.1.mlp.down.weight"):
        assert not torch.equal(now[name], start[name]), name
    teacher = dict(module.teacher.model.named_parameters())
    assert teacher and all(not p.requires_grad for p in teacher.values())
    for name, p in teacher.items():
        assert torch.equal(p, start[name]), name
    assert set(module.state_dict()) == {f"model.{n}" for n in module.model.state_dict()}


def test_sequential_equals_naive_under_gradient_accumulation():
    model, inputs, targets = _setup(3, B=4)
    micro = [(inputs[:2], targets[:, :2]), (inputs[2:], targets[:, 2:])]
    _assert_grads_close(_grads(model, sequential_mtp_loss, micro),
                        _grads(model, naive_mtp_loss, micro), 1e-5)


def test_sequential_fp64_is_exact():
    model, inputs, targets = _setup(2)
    model.double()
    _assert_grads_close(_grads(model, sequential_mtp_loss, [(inputs, targets)]),
                        _grads(model, naive_mtp_loss, [(inputs, targets)]), 1e-12)


def test_sequential_under_bf16_autocast_tracks_fp32():
    model, inputs, targets = _setup(2)
    want = _grads(model, naive_mtp_loss, [(inputs, targets)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(model, sequential_mtp_loss, [(inputs, targets)])
    assert all(g.dtype == torch.float32 for g in got.values())
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 2e-3 per operand); through a few
    # layers of matmuls the gradient error of a unit-scale model is a few percent at most.
    _assert_grads_close(got, want, 5e-2)


def test_the_metrics_path_matches_naive():
    model, inputs, targets = _setup(3)
    with torch.no_grad():
        naive = naive_mtp_loss(model, inputs, targets)
        ours = mtp_loss(model, inputs, targets, path="metrics")
    torch.testing.assert_close(ours.head_losses, naive.head_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(ours.head_accuracies, naive.head_accuracies.float())
    acc = sequential_mtp_loss(model, inputs, targets, with_accuracy=True).head_accuracies
    torch.testing.assert_close(acc, naive.head_accuracies.float())


def test_sequential_loss_without_grad_mode_points_to_the_metrics_path():
    model, inputs, targets = _setup(2)
    with torch.no_grad(), pytest.raises(RuntimeError, match="`metrics` path"):
        sequential_mtp_loss(model, inputs, targets)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("head_type", ["block", "deepseek"])
def test_sequential_pass_never_holds_an_n_by_v_buffer(head_type):
    V, B, T = 16384, 4, 64  # N = 256 tokens; the CPU path takes 128 tokens x V at a time
    model, inputs, targets = _setup(4, V=V, B=B, T=T, ignore=False, head_type=head_type)
    N = B * T
    for fn, holds_logits in ((naive_mtp_loss, True), (sequential_mtp_loss, False)):
        model.zero_grad()
        with _LargestTensor() as probe:
            fn(model, inputs, targets).loss.backward()
        if holds_logits:
            assert probe.largest >= 4 * N * V  # the probe does see the naive K x N x V logits
        else:
            assert probe.largest < N * V, f"a buffer of {probe.largest} elements >= N x V"


def test_lightning_steps_match_between_strategies(tiny_corpus, tmp_path):
    """Accumulation (2 micro-batches) and clipping through Lightning: same weights either way."""
    from mtp.config import DataConfig
    from mtp.data import MTPDataModule

    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_attn_heads=2, n_future=3,
                      max_seq_len=32)
    weights = {}
    for strategy in ("naive", "sequential"):
        L.seed_everything(0)
        module = MTPModule(cfg, OptimConfig(lr=1e-2, warmup_steps=1), LossConfig(strategy))
        start = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        dm = MTPDataModule(DataConfig(source=str(tiny_corpus), cache_dir=str(tmp_path),
                                      seq_len=16, batch_size=4, val_fraction=0.1),
                           vocab_size=300, n_future=3)
        L.Trainer(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0,
                  use_distributed_sampler=False).fit(module, datamodule=dm)
        weights[strategy] = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    for name, w in weights["naive"].items():
        # Adam divides by sqrt(v): where a gradient is ~0, fp32 rounding moves single elements;
        # compare the distance between the runs with the distance each run travelled.
        moved = (w - start[name]).norm()
        assert moved > 0 and (weights["sequential"][name] - w).norm() <= 1e-4 * moved, name


@pytest.mark.parametrize(("schedule", "want"), [
    ("constant", [[1, 0.5, 0.5]] * 5),
    ("ramp", [[1, 0.5 * s / 4, 0.5 * s / 4] for s in range(4)] + [[1, 0.5, 0.5]]),
    # head 2 joins at step 4 / 2 = 2, head 3 at step 4
    ("curriculum", [[1, 0, 0], [1, 0, 0], [1, 0.5, 0], [1, 0.5, 0], [1, 0.5, 0.5]]),
])
def test_head_weight_schedules(schedule, want):
    steps = None if schedule == "constant" else 4
    cfg = LossConfig(head_weights=[1, 0.5, 0.5], schedule=schedule, schedule_steps=steps)
    assert [scheduled_head_weights(cfg, 3, s) for s in range(5)] == want


def test_curriculum_trains_only_the_heads_that_joined_and_logs_the_weights(tiny_corpus,
                                                                           tmp_path):
    from mtp.config import DataConfig
    from mtp.data import MTPDataModule

    class Probe(L.Callback):
        def __init__(self):
            self.logged, self.head3_grad = [], []

        def on_before_optimizer_step(self, trainer, module, optimizer):
            g = [p.grad for p in module.model.heads[2].parameters()]
            self.head3_grad.append(float(sum(x.abs().sum() for x in g if x is not None)))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            m = trainer.callback_metrics
            self.logged.append([float(m[f"train/head_weight{i}"]) for i in (1, 2, 3)])

    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_attn_heads=2, n_future=3,
                      max_seq_len=32)
    module = MTPModule(cfg, OptimConfig(lr=1e-2, warmup_steps=1),
                       LossConfig(schedule="curriculum", schedule_steps=4))
    dm = MTPDataModule(DataConfig(source=str(tiny_corpus), cache_dir=str(tmp_path), seq_len=16,
                                  batch_size=4, val_fraction=0.1), vocab_size=300, n_future=3)
    probe = Probe()
    L.Trainer(max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, callbacks=[probe],
              use_distributed_sampler=False).fit(module, datamodule=dm)
    assert probe.logged == [[1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert probe.head3_grad[:4] == [0.0] * 4 and probe.head3_grad[4] > 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"schedule": "ramp"}, "--loss.schedule ramp needs --loss.schedule_steps >= 1 (got None)"),
    ({"schedule": "curriculum", "schedule_steps": 0},
     "--loss.schedule curriculum needs --loss.schedule_steps >= 1 (got 0)"),
    ({"schedule_steps": 5}, "--loss.schedule_steps applies to --loss.schedule ramp or "
                            "curriculum only (got --loss.schedule constant)"),
])
def test_bad_schedules_name_both_flags(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        LossConfig(**kwargs)


def test_a_schedule_needs_heads_to_move():
    from mtp.config import RunConfig

    with pytest.raises(ConfigError, match=re.escape(
            "--loss.schedule ramp moves the weights of heads 2..K, but --model.n_future is 1")):
        RunConfig(model=ModelConfig(n_future=1), loss=LossConfig(schedule="ramp",
                                                                  schedule_steps=3))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"model": ModelConfig(head_type="eagle")}, "--model.head_type eagle trains with "
     "--optim.train heads or --loss.strategy naive"),
])
def test_flags_that_need_a_frozen_trunk_say_so(kwargs, message):
    from mtp.config import RunConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        RunConfig(**kwargs)
    RunConfig(**kwargs, optim=OptimConfig(train="heads"))  # accepted there


@pytest.mark.parametrize(("model", "optim"), [({"head_type": "block"}, {"train": "heads"}),
                                             ({"head_type": "eagle"}, {"train": "all"})])
def test_feature_regression_needs_eagle_heads_on_a_frozen_trunk(model, optim):
    from mtp.config import RunConfig

    with pytest.raises(ConfigError, match=re.escape(
            "--loss.feature_weight regresses eagle's draft features to the frozen trunk's: it "
            "needs --model.head_type eagle and --optim.train heads (got --model.head_type "
            f"{model['head_type']}, --optim.train {optim['train']})")):
        RunConfig(model=ModelConfig(**model), optim=OptimConfig(**optim),
                  loss=LossConfig(feature_weight=0.1, strategy="naive"))
    with pytest.raises(ConfigError, match=re.escape("--loss.feature_weight must be >= 0 (got "
                                                    "-1.0)")):
        LossConfig(feature_weight=-1.0)


@pytest.mark.parametrize("kwargs", [{}, {"init_from": "x.gguf", "strategy": "naive"}])
def test_joint_soft_targets_need_a_pretrained_model_and_the_sequential_pass(kwargs):
    from mtp.config import RunConfig

    model = ModelConfig(init_from=kwargs.get("init_from"))
    loss = LossConfig(strategy=kwargs.get("strategy", "sequential"), soft_targets=True)
    with pytest.raises(ConfigError, match=re.escape(
            "--loss.soft_targets with --optim.train all learns the distributions of the "
            "pretrained model training starts from, by the sequential pass: it needs "
            "--model.init_from and --loss.strategy sequential")):
        RunConfig(model=model, loss=loss)
    RunConfig(model=model, loss=loss, optim=OptimConfig(train="heads"))  # frozen: the trunk
