"""Heads 2..K as vLLM's Medusa draft model: `mtp export medusa --ckpt CKPT --output DIR`.

vLLM serves Medusa heads beside a target model (`speculative_config` method ``medusa``); its
loader is `vllm/model_executor/models/medusa.py`, its config class
`vllm/transformers_utils/configs/medusa.py`. What they read, and this module writes:

* ``config.json``: ``model_type: medusa``, ``architectures: ["MedusaModel"]`` (the name vLLM's
  model registry maps to its `Medusa` class), ``hidden_size``, ``vocab_size``, ``num_heads``,
  ``num_hidden_layers`` (residual layers per head: 1), ``medusa_fc_bias: true`` (the key that
  gives each layer its bias), and with a draft vocabulary ``truncated_vocab_size``.
  (`MedusaConfig.from_pretrained` renames any key holding "num" and "heads" or "layers" to
  ``num_heads`` or ``num_hidden_layers``, so no other key of that kind is written.)
* ``model.safetensors``: for vLLM head j = 0..K-2, ``blocks.{j}.layers.0.weight`` (d x d) and
  ``.bias`` (d), and ``lm_heads.{j}.weight`` (V x d, or truncated_vocab_size x d); with a draft
  vocabulary, ``token_map`` (int64, the token id of each of those rows).

vLLM's head j reads the target model's final hidden state z, after its final norm, at the last
accepted token; each layer adds ``SiLU(Linear(x))`` to its input; its logits are
``lm_heads[j](x)``, or with a ``token_map`` those scattered to the token ids of the map in a row
of ``vocab_size`` that is -inf elsewhere. Head j proposes the token j + 2 positions after z's,
so **vLLM head j is mtp's `heads[j + 1]`**, head j + 2 counting from 1. mtp's head 1
is the target model's own next-token output, which vLLM computes from the target: `mtp export
hf` of the same checkpoint, or the pretrained model itself when only the heads were trained.

The `medusa1` head type (`mtp.model.heads`) is this computation exactly: a residual block with bias
on the normalised trunk output, no norm after it, the shared unembedding (its draft-vocabulary
rows where there is one). Every other head type is refused, with the reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mtp.interop.hf_export import new_directory
from mtp.model.transformer import MTPTransformer
from mtp.util.errors import ExportError

__all__ = ["WEIGHTS", "export", "medusa_config"]

#: The weight file (vLLM's default loader reads every ``*.safetensors`` of the directory).
WEIGHTS = "model.safetensors"

#: Why each other head type has no form in vLLM's Medusa layout.
_WHY_NOT = {
    "block": "heads 2..K are transformer blocks that attend over the context, and a vLLM "
             "Medusa head is a residual MLP on one hidden state",
    "linear": "a head is a d x d map of the trunk output followed by the shared norm, and a "
              "vLLM Medusa head reads the normalised state, adds its input back and has no "
              "norm after it",
    "medusa": "its residual blocks read the trunk output before the final norm and the shared "
              "norm follows them, and a vLLM Medusa head reads the target model's normalised "
              "state with no norm after it",
    "deepseek": "heads 2..K are cascaded modules that read the previous head's output and the "
                "embedding of the drafted token (vLLM serves that design as method mtp, not "
                "medusa)",
}


def _refusal(head_type: str) -> str:
    why = _WHY_NOT.get(head_type, "it is not Medusa-1's residual head")
    return (f"--model.head_type {head_type}: {why}; only medusa1 heads have vLLM's Medusa layout "
            f"(train with --model.head_type medusa1)")


def medusa_config(model: MTPTransformer) -> dict:
    """The ``config.json`` of `model`'s heads 2..K as vLLM's `MedusaConfig` reads it."""
    cfg = model.cfg
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": cfg.d_model,
        "vocab_size": cfg.vocab_size,
        "num_heads": cfg.n_future - 1,
        "num_hidden_layers": 1,
        "medusa_fc_bias": True,
        "torch_dtype": str(model.unembed.weight.dtype).removeprefix("torch."),
    }
    if cfg.draft_vocab:
        config["truncated_vocab_size"] = cfg.draft_vocab
    return config


def _weights(model: MTPTransformer) -> dict[str, torch.Tensor]:
    """vLLM head j's tensors from mtp's `heads[j + 1]`, each a tensor of its own
    (safetensors stores no shared memory)."""
    state = {}
    rows = model.head_unembed(1).detach()  # (V or Vd, d): W, or its draft-vocabulary rows
    for j, head in enumerate(model.heads[1:]):
        state[f"blocks.{j}.layers.0.weight"] = head.proj.weight.detach()
        state[f"blocks.{j}.layers.0.bias"] = head.proj.bias.detach()
        state[f"lm_heads.{j}.weight"] = rows
    if model.cfg.draft_vocab:
        state["token_map"] = model.draft_ids.detach().to(torch.int64)
    return {k: v.clone().contiguous() for k, v in state.items()}


def export(model: MTPTransformer, output: str | os.PathLike) -> Path:
    """Write heads 2..K of a `medusa1` model as a vLLM Medusa directory (see the module
    docstring): vLLM head j is mtp head j + 2.

    The directory is written beside `output` and renamed into place at the end, so an
    interrupted export leaves nothing under that name.

    Raises:
        ExportError: If the heads are of another type than `medusa1` (the message says why that
            type has no form in the layout), the model has no heads 2..K, or `output` exists and
            is not an empty directory.
    """
    from safetensors.torch import save_file

    cfg = model.cfg
    if cfg.head_type != "medusa1":
        raise ExportError(_refusal(cfg.head_type))
    if cfg.n_future < 2:
        raise ExportError("--model.n_future 1: the model has no heads 2..K to draft with")
    output = Path(output)
    state = _weights(model)
    with new_directory(output) as tmp:
        save_file(state, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(medusa_config(model), indent=2) + "\n")
    return output
