"""The LightningModule: the step, the optimiser and schedule, per-head metrics. Nothing else."""

from __future__ import annotations

import dataclasses
import math

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from mtp.config import CompileConfig, LossConfig, ModelConfig, OptimConfig
from mtp.model.checkpoint import check_checkpoint_config, check_tensor_digests
from mtp.model.transformer import MTPTransformer, build_model
from mtp.train.frozen_trunk import FrozenTrunk
from mtp.train.loss import (
    HeadsLoss,
    frozen_trunk_path,
    heads_loss,
    mtp_loss,
    scheduled_head_weights,
    simulated_acceptance,
    soft_sequential_path,
)
from mtp.train.targets import FrozenTeacher, mtp_inputs_targets, self_targets
from mtp.util.digests import DIGESTS, tensor_digests
from mtp.util.errors import ConfigError


class MTPModule(L.LightningModule):
    """Trains an `MTPTransformer` on windows of seq_len + K tokens."""

    def __init__(self, model: ModelConfig, optim: OptimConfig, loss: LossConfig,
                 compile: CompileConfig | None = None) -> None:
        super().__init__()
        compile = compile or CompileConfig()
        # Plain dicts in the checkpoint: it then loads with `weights_only=True`.
        self.save_hyperparameters({"model": dataclasses.asdict(model),
                                   "optim": dataclasses.asdict(optim),
                                   "loss": dataclasses.asdict(loss),
                                   "compile": dataclasses.asdict(compile)})
        self.model_cfg, self.optim_cfg, self.loss_cfg = model, optim, loss
        self.model: MTPTransformer = build_model(model)
        if model.init_from is not None:  # config from `mtp.interop.hf_import.pretrained_config`
            from mtp.interop.hf_import import init_from_pretrained

            init_from_pretrained(self.model)
        # joint training against the distributions of the model as it starts (Medusa-2)
        self.teacher = FrozenTeacher(self.model) if loss.soft_targets and \
            optim.train == "all" else None
        if compile.enabled:
            compile_blocks(self.model, compile.mode)
        self.flops_per_batch: float | None = None  # read by Lightning's ThroughputMonitor
        self.trunk_cache: FrozenTrunk | None = None  # see `frozen_trunk`

    # -- the step --------------------------------------------------------------------------
    def inputs_targets(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (B, T) and targets (K, B, T) of windows (B, T + K): the data's tokens, or the
        model's own under `--loss.targets self` or `greedy`."""
        inputs, targets = mtp_inputs_targets(window, self.model_cfg.n_future)
        if self.loss_cfg.targets != "data":
            targets = self_targets(self.model, window,
                                   on_greedy_path=self.loss_cfg.targets == "greedy")
        return inputs, targets

    def frozen_trunk(self) -> FrozenTrunk | None:
        """The cache of the frozen trunk's outputs under `--optim.train heads`, None otherwise.
        Sharded runs recompute the trunk: FSDP gathers the root unit (embedding, norm,
        unembedding) only in the model's own forward, which the cache does not call."""
        if self.optim_cfg.train != "heads" or self.device_mesh is not None:
            return None
        if self.trunk_cache is None:
            self.trunk_cache = FrozenTrunk(self.model, targets=self.loss_cfg.targets,
                                           max_bytes=self.optim_cfg.trunk_cache_mb << 20,
                                           folder=self.optim_cfg.trunk_cache_dir)
        return self.trunk_cache

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Trunk forward, the heads' losses, and (Lightning, on the returned loss) the backward.

        The `sequential` path runs each head's backward inside the forward (`mtp.train.loss`),
        so the backward of the returned loss is the trunk's; the `naive` path leaves the heads'
        backward to it too. Frozen-trunk training reads the trunk's output back instead of
        running it, and has no trunk backward.
        """
        if self.flops_per_batch is None:
            T = batch.shape[1] - self.model_cfg.n_future
            self.flops_per_batch = self.model.flops_per_token(T) * batch.shape[0] * T
        weights = scheduled_head_weights(self.loss_cfg, self.model_cfg.n_future,
                                         self.global_step)
        # accuracy costs the sequential path a matmul per head: only on the steps Lightning
        # writes to the logger, so no stale value from an earlier step is written under a later
        with_accuracy = (self.global_step + 1) % self.trainer.log_every_n_steps == 0
        if (frozen := self.frozen_trunk()) is not None:
            h, rope, targets = frozen(batch)
            path = frozen_trunk_path(self.loss_cfg.soft_targets, self.loss_cfg.feature_weight)
            out = heads_loss(self.model, h, rope, targets, weights, path=path,
                             with_accuracy=with_accuracy)
        else:
            # the trunk and the heads in one forward of the model: FSDP gathers its root unit
            # there and only there (`MTPTransformer.forward`, `heads_fn`)
            inputs, targets = self.inputs_targets(batch)
            path = self.loss_cfg.strategy if self.teacher is None else \
                soft_sequential_path(self.teacher(inputs))
            out = mtp_loss(self.model, inputs, targets, weights, path=path,
                           with_accuracy=with_accuracy)
        self.log("train/loss", out.loss, prog_bar=True)
        if self.loss_cfg.schedule != "constant":
            self.log_dict({f"train/head_weight{i + 1}": w for i, w in enumerate(weights)})
        self._log_heads("train", out)
        return out.loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        # per-head loss and accuracy without gradients, chunked over the vocabulary whatever
        # path trains
        out = mtp_loss(self.model, *self.inputs_targets(batch), self.loss_cfg.head_weights,
                       path="metrics")
        self.log("val/loss", out.loss, sync_dist=True)
        # head 1 is the next-token loss, the number comparable across K and with other models
        self.log("val/next_token_loss", out.head_losses[0], prog_bar=True, sync_dist=True)
        self._log_heads("val", out, sync_dist=True)
        if self.model_cfg.n_future > 1:
            # what the heads are worth for decoding, read without decoding
            rates = simulated_acceptance(self.model, batch)
            self.log_dict({f"val/sim_accept_draft{d}": r for d, r in enumerate(rates, 1)},
                          sync_dist=True)
            self.log("val/sim_tokens_per_forward", 1 + rates.sum(), sync_dist=True)

    def _log_heads(self, stage: str, out: HeadsLoss, **kw) -> None:
        """Each head's loss and accuracy, keyed by its 1-based name (`loss_head1` is head
        index 0's)."""
        names = range(out.first + 1, out.first + 1 + len(out.head_losses))
        metrics = {f"{stage}/loss_head{n}": v for n, v in zip(names, out.head_losses)}
        if out.head_accuracies is not None:
            metrics |= {f"{stage}/acc_head{n}": v for n, v in zip(names, out.head_accuracies)}
        if out.feature_losses is not None:
            metrics |= {f"{stage}/feature_loss_head{n}": v
                        for n, v in zip(names, out.feature_losses)}
        self.log_dict(metrics, **kw)

    def setup(self, stage: str) -> None:
        """The draft vocabulary (`--model.draft_vocab`): the most frequent tokens of the
        training data. A resumed run then loads the checkpoint's own over it."""
        dm = self.trainer.datamodule if self.trainer is not None else None
        if stage == "fit" and self.model_cfg.draft_vocab and dm is not None:
            ids = dm.most_frequent(self.model_cfg.draft_vocab)
            self.model.draft_ids.copy_(torch.from_numpy(ids))

    def configure_model(self) -> None:
        """Shard the model with FSDP2 when the strategy provides a device mesh (`--trainer.strategy
        fsdp`, see `mtp.train.parallel`); under any other strategy this does nothing."""
        if self.device_mesh is None:
            return
        from torch.distributed.tensor import DTensor

        from mtp.train.parallel import shard_model

        if isinstance(self.model.embed.weight, DTensor):  # sharded already (a second fit)
            return
        precision = str(self.trainer.precision)
        param_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        mesh = self.device_mesh["data_parallel"]
        shard_model(self.model, mesh, param_dtype=param_dtype)
        rank_zero_info(f"FSDP2: {len(self.model.blocks)} trunk blocks and {len(self.model.heads)} "
                       f"heads sharded over {mesh.size()} ranks")

    # -- optimisation ----------------------------------------------------------------------
    def _param_groups(self) -> list[dict]:
        """AdamW's parameter groups: new heads or pretrained part, decayed or not."""
        o = self.optim_cfg
        new = {id(p) for head in self.model.heads[1:] for p in head.parameters()}
        groups: dict[tuple[bool, bool], list] = {}
        embeddings = {id(self.model.embed.weight)}
        for p in self.model.parameters():
            if id(p) not in new and o.train == "heads":
                p.requires_grad_(False)  # frozen-trunk training: the base model stays as it is
                continue
            # Norm gains and biases are 1-D; embeddings are lookups: decaying either only hurts.
            decays = p.dim() >= 2 and id(p) not in embeddings
            groups.setdefault((id(p) in new, decays), []).append(p)
        return [{"params": params, "weight_decay": o.weight_decay if decays else 0.0,
                 "lr": o.lr if is_new else o.lr * o.pretrained_lr_scale, "new": is_new}
                for (is_new, decays), params in groups.items()]

    def _lr_factors(self, groups: list[dict]) -> list:
        """Each parameter group's schedule: warmup then cosine, for the pretrained part
        starting after `--optim.pretrained_delay_steps` steps at rate 0."""
        o = self.optim_cfg
        total = o.decay_steps or self.trainer.max_steps
        delay = o.pretrained_delay_steps

        def new(step: int) -> float:
            return lr_factor(step, o.warmup_steps, total, o.min_lr_ratio)

        def pretrained(step: int) -> float:
            if step < delay:
                return 0.0
            return lr_factor(step - delay, o.warmup_steps, max(1, total - delay), o.min_lr_ratio)

        return [new if g["new"] else pretrained for g in groups]

    def configure_optimizers(self):
        o = self.optim_cfg
        groups = self._param_groups()
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=None)
        total = o.decay_steps or self.trainer.max_steps
        if total is None or total < 1:
            raise ConfigError(f"--trainer.max_steps {self.trainer.max_steps} gives the cosine "
                              "schedule no length: set --trainer.max_steps >= 1 or "
                              "--optim.decay_steps")
        if o.pretrained_delay_steps >= total:
            raise ConfigError(f"--optim.pretrained_delay_steps {o.pretrained_delay_steps} leaves "
                              f"the pretrained part no step of the {total} the schedule has")
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factors(groups))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_start(self) -> None:
        """A run resumed with other `--optim.*` values trains with them: the restored
        optimiser and schedule would otherwise keep the checkpoint's (the schedule's shape,
        warmup and decay, follows the config anyway)."""
        changed = getattr(self, "_resumed_optim", None)
        if not changed:
            return
        o = self.optim_cfg
        optimizer = self.optimizers().optimizer
        scheduler = self.lr_schedulers()
        wanted = self._param_groups()
        for group, want in zip(optimizer.param_groups, wanted):
            group.update(initial_lr=want["lr"], weight_decay=want["weight_decay"],
                         betas=o.betas, eps=o.eps, new=want["new"])
        scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        scheduler.lr_lambdas = self._lr_factors(wanted)
        for group, lr, factor in zip(optimizer.param_groups, scheduler.base_lrs,
                                     scheduler.lr_lambdas):
            group["lr"] = lr * factor(scheduler.last_epoch)
        rank_zero_info("resumed with other optimiser settings, now applied: " + ", ".join(
            f"--optim.{k} (checkpoint {a!r}, now {b!r})" for k, (a, b) in changed.items()))

    # -- checkpoints carry what inference needs (the tokenizer: `TokenizerInCheckpoint`) -----
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        mtp = checkpoint.setdefault("mtp", {})
        mtp["model_config"] = dataclasses.asdict(self.model_cfg)
        mtp[DIGESTS] = tensor_digests(checkpoint["state_dict"])

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_checkpoint_config(checkpoint, self.model_cfg)
        check_tensor_digests(checkpoint, self.trainer.ckpt_path if self._trainer else "")
        saved = checkpoint.get("hyper_parameters", {}).get("optim", {})
        ours = dataclasses.asdict(self.optim_cfg)
        if "train" in saved and saved["train"] != ours["train"]:
            raise ConfigError(f"the checkpoint trained --optim.train {saved['train']}, now "
                             f"{ours['train']}: that changes which parameters the optimiser "
                             f"holds, so its state cannot carry over; resume with --optim.train "
                             f"{saved['train']}")
        self._resumed_optim = {k: (saved[k], v) for k, v in ours.items()
                               if k in saved and saved[k] != v and k != "train"}


class TokenizerInCheckpoint(L.Callback):
    """Writes the tokenizer of `datamodule` into every checkpoint, beside the model config that
    `MTPModule` writes, so that a checkpoint alone can generate (`mtp.model.checkpoint`); a resume
    from a checkpoint made with another tokenizer is refused. `mtp fit` adds it; the module
    itself knows no tokenizer."""

    def __init__(self, datamodule) -> None:
        self.datamodule = datamodule

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint.setdefault("mtp", {})["tokenizer"] = self.datamodule.tokenizer.to_str()

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        ours, saved = self.datamodule.tokenizer, checkpoint.get("mtp", {}).get("tokenizer")
        if ours is not None and saved is not None and saved != ours.to_str():
            raise ConfigError(
                "the checkpoint was trained with a different tokenizer than --data gives now "
                f"(checkpoint vocabulary: {_vocab_size(saved)}, data tokenizer: "
                f"{ours.get_vocab_size()}); resume with the same --data.source and "
                "--data.tokenizer"
            )


def compile_blocks(model: MTPTransformer, mode: str = "default") -> None:
    """`torch.compile` every trunk block and head in place (`nn.Module.compile`, so parameter
    names and checkpoints are those of the eager model). Under FSDP the blocks are compiled
    inside their sharded units, as torchtitan does; the sequential pass calls sharded heads'
    `forward` directly, so those run eager."""
    for block in [*model.blocks, *model.heads]:
        block.compile(mode=mode)


def _vocab_size(tokenizer_json: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).get_vocab_size()


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total`, flat after."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
