"""`mtp fit` and `mtp validate`: LightningCLI with mtp's config groups (`mtp.cli`
dispatches the other subcommands).

`mtp fit` takes five config groups, each a typed dataclass: `--model.*` (ModelConfig),
`--data.*` (DataConfig), `--optim.*` (OptimConfig), `--loss.*` (LossConfig), `--compile.*`
(CompileConfig), plus Lightning's own
`--trainer.*`; YAML files from `--config`; unknown keys are errors. With no arguments it trains the
CPU default: a K = 4 model on the Python standard library, in minutes on two cores.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from mtp.config import CompileConfig, DataConfig, LossConfig, ModelConfig, OptimConfig, RunConfig
from mtp.data import MTPDataModule, build_datamodule, unigram_entropy
from mtp.model.checkpoint import check_checkpoint_config, check_tensor_digests
from mtp.model.vocab import eot_id
from mtp.train.fault import LAST, AtomicCheckpointIO, Interruptible, Stopped
from mtp.train.log_lines import StepLines
from mtp.train.module import MTPModule, TokenizerInCheckpoint
from mtp.train.preflight import (
    check_fit_memory,
    check_room,
    lightning_refused,
    place_run,
    trainer_problems,
)
from mtp.util.atomic import DISK_ERRNOS, check_writable, os_error_of, writing
from mtp.util.errors import ConfigError, ExportError, UserError, WriteError
from mtp.util.yaml_file import check_yaml_text, read_yaml_mapping

#: Trainer settings of the CPU default run (configs/cpu.yaml spells out the same values).
TRAINER_DEFAULTS = {
    "max_steps": 400,
    "val_check_interval": 100,
    "check_val_every_n_epoch": None,
    "limit_val_batches": 10,
    "log_every_n_steps": 10,
    "gradient_clip_val": 1.0,
    "accelerator": "auto",
    "devices": 1,
    "precision": "32-true",
    "use_distributed_sampler": False,  # MTPDataModule shards its own resumable sampler
    "num_sanity_val_steps": 0,
    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
               "init_args": {"save_dir": "runs", "name": "mtp", "default_hp_metric": False}},
}


def add_run_arguments(parser: LightningArgumentParser) -> None:
    """The `trainer`, `model`, `data`, `optim`, `loss` and `compile` groups of `mtp fit`."""
    parser.add_lightning_class_args(Trainer, "trainer")
    parser.set_defaults({f"trainer.{k}": v for k, v in TRAINER_DEFAULTS.items()})
    # a bar redraws in place: on a terminal only (elsewhere StepLines prints plain lines)
    parser.set_defaults({"trainer.enable_progress_bar": sys.stdout.isatty()})
    parser.add_class_arguments(ModelConfig, "model")
    parser.add_class_arguments(DataConfig, "data")
    parser.add_class_arguments(OptimConfig, "optim")
    parser.add_class_arguments(LossConfig, "loss")
    parser.add_class_arguments(CompileConfig, "compile")


def run_config(namespace) -> RunConfig:
    """The validated RunConfig of a parsed (not yet instantiated) `mtp fit` namespace."""
    return RunConfig(model=ModelConfig(**namespace.model), data=DataConfig(**namespace.data),
                     optim=OptimConfig(**namespace.optim), loss=LossConfig(**namespace.loss),
                     compile=CompileConfig(**namespace.compile))


def default_callbacks(n_future: int, *, checkpoints: bool = True, logger: bool = True,
                      heads_only: bool = False) -> list:
    """Checkpoints (the best next-token loss, or where only heads 2..K train (`heads_only`:
    head 1 and its loss stay as they were) the most simulated tokens per forward; and
    ``last.ckpt`` at every validation whether or not it improved), learning rate, tokens per
    second and MFU,
    and plain progress lines where no progress bar is drawn on a terminal (`mtp.train.log_lines`);
    without checkpointing (`--trainer.enable_checkpointing false`) no checkpoints, and without
    a logger (`--trainer.logger false`) nothing that only logs.

    MFU needs the device's peak FLOPs, which Lightning knows for GPUs and not for CPUs.
    """
    callbacks: list = [StepLines()]
    if checkpoints:
        # NOTE: not `save_last=True`, which refreshes last.ckpt only with a new best
        best = ("val/sim_tokens_per_forward", "max") if heads_only and n_future > 1 else \
            ("val/next_token_loss", "min")
        callbacks += [ModelCheckpoint(monitor=best[0], mode=best[1], filename="best-{step}"),
                      ModelCheckpoint(filename=LAST.removesuffix(".ckpt"), save_top_k=1,
                                      enable_version_counter=False)]
    if logger:
        # items are input tokens: a window holds T inputs and K extra targets
        callbacks += [LearningRateMonitor(logging_interval="step"),
                      ThroughputMonitor(batch_size_fn=lambda batch: batch.shape[0],
                                        length_fn=lambda batch: batch.shape[1] - n_future,
                                        window_size=10)]
    return callbacks


class FSDPStrategy(ModelParallelStrategy):
    """FSDP2 over every process (no tensor parallelism), saving full (unsharded) checkpoints.

    Full checkpoints are ordinary Lightning checkpoint files:
    `mtp.model.checkpoint.load_checkpoint`, `mtp generate` and `mtp eval` read them as they read
    single-process ones, and a run resumes from them under any strategy.
    """

    strategy_name = "fsdp"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("save_distributed_checkpoint", False)
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        # The model's config is checked before the weights are loaded: a checkpoint of another
        # config would otherwise fail inside the state-dict loading, on a tensor shape.
        path = Path(checkpoint_path)
        if path.is_file():
            meta = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            check_checkpoint_config(meta, self.lightning_module.model_cfg)
            check_tensor_digests(meta, path)  # the loader below takes the weights out unchecked
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


class MTPCLI(LightningCLI):
    """LightningCLI whose groups are mtp's config dataclasses rather than class signatures;
    its trainer saves checkpoints atomically and stops cleanly on SIGINT / SIGTERM
    (`mtp.train.fault`)."""

    def __init__(self, *args, interrupt: Interruptible, ckpt_path: str | None,
                 trainer_flags: list[str], **kwargs) -> None:
        self.interrupt = interrupt
        self.ckpt_path = ckpt_path
        self.trainer_flags = trainer_flags  # the --trainer.* settings given, for messages
        super().__init__(*args, **kwargs)

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        add_run_arguments(parser)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Parse, then refuse the `--trainer.*` settings mtp cannot honour and a seed out of
        range, before LightningCLI seeds anything with it."""
        super().parse_arguments(parser, args)
        settings = self.config.get(self.config.get("subcommand"), self.config)
        problems = trainer_problems(settings.get("trainer"), settings.get("seed_everything"))
        if problems:
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))

    def instantiate_classes(self) -> None:
        # the saved config.yaml keeps the version unset: a rerun of it gets a directory of its own
        config = copy.deepcopy(self.config)
        settings = config.get(self.subcommand, config)
        place_run(settings.get("trainer"), TRAINER_DEFAULTS["logger"])
        # --trainer.fast_dev_run writes no logs or checkpoints: no folder for them either
        claimed = None if settings.get("trainer").get("fast_dev_run") else \
            _claim_log_version(settings.get("trainer"))
        self.config_init = self.parser.instantiate_classes(config)
        c = self.config_init[self.subcommand] if self.subcommand else self.config_init
        model, data = c.model, c.data
        if model.init_from is not None:  # the pretrained model's shape and tokenizer
            from mtp.interop.hf_import import pretrained_config, pretrained_tokenizer

            try:
                model = pretrained_config(model.init_from, model)
            except ExportError as e:
                raise ConfigError(str(e)) from None
            if data.tokenizer is None:
                data = dataclasses.replace(data, tokenizer=str(pretrained_tokenizer(
                    model.init_from)))
            _check_pretrained_tokenizer(Path(data.tokenizer), model)
        run = RunConfig(model=model, data=data, optim=c.optim, loss=c.loss,
                        compile=c.compile)  # cross-checks
        if self.subcommand in (None, "fit"):
            _check_max_steps(c.trainer.max_steps, run.optim)
        if self.ckpt_path:
            _check_resume_checkpoint(Path(self.ckpt_path), run.model)
        # before the model is built
        check_fit_memory(run, c.trainer, training=self.subcommand in (None, "fit"))
        if not c.trainer.fast_dev_run and self.subcommand in (None, "fit"):
            # the folder of the run's logs and checkpoints: where Lightning puts them
            folder = claimed or Path(c.trainer.default_root_dir or ".")
            check_writable(folder, "the run's folder")
            if c.trainer.enable_checkpointing is not False:
                check_room(run, c.trainer, folder)
        self.run_config = run
        try:
            self.model = MTPModule(run.model, run.optim, run.loss, run.compile)
        except ExportError as e:  # --model.init_from's weights: the message names the file
            raise ConfigError(str(e)) from None
        self.datamodule = build_datamodule(run.data, vocab_size=run.model.vocab_size,
                                           n_future=run.model.n_future,
                                           eot_token=run.model.eot_token)
        self.trainer_defaults = {**self.trainer_defaults, "callbacks": [*default_callbacks(
            run.model.n_future, checkpoints=c.trainer.enable_checkpointing is not False,
            logger=c.trainer.logger not in (False, None), heads_only=run.optim.train == "heads"),
            TokenizerInCheckpoint(self.datamodule),
            self.interrupt]}
        if c.trainer.strategy == "fsdp":  # FSDP2 on CPU and GPU alike (mtp.train.parallel)
            c.trainer.strategy = FSDPStrategy()
        try:
            self.trainer = self.instantiate_trainer()
        except (MisconfigurationException, ValueError, TypeError, ImportError) as err:
            raise lightning_refused(err, self.trainer_flags) from None
        self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        # The resume goes to the trainer here, not through LightningCLI's `--ckpt_path`, which
        # would load the whole checkpoint to read its hyperparameters back as arguments.
        self.trainer.ckpt_path = self.ckpt_path

    def after_fit(self) -> None:
        from mtp.train.parallel import full_model

        if self.interrupt.requested is not None:
            return  # `fit_main` says where the run was saved

        model = full_model(self.model.model)  # a collective under FSDP: on every rank
        if self.trainer.is_global_zero:
            report_fit(self.trainer, self.model, self.datamodule, model.to(self.model.device))


def _check_max_steps(max_steps: int | None, optim: OptimConfig) -> None:
    """Before any data is read: the run has a length, or the schedule has one.

    `--trainer.max_steps -1` (Lightning's "no limit") with `--optim.decay_steps N` trains until
    stopped (Ctrl-C or SIGTERM saves a checkpoint): the data stream has no end.
    """
    if max_steps is not None and max_steps == 0:
        raise ConfigError("--trainer.max_steps 0 trains no step; give >= 1, or -1 (no limit) "
                          "with --optim.decay_steps")
    if max_steps is not None and max_steps < -1:
        raise ConfigError(f"--trainer.max_steps must be >= 1, or -1 for no limit (got "
                          f"{max_steps})")
    if (max_steps is None or max_steps == -1) and optim.decay_steps is None:
        raise ConfigError(f"--trainer.max_steps {max_steps} (no limit) leaves the cosine "
                          "learning-rate schedule without a length: give --trainer.max_steps "
                          ">= 1, or --optim.decay_steps N to train until stopped")


def _check_resume_checkpoint(path: Path, model: ModelConfig) -> None:
    """Before any data is read: `--ckpt_path` must be an intact mtp checkpoint of this model
    config."""
    from mtp.model.checkpoint import check_checkpoint_config, check_tensor_digests, read_checkpoint

    try:
        ckpt = read_checkpoint(path, mmap=True)
        check_checkpoint_config(ckpt, model)
        check_tensor_digests(ckpt, path)  # memory-mapped: read once, nothing copied
    except (ValueError, FileNotFoundError) as err:  # InputError, MissingInput, ConfigError
        raise ConfigError(f"--ckpt_path: {err}") from None


def _check_pretrained_tokenizer(path: Path, model: ModelConfig) -> None:
    """Before any data is read: the tokenizer of an `--model.init_from` run must exist, hold the
    end-of-text token and fit the pretrained embedding."""
    from mtp.data.bpe import load_tokenizer

    if not path.exists():
        raise ConfigError(f"--data.tokenizer {path} does not exist (--model.init_from "
                          f"{model.init_from} has no tokenizer.json; pass --data.tokenizer)")
    tok = load_tokenizer(path)  # names what is not a file
    if tok.token_to_id(model.eot_token) is None:
        raise ConfigError(f"--data.tokenizer {path} has no end-of-text token "
                          f"{model.eot_token!r} (--model.eot_token), which separates documents")
    if tok.get_vocab_size() > model.vocab_size:
        raise ConfigError(f"--data.tokenizer {path} has {tok.get_vocab_size()} tokens but the "
                          f"embedding of --model.init_from {model.init_from} has "
                          f"{model.vocab_size} rows")


def report_fit(trainer, module: MTPModule, dm: MTPDataModule, model) -> None:
    """Print per-head validation loss, a sampled code snippet, and where the results are."""
    metrics = trainer.callback_metrics
    K = module.model_cfg.n_future
    print("\nvalidation loss per head (nats; head i predicts the token i ahead):")
    for i in range(1, K + 1):
        loss, acc = metrics.get(f"val/loss_head{i}"), metrics.get(f"val/acc_head{i}")
        if loss is not None:
            print(f"  head {i}: loss {float(loss):.3f}  top-1 accuracy {float(acc):.3f}")
    entropy = unigram_entropy(dm.val_tokens, dm.tokenizer.get_vocab_size())
    print(f"  unigram entropy of the validation tokens: {entropy:.3f} nats")
    from mtp.decoding.generation import generate

    prompt = "def fibonacci(n):\n"
    model.eval()
    # sampled, not greedy: greedy decoding of a model this small loops on one line
    new, _ = generate(model, [dm.tokenizer.encode(prompt).ids], 64, decoder="sample",
                      temperature=0.7, top_p=0.95, eot_id=eot_id(dm.tokenizer, model.cfg),
                      generator=torch.Generator(module.device).manual_seed(0))
    print(f"\nsample (temperature 0.7, top-p 0.95):\n{prompt}{dm.tokenizer.decode(new[0])}\n")
    ckpt = trainer.checkpoint_callback
    if ckpt is not None and ckpt.dirpath and (Path(ckpt.dirpath) / LAST).is_file():
        best = f", {ckpt.best_model_path} (best)" if ckpt.best_model_path else ""
        print(f"checkpoints: {Path(ckpt.dirpath) / LAST} (last){best}")
    log_dir = getattr(trainer.logger, "log_dir", None)  # none under --trainer.fast_dev_run
    if log_dir:
        print(f"TensorBoard: tensorboard --logdir {Path(log_dir).parent}")


def _take_ckpt_path(argv: list[str]) -> tuple[list[str], str | None]:
    """`argv` without its `--ckpt_path X` (or `--ckpt_path=X`), and X: `MTPCLI` checks the
    checkpoint before any data is read and hands it to the trainer itself."""
    rest, path, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--ckpt_path":
            if i + 1 >= len(argv):
                raise ConfigError("--ckpt_path needs a checkpoint file")
            path, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--ckpt_path="):
            path = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return rest, path or None


def _check_config_files(argv: list[str]) -> None:
    """Each `--config FILE` is a readable YAML mapping, or an error names the file and line
    (LightningCLI's own message shows neither); a resume is a command-line flag, not a
    setting of a config file."""
    for i, arg in enumerate(argv):
        value = None
        if arg in ("-c", "--config") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        if value is not None and (Path(value).exists() or value.endswith((".yaml", ".yml"))):
            data = read_yaml_mapping(value, f"--config {value}")
            if "ckpt_path" in data or any(isinstance(data.get(cmd), dict) and "ckpt_path"
                                          in data[cmd] for cmd in ("fit", "validate")):
                raise ConfigError(f"--config {value}: ckpt_path belongs on the command line "
                                  "(--ckpt_path FILE), not in a config file")


def _trainer_flags(argv: list[str]) -> list[str]:
    """The `--trainer.*` settings given on the command line and in `--config` files, as
    `--trainer.key value`, for messages about them."""
    given, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--trainer."):
            flag, eq, value = arg.partition("=")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            given.append(f"{flag} {value}".strip())
        elif arg in ("-c", "--config") and i + 1 < len(argv) and Path(argv[i + 1]).is_file():
            trainer = read_yaml_mapping(argv[i + 1], f"--config {argv[i + 1]}").get("trainer")
            if isinstance(trainer, dict):
                given += [f"--trainer.{k} {v}" for k, v in trainer.items()]
        i += 1
    return given


def _check_yaml_values(argv: list[str]) -> None:
    """LightningCLI reads every value of the command line as YAML too: one whose aliases expand
    past the bound of `mtp.util.yaml_file` is refused, naming its flag."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not eq:
            flag, value = (argv[i - 1], arg) if i and argv[i - 1].startswith("--") else ("", "")
        if value:
            check_yaml_text(value, flag)


def fit_main(argv: list[str]) -> int:
    """`mtp fit|validate ...`: LightningCLI with mtp's config groups. A write that fails where
    Lightning or a logger writes (a full disk, a read-only folder, a quota) is named with the
    run's folder, and settings Lightning refuses once training starts are named with the
    `--trainer.*` flags given; both exit 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    _check_config_files(argv)
    _check_yaml_values(argv)
    lightning_argv, ckpt_path = _take_ckpt_path(argv)
    # the arguments are given on purpose (without --ckpt_path), also when they came from the
    # command line: LightningCLI's warning about args beside sys.argv does not apply
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    interrupt = Interruptible(argv)
    interrupt.install()  # from here on, SIGINT / SIGTERM stop the run where it is (mtp.train.fault)
    trainer_flags = _trainer_flags(lightning_argv)
    try:
        MTPCLI(
            interrupt=interrupt,
            ckpt_path=ckpt_path,
            trainer_flags=trainer_flags,
            model_class=MTPModule,
            datamodule_class=MTPDataModule,
            args=lightning_argv,
            seed_everything_default=1234,
            trainer_defaults=TRAINER_DEFAULTS,
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "mtp", "description": __doc__, "allow_abbrev": False},
        )
    except Stopped:
        pass  # the signal's stage decides what was kept: `report` says it
    except MisconfigurationException as err:  # settings Lightning refuses once training starts
        raise lightning_refused(err, trainer_flags) from None
    except Exception as err:
        found = os_error_of(err)
        if isinstance(err, UserError) or found is None or found.errno not in DISK_ERRNOS:
            raise
        where = found.filename or interrupt.folder or "the run's folder"
        raise WriteError(where, "the run's logs or checkpoints", found.errno,
                         found.strerror) from err
    finally:
        interrupt.uninstall()
    return interrupt.report() or 0


def _claim_log_version(trainer) -> Path | None:
    """Give the run's TensorBoard or CSV logger a ``version_N`` directory of its own, claimed
    with an atomic mkdir: left to themselves, two runs started at once in one directory both
    take max(existing) + 1 and write into each other's logs and checkpoints. Returns the
    directory (None for other ranks, other loggers, a version given); a folder that cannot be
    made (read-only, full) is named."""
    logger = trainer.get("logger") if trainer is not None else None
    if rank_zero_only.rank != 0 or not hasattr(logger, "init_args") or \
            logger.class_path.rsplit(".", 1)[-1] not in ("TensorBoardLogger", "CSVLogger") or \
            logger.init_args.get("version") is not None:
        return None
    args = logger.init_args
    root = Path(args.get("save_dir") or ".") / (args.get("name") or "")
    if "://" in str(root):
        return None
    with writing(root, "the folder of the run's logs and checkpoints"):
        root.mkdir(parents=True, exist_ok=True)
        taken = [int(d.name[8:]) for d in root.glob("version_*") if d.name[8:].isdigit()]
        n = max(taken, default=-1) + 1
        while True:
            try:
                (root / f"version_{n}").mkdir()
                break
            except FileExistsError:
                n += 1
    args.version = n
    return root / f"version_{n}"
