"""The sequential head pass on several processes: DDP and FSDP2 gradients, `mtp fit
--trainer.strategy fsdp`, resume. The ranks import no Lightning (nor does this file), so each
starts in seconds."""

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import REPO

from mtp.config import ModelConfig
from mtp.model.checkpoint import load_checkpoint
from mtp.model.transformer import MTPTransformer
from mtp.train.loss import naive_mtp_loss, sequential_mtp_loss
from mtp.train.parallel import run_ranks
from mtp.train.targets import IGNORE_INDEX, mtp_inputs_targets


class _LossOf(torch.nn.Module):
    """What Lightning's DDP wrapper does: the loss is computed inside the wrapped forward."""

    def __init__(self, model: MTPTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs, targets):
        return sequential_mtp_loss(self.model, inputs, targets).loss


def _ddp_worker(rank, world, state, inputs, targets, out_path):
    torch.set_num_threads(1)
    model = MTPTransformer(ModelConfig(**state["cfg"]))
    model.load_state_dict(state["weights"])
    ddp = torch.nn.parallel.DistributedDataParallel(_LossOf(model))
    shard = slice(rank * len(inputs) // world, (rank + 1) * len(inputs) // world)
    loss = ddp(inputs[shard], targets[:, shard])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        torch.save({"loss": total / world,
                    "grads": {n: p.grad for n, p in model.named_parameters()}}, out_path)


def test_ddp_two_processes_match_one_process(tmp_path):
    """The sequential pass under DDP on two gloo ranks: the loss and gradients of the naive pass
    over the whole batch on one process (fp32, 1e-5)."""
    torch.manual_seed(0)
    K, V, B, T = 3, 101, 4, 17
    model = MTPTransformer(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_attn_heads=2,
                                       n_future=K, max_seq_len=64))
    inputs, targets = mtp_inputs_targets(torch.randint(0, V, (B, T + K)), K)
    state = {"cfg": model.cfg.__dict__, "weights": model.state_dict()}
    out = tmp_path / "ddp.pt"
    run_ranks(_ddp_worker, 2, state, inputs, targets, str(out), timeout=240)
    result = torch.load(out)
    single = naive_mtp_loss(model, inputs, targets)
    single.loss.backward()
    torch.testing.assert_close(result["loss"], single.loss.detach(), rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        err = (result["grads"][name] - p.grad).norm() / p.grad.norm().clamp(min=1e-30)
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def _fsdp_worker(rank, world, state, inputs, targets, accumulate, out_path):
    """One rank: shard the model, run `accumulate` micro-batches of its share, save the full
    gradients (rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh

    from mtp.train.parallel import full_model, shard_model

    torch.set_num_threads(1)
    model = MTPTransformer(ModelConfig(**state["cfg"]))
    model.load_state_dict(state["weights"])
    shard_model(model, init_device_mesh("cpu", (world,)))
    per_rank = len(inputs) // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    x, y = inputs[mine], targets[:, mine]
    micro = per_rank // accumulate
    losses = []
    for m in range(accumulate):
        part = slice(m * micro, (m + 1) * micro)
        out = sequential_mtp_loss(model, x[part], y[:, part])
        (out.loss / accumulate).backward()
        losses.append(out.loss.detach())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    full = full_model(model)
    if rank == 0:
        torch.save({"grads": grads, "weights": full.state_dict()}, out_path)


# deepseek: cascaded heads (and a head 1 with no parameters) through the sequential pass's
# backward sweep, each module gathered for its turn; medusa1: residual heads on the normalised
# trunk output, which the heads share
@pytest.mark.parametrize("head_type,accumulate", [("block", 1), ("deepseek", 2), ("medusa1", 1)])
def test_fsdp_gradients_equal_single_process_naive(tmp_path, head_type, accumulate):
    """Two gloo ranks, each head its own sharded unit: the mean of the ranks' gradients equals
    the naive pass over the whole batch on one process (fp32, 1e-5)."""
    torch.manual_seed(0)
    K, V, B, T = 4, 97, 4, 15
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_attn_heads=2, n_future=K,
                      max_seq_len=32, head_type=head_type)
    model = MTPTransformer(cfg)
    inputs, targets = mtp_inputs_targets(torch.randint(0, V, (B, T + K)), K)
    targets = targets.clone()
    targets[1, :, :3] = IGNORE_INDEX
    state = {"cfg": cfg.__dict__, "weights": model.state_dict()}
    out = tmp_path / "fsdp.pt"
    run_ranks(_fsdp_worker, 2, state, inputs, targets, accumulate, str(out), timeout=240)
    result = torch.load(out)
    # the ranks' losses are means over their own tokens: the reference averages the same way
    per_rank = B // 2 // accumulate
    model.zero_grad()
    for part in range(0, B, per_rank):
        s = slice(part, part + per_rank)
        (naive_mtp_loss(model, inputs[s], targets[:, s]).loss * per_rank / B).backward()
    for name, p in model.named_parameters():
        err = (result["grads"][name] - p.grad).norm() / p.grad.norm()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    for name, w in model.state_dict().items():  # the gathered full model is the same model
        torch.testing.assert_close(result["weights"][name], w, rtol=0, atol=0)


def _hanging_worker(rank, world):
    if rank == 1:
        time.sleep(3600)  # a rank that never reaches the collective below
    dist.barrier()


def test_run_ranks_ends_a_hung_run_and_leaves_no_process():
    """A hung collective neither hangs the caller nor leaves a process for pytest to wait on at
    exit: the rank past its deadline prints its stack and exits, the other is killed."""
    with pytest.raises(mp.ProcessExitedException):
        run_ranks(_hanging_worker, 2, timeout=3)
    assert multiprocessing.active_children() == []


def _mtp_fit(tmp_path: Path, strategy: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).parent / "mtp"), "fit",
           "--config", str(REPO / "configs/debug.yaml"),
           "--trainer.accelerator", "cpu", "--trainer.devices", "2",
           "--trainer.strategy", strategy, "--model.n_future", "4", "--model.n_layers", "4",
           "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
           "--trainer.logger.init_args.save_dir", str(tmp_path / strategy),
           "--data.cache_dir", str(tmp_path / "cache"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)


def _last_ckpt(tmp_path: Path, strategy: str) -> Path:
    return next((tmp_path / strategy).rglob("last.ckpt"))


@pytest.fixture(scope="module")
def fsdp_and_ddp_runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fsdp")
    runs = {s: _mtp_fit(tmp_path, s) for s in ("fsdp", "ddp")}
    for s, proc in runs.items():
        assert proc.returncode == 0, f"mtp fit --trainer.strategy {s} failed:\n{proc.stderr}"
    return tmp_path, runs


def test_mtp_fit_fsdp_matches_ddp(fsdp_and_ddp_runs):
    """`mtp fit --trainer.strategy fsdp` on two CPU processes reaches the weights of the same run
    under DDP; its checkpoint is a full one that `load_checkpoint` reads unchanged."""
    tmp_path, runs = fsdp_and_ddp_runs
    fsdp, _ = load_checkpoint(_last_ckpt(tmp_path, "fsdp"))
    ddp, _ = load_checkpoint(_last_ckpt(tmp_path, "ddp"))
    a, b = fsdp.state_dict(), ddp.state_dict()
    dist_sq = sum((a[name] - w).pow(2).sum() for name, w in b.items())
    rel = (dist_sq / sum(w.pow(2).sum() for w in b.values())).sqrt()
    assert rel <= 1e-4, f"FSDP and DDP weights differ by a relative L2 of {rel:.2e}"
    assert "head 4: loss" in runs["fsdp"].stdout  # the fit report, from the gathered model
    # the fsdp run did shard (and the ddp one did not), so the equality above compares the two
    fsdp_log = runs["fsdp"].stdout + runs["fsdp"].stderr
    assert "FSDP2: 4 trunk blocks and 4 heads sharded over 2 ranks" in fsdp_log
    assert "FSDP2:" not in runs["ddp"].stdout + runs["ddp"].stderr


def test_fsdp_run_resumes_and_refuses_another_config(fsdp_and_ddp_runs):
    tmp_path, _ = fsdp_and_ddp_runs
    ckpt = str(_last_ckpt(tmp_path, "fsdp"))
    wrong = _mtp_fit(tmp_path, "fsdp", "--ckpt_path", ckpt, "--model.d_model", "64")
    assert wrong.returncode != 0
    assert "--model.d_model (checkpoint 32, now 64)" in wrong.stderr
    resumed = _mtp_fit(tmp_path, "fsdp", "--ckpt_path", ckpt, "--trainer.max_steps", "6")
    assert resumed.returncode == 0, resumed.stderr
    model, _ = load_checkpoint(sorted((tmp_path / "fsdp").rglob("last*.ckpt"))[-1])
    assert model.cfg.n_future == 4
