"""Reading and writing mtp checkpoints without Lightning, and reading mtp's export directories.

A checkpoint is a Lightning checkpoint whose `state_dict` holds the model under the `model.`
prefix and whose `mtp` entry carries what inference needs: the model config and the tokenizer
(as its JSON string), so a checkpoint alone is enough to generate or evaluate; and a sha256 of
each tensor of `state_dict`, checked on load, since torch checks no checksum of its zip members
(bytes flipped inside a tensor would otherwise load, and decode, silently). A checkpoint
written before the digests loads unchecked.

An export directory (`mtp export hf`, written by `mtp.interop.hf_export`) holds the same model
in transformers' Llama layout plus mtp's own files; `load_checkpoint` reads either, so `--ckpt`
takes both everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import torch
from tokenizers import Tokenizer

from mtp.config import RENAMED_MODEL_FIELDS, ModelConfig, current_model_fields
from mtp.model.heads import head_aliases
from mtp.model.llama_layout import check_llama_layout, layer_from_llama, llama_layers
from mtp.model.memory import check_memory, inference_need
from mtp.model.transformer import MTPTransformer
from mtp.model.vocab import check_vocab
from mtp.util.atomic import atomic_file
from mtp.util.digests import DIGESTS, digest_mismatch, tensor_digests
from mtp.util.environment import available_memory
from mtp.util.errors import ConfigError, ExportError, InputError, MissingInput
from mtp.util.paths import not_a_file

#: The default end-of-text token (`ModelConfig.eot_token`), which mtp's own tokenizers hold.
EOT_TOKEN = ModelConfig.eot_token
STATE_PREFIX = "model."
#: The files of an export directory that are mtp's own (`mtp.interop.hf_export`).
MTP_CONFIG = "mtp_config.json"
MTP_HEADS = "mtp_heads.safetensors"
FORMAT_VERSION = 1


def mtp_metadata(cfg: ModelConfig, tokenizer: Tokenizer) -> dict:
    """The `mtp` entry of a checkpoint (without the digests of its tensors)."""
    return {"model_config": dataclasses.asdict(cfg), "tokenizer": tokenizer.to_str()}


def stored_model_config(stored: dict, source: str) -> ModelConfig:
    """The model config a checkpoint or export stores, read under today's field names (one
    written before a rename loads, with a message naming the file and the renamed fields).

    Raises:
        InputError: If its values are invalid, or the model they describe needs more memory
            than the machine has available (`mtp.model.memory`): checked before it is built,
            naming `source`.
    """
    renamed = sorted(RENAMED_MODEL_FIELDS.keys() & stored.keys())
    if renamed:
        warnings.warn(f"{source} stores its model config under old names ({', '.join(renamed)}): "
                      f"read as {', '.join(RENAMED_MODEL_FIELDS[k] for k in renamed)}",
                      FutureWarning, stacklevel=3)
    try:
        cfg = ModelConfig(**current_model_fields(stored))
    except ConfigError as err:
        raise InputError(f"{source} stores an invalid model config: {err}") from None
    check_memory(lambda c, sizes: inference_need(c), cfg, {}, available_memory("cpu"),
                 doing="loading the model", where="on the CPU", error=InputError, source=source)
    return cfg


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

    Written atomically (`mtp.util.atomic`), so an interrupted save never corrupts `path`.
    """
    state = {STATE_PREFIX + k: v for k, v in model.state_dict().items()}
    meta = {**mtp_metadata(model.cfg, tokenizer), DIGESTS: tensor_digests(state)}
    # NOTE: into an open file, not by name: torch's own writer reports a full disk as a bare
    # RuntimeError, a Python file as the OSError it is (`mtp.util.atomic.writing`)
    with atomic_file(path, "wb", what="the checkpoint") as f:
        torch.save({"state_dict": state, "mtp": meta}, f)


def read_checkpoint(path: str | os.PathLike, *, mmap: bool = False) -> dict:
    """The raw dict of an mtp checkpoint file, on the CPU (`mmap`: memory-mapped, so reading
    only its config costs no more than the header).

    Raises:
        MissingInput: If the file does not exist.
        InputError: If it is a directory (an export, say), a pipe, a device or anything else
            that is not a regular file, torch cannot read it, or it is not a checkpoint of
            `mtp fit`.
    """
    path = Path(path)
    if path.is_dir():
        if is_export(path):
            raise InputError(f"{path} is an export directory (`mtp export hf`): its weights "
                             "generate and evaluate, but it holds no optimiser state or step "
                             "to resume training from; pass a .ckpt file of `mtp fit`")
        raise InputError(f"{path} is a directory, neither a checkpoint file nor an mtp export "
                         f"(no {MTP_CONFIG})")
    problem = not_a_file(path)
    if problem == "does not exist":
        raise MissingInput(f"checkpoint {path} does not exist")
    if problem is not None:
        raise InputError(f"checkpoint {path} {problem}, not a checkpoint file")
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
    directory written by `mtp export hf` (`mtp.model.checkpoint.load_export`)."""
    path = Path(path)
    if path.is_dir():
        try:
            model, tokenizer = load_export(path)
        except ExportError as err:  # names the directory: a user's input, not a bug
            raise InputError(str(err)) from None
        return model.to(device), tokenizer
    ckpt = read_checkpoint(path)
    cfg = stored_model_config(ckpt["mtp"]["model_config"], f"checkpoint {path}")
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
    saved_cfg = current_model_fields(checkpoint.get("mtp", {}).get("model_config", {}))
    ours = dataclasses.asdict(model_cfg)
    differ = [f"--model.{k} (checkpoint {saved_cfg[k]!r}, now {ours[k]!r})"
              for k in ours if k in saved_cfg and saved_cfg[k] != ours[k]]
    if differ:
        raise ConfigError("the checkpoint was trained with another model config: "
                         + ", ".join(differ))


def is_export(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory written by `mtp export hf` (`mtp.interop.hf_export`)."""
    return (Path(path) / MTP_CONFIG).is_file()


def load_export(path: str | os.PathLike) -> tuple[MTPTransformer, Tokenizer]:
    """Rebuild the model (every head) and tokenizer of an exported directory, in eval mode.

    Raises:
        ExportError: If the directory is not an mtp export, or one of its files is missing,
            unreadable or does not fit the others (the message names the file).
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not is_export(path):
        raise ExportError(f"{path} is not an mtp export (no {MTP_CONFIG}; `mtp export hf` writes "
                          f"one)")
    # Each file a user may have deleted or edited is named with what is wrong with it.
    try:
        meta = json.loads((path / MTP_CONFIG).read_text())
        version = meta.get("format_version")
        cfg = stored_model_config(meta["model_config"], str(path / MTP_CONFIG)) \
            if version == FORMAT_VERSION else None
    except InputError as err:  # invalid values, or too large: the message names the file
        raise ExportError(str(err)) from None
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise ExportError(f"{path / MTP_CONFIG} does not hold an mtp model config: "
                          f"{type(err).__name__}: {err}") from None
    if cfg is None:
        raise ExportError(f"{path / MTP_CONFIG}: format_version {version!r}, this mtp reads "
                          f"{FORMAT_VERSION}")
    check_llama_layout(cfg)
    weights = {}
    for name in ("model.safetensors", MTP_HEADS):
        if name == MTP_HEADS and not (path / name).is_file():
            weights[name] = {}  # K = 1 has no other heads (a deleted file fails the digests)
            continue
        try:
            weights[name] = load_file(path / name)
        except Exception as err:  # safetensors raises its own error, or an OSError
            raise ExportError(f"{path / name} cannot be read: {type(err).__name__}: "
                              f"{err}") from None
    llama, heads = weights["model.safetensors"], weights[MTP_HEADS]
    # An export written before the digests loads unchecked.
    for name, tensors in (("model.safetensors", llama), (MTP_HEADS, heads)):
        want = meta.get(DIGESTS, {}).get(name)
        problem = want is not None and digest_mismatch(want, tensors, path / name)
        if problem:
            raise ExportError(problem)
    state = {"embed.weight": llama["model.embed_tokens.weight"],
             "norm.weight": llama["model.norm.weight"],
             "unembed.weight": llama.get("lm_head.weight", llama["model.embed_tokens.weight"])}
    for i in range(llama_layers(cfg)):
        into = f"blocks.{i}" if i < cfg.n_trunk_layers else "heads.0"
        layer = layer_from_llama(llama, cfg, f"model.layers.{i}")
        state.update({f"{into}.{k}": v for k, v in layer.items()})
    state.update(heads)
    model = MTPTransformer(cfg)
    for i, first in head_aliases(model.heads).items():  # written once, under the first head
        state.update({f"heads.{i}.{k[len(f'heads.{first}.'):]}": v for k, v in heads.items()
                      if k.startswith(f"heads.{first}.")})
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape than the config gives
        first = [line.strip() for line in str(err).splitlines()[1:] if line.strip()][:1]
        raise ExportError(f"{path}: the weights do not fit the model config of {MTP_CONFIG} "
                          f"({'; '.join(first) or err})") from None
    if missing or unexpected:
        raise ExportError(f"{path}: weights do not fit the config (missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]})")
    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as err:  # tokenizers raises a bare Exception, missing file or bad JSON
        raise ExportError(f"{path / 'tokenizer.json'} is not a readable tokenizer: "
                          f"{err}") from None
    check_vocab(tokenizer, cfg, source=str(path))
    return model.eval(), tokenizer
