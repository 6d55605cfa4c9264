"""Reading and writing mtp checkpoints without Lightning.

A checkpoint is a Lightning checkpoint whose `state_dict` holds the model under the `model.`
prefix and whose `mtp` entry carries what inference needs: the model config and the tokenizer
(as its JSON string), so a checkpoint alone is enough to generate or evaluate.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

from mtp.config import ConfigError, InputError, MissingInput, ModelConfig
from mtp.model import MTPTransformer
from mtp.vocab import check_vocab

#: The default end-of-text token (`ModelConfig.eot_token`), which mtp's own tokenizers hold.
EOT_TOKEN = ModelConfig.eot_token
STATE_PREFIX = "model."


def mtp_metadata(cfg: ModelConfig, tokenizer: Tokenizer) -> dict:
    """The `mtp` entry of a checkpoint."""
    return {"model_config": dataclasses.asdict(cfg), "tokenizer": tokenizer.to_str()}


def save_checkpoint(path: str | os.PathLike, model: MTPTransformer, tokenizer: Tokenizer) -> None:
    """Write a minimal checkpoint (weights, config, tokenizer) readable by `load_checkpoint`.

    Written to a temporary file and renamed, so an interrupted save never corrupts `path`.
    """
    path = Path(path)
    state = {STATE_PREFIX + k: v for k, v in model.state_dict().items()}
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"state_dict": state, "mtp": mtp_metadata(model.cfg, tokenizer)}, tmp)
    os.replace(tmp, path)


def read_checkpoint(path: str | os.PathLike, *, mmap: bool = False) -> dict:
    """The raw dict of an mtp checkpoint file, on the CPU (`mmap`: memory-mapped, so reading
    only its config costs no more than the header).

    Raises:
        MissingInput: If the file does not exist.
        InputError: If torch cannot read it, or it is not a checkpoint of `mtp fit`.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises KeyError, UnpicklingError, RuntimeError ... here
        raise InputError(f"{path} is not a checkpoint torch can read ({type(err).__name__}: "
                         f"{err})") from err
    if not isinstance(ckpt, dict) or "mtp" not in ckpt or "state_dict" not in ckpt:
        raise InputError(f"{path} is not an mtp checkpoint (no 'mtp' entry with config and "
                         "tokenizer)")
    return ckpt


def load_checkpoint(
    path: str | os.PathLike, *, device: str | torch.device = "cpu"
) -> tuple[MTPTransformer, Tokenizer]:
    """The model (in eval mode, on `device`) and tokenizer stored in a checkpoint, or in a
    directory written by `mtp export hf` (`mtp.hf.load_export`)."""
    path = Path(path)
    if path.is_dir():
        from mtp.hf import load_export

        model, tokenizer = load_export(path)
        return model.to(device), tokenizer
    ckpt = read_checkpoint(path)
    cfg = ModelConfig(**ckpt["mtp"]["model_config"])
    tokenizer = Tokenizer.from_str(ckpt["mtp"]["tokenizer"])
    model = MTPTransformer(cfg)
    state = {k[len(STATE_PREFIX):]: v for k, v in ckpt["state_dict"].items()
             if k.startswith(STATE_PREFIX)}
    model.load_state_dict(state)
    check_vocab(tokenizer, cfg, source=str(path))
    return model.to(device).eval(), tokenizer


def check_checkpoint_config(checkpoint: dict, model_cfg: ModelConfig) -> None:
    """Raise if a checkpoint was trained with another model config, naming each flag."""
    saved_cfg = checkpoint.get("mtp", {}).get("model_config", {})
    ours = dataclasses.asdict(model_cfg)
    differ = [f"--model.{k} (checkpoint {saved_cfg[k]!r}, now {ours[k]!r})"
              for k in ours if k in saved_cfg and saved_cfg[k] != ours[k]]
    if differ:
        raise ConfigError("the checkpoint was trained with another model config: "
                         + ", ".join(differ))
