"""mtp's model in the tensor names of transformers' Llama (and Qwen2) layout, exactly, both ways.

The trunk blocks, then head 1's block where it has one, are a `LlamaForCausalLM`'s layers: the
fused ``qkv`` and ``gate_up`` maps split into Llama's projections, and the query and key rows of
each attention head reordered from mtp's rotary layout (channels 2i, 2i+1 rotate together) to
Llama's (channels i, i + hd/2), which leaves every attention score unchanged. `mtp export hf`
(`mtp.interop.hf_export`) writes this layout, `load_export` (`mtp.model.checkpoint`) and
`--model.init_from` (`mtp.interop.hf_import`) read it.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from mtp.config import ModelConfig
from mtp.model.transformer import MTPTransformer
from mtp.util.errors import ExportError

__all__ = ["TRUNK_HEAD_1", "check_llama_layout", "layer_from_llama", "llama_config",
           "llama_layers", "llama_state"]

#: Head types whose head 1 is the trunk's own output (`mtp.model.heads.MainOutput`): the Llama
#: holds the trunk's layers alone.
TRUNK_HEAD_1 = ("medusa1", "deepseek", "eagle")


def _rope_order(attn_head_dim: int) -> torch.Tensor:
    """Llama's channel j of a head is mtp's channel `order[j]` (evens, then odds)."""
    return torch.cat([torch.arange(0, attn_head_dim, 2), torch.arange(1, attn_head_dim, 2)])

def _to_llama_rows(w: torch.Tensor, n_attn_heads: int, attn_head_dim: int) -> torch.Tensor:
    """Reorder the output rows of a query or key projection from mtp's rotary layout."""
    return w.view(n_attn_heads, attn_head_dim, -1)[:, _rope_order(attn_head_dim)].reshape(w.shape)

def _from_llama_rows(w: torch.Tensor, n_attn_heads: int, attn_head_dim: int) -> torch.Tensor:
    inverse = torch.argsort(_rope_order(attn_head_dim))
    return w.view(n_attn_heads, attn_head_dim, -1)[:, inverse].reshape(w.shape)

def check_llama_layout(cfg: ModelConfig) -> None:
    """Refuse a model whose head 1 the Llama layout cannot hold: a block of its own (`block`)
    or the trunk's own output after the final norm (`TRUNK_HEAD_1`) are the two it can."""
    if cfg.head_type != "block" and cfg.head_type not in TRUNK_HEAD_1:
        raise ExportError(
            f"--model.head_type {cfg.head_type}: the export writes head 1 as the "
            f"LlamaForCausalLM's last layer (block heads) or as the trunk's own output after the "
            f"final norm ({', '.join(TRUNK_HEAD_1)}), and {cfg.head_type}'s head 1 is neither")

def llama_layers(cfg: ModelConfig) -> int:
    """Layers of the exported `LlamaForCausalLM`: the trunk's, and head 1's block if it has
    one (`block` heads; for `TRUNK_HEAD_1`'s head types head 1 is the trunk output itself)."""
    return cfg.n_trunk_layers + (cfg.head_type == "block")

def llama_config(cfg: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict:
    """The ``config.json`` of the `LlamaForCausalLM` whose logits are head 1's."""
    from mtp.model.vocab import eot_id

    eot = eot_id(tokenizer, cfg)
    # Llama's attention_bias would add an output-projection bias too; Qwen2 is the layout with
    # biases on the query, key and value projections only.
    arch, kind = ("Qwen2ForCausalLM", "qwen2") if cfg.attn_bias else ("LlamaForCausalLM", "llama")
    extra = {"use_sliding_window": False, "sliding_window": None} if cfg.attn_bias else {
        "attention_bias": False, "mlp_bias": False, "head_dim": cfg.attn_head_dim}
    return {
        "architectures": [arch],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": llama_layers(cfg),
        "num_attention_heads": cfg.n_attn_heads,
        "num_key_value_heads": cfg.attn_kv_heads,
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
    hd, h, hkv = cfg.attn_head_dim, cfg.n_attn_heads, cfg.attn_kv_heads
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
    check_llama_layout(cfg)
    state = {"model.embed_tokens.weight": model.embed.weight.detach(),
             "model.norm.weight": model.norm.weight.detach()}
    layers = [*model.blocks, *model.heads[:1]][:llama_layers(cfg)]
    for i, block in enumerate(layers):
        state.update(_layer_to_llama(block, cfg, f"model.layers.{i}"))
    if not cfg.tie_embeddings:  # tied: transformers ties lm_head to the embedding itself
        state["lm_head.weight"] = model.unembed.weight.detach()
    return {k: v.contiguous() for k, v in state.items()}

def layer_from_llama(state: dict, cfg: ModelConfig, prefix: str) -> dict:
    hd, h, hkv = cfg.attn_head_dim, cfg.n_attn_heads, cfg.attn_kv_heads

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
