"""Reading and writing mtp checkpoints without Lightning.

A checkpoint is a Lightning checkpoint whose `state_dict` holds the model under the `model.`
prefix and whose `mtp` entry carries what inference needs: the model config and the tokenizer
(as its JSON string), so a checkpoint alone is enough to generate or evaluate; and a sha256 of
each tensor of `state_dict`, checked on load, since torch checks no checksum of its zip members
(bytes flipped inside a tensor would otherwise load, and decode, silently). A checkpoint
written before the digests loads unchecked.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

from mtp.atomic import atomic_write
from mtp.config import ConfigError, InputError, MissingInput, ModelConfig
from mtp.digests import DIGESTS, digest_mismatch, tensor_digests
from mtp.model import MTPTransformer
from mtp.vocab import check_vocab

#: The default end-of-text token (`ModelConfig.eot_token`), which mtp's own tokenizers hold.
EOT_TOKEN = ModelConfig.eot_token
STATE_PREFIX = "model."


def mtp_metadata(cfg: ModelConfig, tokenizer: Tokenizer) -> dict:
    """The `mtp` entry of a checkpoint (without the digests of its tensors)."""
    return {"model_config": dataclasses.asdict(cfg), "tokenizer": tokenizer.to_str()}


def check_tensor_digests(ckpt: dict, path: str | os.PathLike) -> None:
    """Raise, naming the file and the tensors, if a checkpoint's tensors differ from the
    digests it records (a checkpoint without digests passes: it was written before them)."""
    want = ckpt.get("mtp", {}).get(DIGESTS)
    if want is None or "state_dict" not in ckpt:  # (FSDP's loader takes it out, checked then)
        return
    problem = digest_mismatch(want, ckpt["state_dict"], f"checkpoint {path}")
    if problem:
        raise InputError(problem)


def save_checkpoint(path: str | os.PathLike, model: MTPTransformer, tokenizer: Tokenizer) -> None:
    """Write a minimal checkpoint (weights, config, tokenizer) readable by `load_checkpoint`.

    Written atomically (`mtp.atomic`), so an interrupted save never corrupts `path`.
    """
    state = {STATE_PREFIX + k: v for k, v in model.state_dict().items()}
    meta = {**mtp_metadata(model.cfg, tokenizer), DIGESTS: tensor_digests(state)}
    atomic_write(path, lambda tmp: torch.save({"state_dict": state, "mtp": meta}, tmp))


def read_checkpoint(path: str | os.PathLike, *, mmap: bool = False) -> dict:
    """The raw dict of an mtp checkpoint file, on the CPU (`mmap`: memory-mapped, so reading
    only its config costs no more than the header).

    Raises:
        MissingInput: If the file does not exist.
        InputError: If it is a directory (an export, say), torch cannot read it, or it is not a
            checkpoint of `mtp fit`.
    """
    path = Path(path)
    if path.is_dir():
        from mtp.hf import MTP_CONFIG, is_export

        if is_export(path):
            raise InputError(f"{path} is an export directory (`mtp export hf`): its weights "
                             "generate and evaluate, but it holds no optimiser state or step "
                             "to resume training from; pass a .ckpt file of `mtp fit`")
        raise InputError(f"{path} is a directory, neither a checkpoint file nor an mtp export "
                         f"(no {MTP_CONFIG})")
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
        from mtp.hf import ExportError, load_export

        try:
            model, tokenizer = load_export(path)
        except ExportError as err:  # names the directory: a user's input, not a bug
            raise InputError(str(err)) from None
        return model.to(device), tokenizer
    ckpt = read_checkpoint(path)
    cfg = ModelConfig(**ckpt["mtp"]["model_config"])
    tokenizer = Tokenizer.from_str(ckpt["mtp"]["tokenizer"])
    model = MTPTransformer(cfg)
    state = {k[len(STATE_PREFIX):]: v for k, v in ckpt["state_dict"].items()
             if k.startswith(STATE_PREFIX)}
    model.load_state_dict(state)
    check_vocab(tokenizer, cfg, source=str(path))
    check_tensor_digests(ckpt, path)  # last: a wrong shape or vocabulary says more
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
