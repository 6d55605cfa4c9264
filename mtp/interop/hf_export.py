"""`mtp export hf --ckpt CKPT --output DIR`: an mtp model as a transformers directory.

DIR holds, in transformers' `save_pretrained` layout:

* ``config.json`` and ``model.safetensors``: a `LlamaForCausalLM` of ``n_trunk_layers + 1``
  layers, the trunk blocks then head 1's block, with the shared final norm and unembedding, so
  its logits are head 1's (`medusa1`, `deepseek` and `eagle` heads: of ``n_trunk_layers``
  layers, head 1 being the trunk's own output; for `medusa1` its final normalised hidden state
  is then what heads 2..K read, as vLLM's Medusa drafter reads the target's,
  `mtp.interop.vllm_medusa`). The conversion is exact (`mtp.model.llama_layout`).
* ``tokenizer.json``, ``tokenizer_config.json`` (a fast tokenizer whose ``eos_token`` is the
  model's end-of-text token, `ModelConfig.eot_token`) and ``generation_config.json``.
* ``mtp_config.json`` (the model config, and a sha256 of every tensor of each weight file) and
  ``mtp_heads.safetensors`` (heads 2..K, in mtp's own names; a module that several heads
  share, eagle's layer, once, under its first head's name): nothing of the model is lost, and
  `mtp.model.checkpoint.load_export` rebuilds it whole, or names the tensors that changed since.

transformers is not needed to write or read such a directory (only safetensors); it is the
reader this layout is for. A model the Llama layout cannot hold exactly is refused with why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer

from mtp.model.checkpoint import FORMAT_VERSION, MTP_CONFIG, MTP_HEADS
from mtp.model.heads import head_aliases
from mtp.model.llama_layout import llama_config, llama_state
from mtp.model.transformer import MTPTransformer
from mtp.util.atomic import fsync_file, rename, writing
from mtp.util.digests import DIGESTS, tensor_digests
from mtp.util.errors import ExportError

__all__ = ["check_new_directory", "export", "new_directory"]


def export(model: MTPTransformer, tokenizer: Tokenizer, output: str | os.PathLike) -> Path:
    """Write `model` and `tokenizer` as a transformers directory (see the module docstring).

    The directory is written beside `output` and renamed into place at the end, so an
    interrupted export leaves nothing under that name.

    Raises:
        ExportError: If the model cannot be held by the Llama layout, or `output` exists and is
            not an empty directory.
        WriteError: If the disk is full or the folder read-only (`new_directory`).
    """
    from safetensors.torch import save_file

    from mtp.model.vocab import check_vocab, eot_id

    output = Path(output)
    check_new_directory(output)
    cfg = model.cfg
    check_vocab(tokenizer, cfg, source="the checkpoint")
    state = llama_state(model)
    aliases = head_aliases(model.heads)  # eagle's one layer is written once, as heads.1
    heads = {f"heads.{i}.{name}": t.detach().contiguous()
             for i, head in enumerate(model.heads) if i > 0 and i not in aliases
             for name, t in head.state_dict().items()}
    if cfg.draft_vocab:
        heads["draft_ids"] = model.draft_ids.detach().contiguous()
    dtype = model.embed.weight.dtype
    with new_directory(output) as tmp:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        if heads:
            save_file(heads, tmp / MTP_HEADS, metadata={"format": "pt"})
        _write_json(tmp / "config.json", llama_config(cfg, tokenizer, dtype))
        eot = eot_id(tokenizer, cfg)
        _write_json(tmp / "generation_config.json",
                    {"eos_token_id": eot, "pad_token_id": eot, "do_sample": False})
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": cfg.eot_token,
            "pad_token": cfg.eot_token, "model_max_length": cfg.max_seq_len,
            "clean_up_tokenization_spaces": False}
            | ({"chat_template": cfg.chat_template} if cfg.chat_template else {}))
        # Each weight file's tensor digests, checked by `load_export` (safetensors checks none).
        digests = {"model.safetensors": tensor_digests(state)}
        if heads:
            digests[MTP_HEADS] = tensor_digests(heads)
        _write_json(tmp / MTP_CONFIG, {"format_version": FORMAT_VERSION,
                                       "model_config": dataclasses.asdict(cfg),
                                       DIGESTS: digests})
    return output

def check_new_directory(output: Path) -> None:
    """Refuse an `--output` that exists and is not an empty directory.

    Raises:
        ExportError: If it does (a file, or a directory with something in it).
    """
    if output.exists() and not (output.is_dir() and not any(output.iterdir())):
        raise ExportError(f"--output {output} exists and is not an empty directory; nothing "
                          f"was written (choose a new directory)")

@contextlib.contextmanager
def new_directory(output: Path) -> Iterator[Path]:
    """A temporary directory beside `output` to write an export into: when the block ends
    cleanly its files are fsynced and it is renamed to `output` (`mtp.util.atomic.rename`), so an
    interrupted export leaves nothing under that name; if the block raises it is removed.

    Raises:
        ExportError: If `output` exists and is not an empty directory.
        WriteError: If the export cannot be written there (a full disk, a read-only folder, a
            quota): nothing is left behind.
    """
    check_new_directory(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with writing(output, "the export"):
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        try:
            yield tmp
            for f in tmp.iterdir():
                fsync_file(f)
            if output.exists():
                output.rmdir()  # empty, checked above
            rename(tmp, output)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
