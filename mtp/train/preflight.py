"""What `mtp fit` checks before it builds anything, and where its run goes.

- Lightning's own `--trainer.*` flags, each honoured or refused with the reason (the table in
  docs/faults.md): `--trainer.default_root_dir` decides where the run's logs and checkpoints go,
  as Lightning documents it (`place_run`); the settings mtp would otherwise override or undo are
  refused (`trainer_problems`); what Lightning itself refuses is said in one line naming the
  flags given (`lightning_refused`).
- The memory the run needs against the memory of the device it trains on
  (`check_fit_memory`, `mtp.model.memory`), and the room its checkpoints need on the disk of
  its folder (`check_room`), with the estimates in the message.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from mtp.config import ModelConfig, RunConfig, seed_problem
from mtp.model.memory import MemoryNeed, check_memory, format_bytes, training_need
from mtp.util.environment import available_memory, current_rss, free_disk
from mtp.util.errors import ConfigError

__all__ = ["check_fit_memory", "check_room", "lightning_refused", "place_run",
           "trainer_problems"]

#: The folder, under `--trainer.default_root_dir` (default: the working directory), of mtp's
#: default TensorBoard logger: runs go to `<default_root_dir>/runs/mtp/version_N`.
RUNS = "runs"


def place_run(trainer, default_logger: dict) -> None:
    """Put the run under `--trainer.default_root_dir` (in the parsed, not yet instantiated,
    trainer settings): mtp's default logger, which sets its own folder, writes to
    `<default_root_dir>/runs` instead of `./runs`; checkpoints follow the logger's folder
    (Lightning's rule), or go to `<default_root_dir>/checkpoints` without a logger. A logger
    the user configured keeps its own `save_dir`, as in Lightning."""
    root = trainer.get("default_root_dir")
    logger = trainer.get("logger")
    if root is None or not hasattr(logger, "init_args"):
        return
    default_args = default_logger["init_args"]
    if logger.class_path == default_logger["class_path"] and \
            logger.init_args.get("save_dir") == default_args["save_dir"]:
        logger.init_args.save_dir = str(Path(root) / RUNS)


def trainer_problems(trainer, seed_everything) -> list[str]:
    """The `--trainer.*` settings (parsed, not instantiated) and `--seed_everything` that mtp
    refuses, each with the reason."""
    problems = []
    if str(trainer.get("precision")) == "16-true":
        problems.append("--trainer.precision 16-true: float16 weights train to NaN (AdamW's eps "
                        "of 1e-8 and the squares of small gradients underflow in float16); use "
                        "bf16-true, or 16-mixed or bf16-mixed, which keep float32 weights")
    if trainer.get("use_distributed_sampler"):
        problems.append("--trainer.use_distributed_sampler true: mtp's DataModule gives each "
                        "rank its own share of a resumable window order itself; Lightning's "
                        "sampler would split it again (each rank would see a fraction of its "
                        "share) and break the resume; leave it false")
    plugins = trainer.get("plugins")
    for plugin in plugins if isinstance(plugins, list) else [plugins] if plugins else []:
        name = getattr(plugin, "class_path", plugin if isinstance(plugin, str) else "")
        if isinstance(name, str) and name.rsplit(".", 1)[-1].endswith("CheckpointIO"):
            problems.append(f"--trainer.plugins {name}: mtp writes checkpoints through its own "
                            "AtomicCheckpointIO (temporary file, fsync, rename), which a "
                            "checkpoint plugin would replace or be replaced by; leave it out")
    if not isinstance(seed_everything, bool) and seed_everything is not None:
        problem = seed_problem("--seed_everything", seed_everything)
        if problem:
            problems.append(problem)
    return problems


#: The `--trainer.*` settings that decide how the `Trainer` is built, which Lightning may refuse
#: (named in its refusal when given).
_BUILD = ("accelerator", "devices", "num_nodes", "strategy", "precision", "plugins", "barebones",
          "fast_dev_run", "logger", "callbacks", "enable_checkpointing", "enable_progress_bar",
          "enable_model_summary", "profiler", "detect_anomaly", "sync_batchnorm")


def lightning_refused(err: Exception, given: list[str]) -> ConfigError:
    """Lightning's refusal of the trainer's settings, raised while the `Trainer` is built (an
    accelerator that is not there, devices it cannot use, settings that exclude each other),
    as one line naming those of the `--trainer.*` settings `given` that build it."""
    latest = {flag.split()[0]: flag for flag in given}  # the last value of each, as parsed
    named = [f for key, f in latest.items() if key.removeprefix("--trainer.") in _BUILD]
    flags = f" ({', '.join(named)})" if named else ""
    # an object's repr names its class: `<...TensorBoardLogger object at 0x7f...>`
    message = re.sub(r"<([\w.]+) object at 0x[0-9a-f]+>",
                     lambda m: m[1].rsplit(".", 1)[-1], " ".join(str(err).split()))
    return ConfigError(f"Lightning's Trainer refuses the --trainer.* settings{flags}: "
                       f"{message or type(err).__name__}")


def _precision_bytes(precision) -> tuple[int, int]:
    """Bytes of a parameter and of an activation under `--trainer.precision`."""
    p = str(precision)
    if p.startswith("64"):
        return 8, 8
    if p.startswith(("16", "bf16", "transformer-engine")):
        return (2 if p.endswith("-true") else 4), 2
    return 4, 4


def _devices(trainer) -> tuple[str, int]:
    """The device kind a run trains on (`cpu` or `cuda`) and how many processes it runs."""
    import torch

    accelerator = trainer.get("accelerator")
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.lower()
    cuda = torch.cuda.is_available() and (name in ("gpu", "cuda", "auto") or "cuda" in name)
    devices = trainer.get("devices")
    count = torch.cuda.device_count() if cuda else os.cpu_count() or 1
    if isinstance(devices, (list, tuple)):
        n = len(devices)
    elif isinstance(devices, str) and "," in devices:
        n = len([d for d in devices.split(",") if d.strip()])
    else:
        try:
            n = int(devices)
        except (TypeError, ValueError):  # "auto"
            n = count if cuda else 1
        n = count if n == -1 else n
    return ("cuda" if cuda else "cpu"), max(n, 1) * max(int(trainer.get("num_nodes") or 1), 1)


def _need(run: RunConfig, trainer,
          shards: int) -> Callable[[ModelConfig, dict[str, int]], MemoryNeed]:
    """The training estimate of `run` under the trainer's precision, as `check_memory` takes
    it: of a model config and the data sizes by flag."""
    param_bytes, activation_bytes = _precision_bytes(trainer.get("precision"))

    def need(cfg, sizes: dict[str, int]) -> MemoryNeed:
        return training_need(cfg, batch_size=sizes["--data.batch_size"],
                             seq_len=sizes["--data.seq_len"],
                             naive=run.loss.strategy == "naive",
                             heads_only=run.optim.train == "heads",
                             trunk_cache_bytes=run.optim.trunk_cache_mb << 20,
                             param_bytes=param_bytes, activation_bytes=activation_bytes,
                             shards=shards)
    return need


def check_fit_memory(run: RunConfig, trainer, *, training: bool = True) -> None:
    """Refuse a run whose model, optimiser state and one step need more memory than the device
    it trains on has available (`mtp.model.memory.training_need`), before anything is built;
    without `training` (`mtp validate`), the model and one step without gradients or optimiser
    state. Under FSDP (`--trainer.strategy fsdp`) the weights and optimiser state are split over
    the devices; on the CPU every process of the run holds its share and itself in the
    machine's memory."""
    kind, processes = _devices(trainer)
    strategy = trainer.get("strategy")
    fsdp = isinstance(strategy, str) and strategy.startswith("fsdp") or \
        "FSDP" in type(strategy).__name__
    sizes = {"--data.batch_size": run.data.batch_size, "--data.seq_len": run.data.seq_len}
    doing = "training" if training else "validation"
    if run.model.init_from is not None:
        doing += f" (the shape of --model.init_from {run.model.init_from})"
    shared = kind == "cpu" and processes > 1  # the processes share the machine's memory
    if shared:
        sizes["--trainer.devices"] = processes
        doing += f" in {processes} processes"
    base = current_rss()  # what each further process holds before it builds anything

    def need(cfg: ModelConfig, sizes: dict[str, int]) -> MemoryNeed:
        n = sizes.get("--trainer.devices", 1)
        one = _need(run, trainer, (n if shared else processes) if fsdp else 1)(cfg, sizes)
        if not training:  # no gradients, no optimiser state
            one = MemoryNeed({k: v for k, v in one.parts.items()
                              if k not in ("gradients", "AdamW state")})
        if n == 1:
            return one
        return MemoryNeed({**{k: v * n for k, v in one.parts.items()},
                           "the other processes themselves": base * (n - 1)})

    check_memory(need, run.model, sizes, available_memory(kind), doing=doing,
                 where="on the CPU" if kind == "cpu" else "on cuda:0")


def check_room(run: RunConfig, trainer, folder: Path) -> None:
    """Refuse a run whose checkpoints cannot fit on the disk of `folder`: a checkpoint (the
    weights and AdamW's moments) is written whole beside the last one before that one goes, so
    two must fit."""
    free = free_disk(folder)
    if free is None:
        return
    parts = _need(run, trainer, 1)(run.model, {"--data.batch_size": 1,
                                               "--data.seq_len": 1}).parts
    one = parts["weights"] + parts["AdamW state"]
    if free < 2 * one:
        raise ConfigError(f"{folder}: {format_bytes(free)} free on its disk, but a checkpoint of "
                          f"this model takes about {format_bytes(one)} and a new one is written "
                          f"beside the last ({format_bytes(2 * one)}); choose a folder with room "
                          f"(--trainer.default_root_dir)")
