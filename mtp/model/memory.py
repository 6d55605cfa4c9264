"""What a model of a config needs in memory, estimated before anything is built.

A config's sizes (`--model.n_future 100000`, `--data.batch_size 100000000`, a checkpoint whose
stored `vocab_size` is 4e9) are taken on trust until they are checked here: `check_memory`
compares the estimate with the memory the machine has available and refuses, with the estimate
and the flags that drive it, before one byte of the model is allocated. The estimate counts
what is certain to be held: the parameters (counted from the config, `parameter_count`), their
gradients and AdamW's two moments, the tensors one step keeps for its backward, and, to decode,
the KV cache and one forward's logits. It leaves out what the allocator and the libraries add on
top, so it errs low: a run it lets through may still run out of memory, but one it refuses could
never have held.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from mtp.config import ModelConfig
from mtp.util.errors import ConfigError

__all__ = ["MemoryNeed", "check_memory", "format_bytes", "inference_need", "parameter_count",
           "training_need"]

#: Bytes of one int64 token id.
_ID = 8


def format_bytes(n: float) -> str:
    """`n` bytes in binary units: 26.3 GiB, 215 MiB, 12 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 100 else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class MemoryNeed:
    """An estimate of bytes, by part (weights, gradients, ...)."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        """`about 26.3 GiB (weights 6.6 GiB, gradients 6.6 GiB, ...)`."""
        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in self.parts.items() if n)
        return f"about {format_bytes(self.total)} ({parts})"


def _block(cfg: ModelConfig) -> int:
    """Parameters of one transformer block (`mtp.model.layers.Block`)."""
    d, qkv = cfg.d_model, (cfg.n_attn_heads + 2 * cfg.attn_kv_heads) * cfg.attn_head_dim
    return 2 * d + d * qkv + qkv * cfg.attn_bias + d * d + 3 * d * cfg.ffn_dim


def _head_params(cfg: ModelConfig, *, first: bool = True) -> int:
    """Parameters of the K output heads (`mtp.model.heads`), or of heads 2..K only."""
    d, k = cfg.d_model, cfg.n_future
    each, head1 = {"block": (_block(cfg), True), "linear": (d * d, True),
                   "medusa": (d * d, True), "medusa1": (d * d + d, False),
                   "deepseek": (2 * d + 2 * d * d + _block(cfg), False),
                   "eagle": (2 * d + 2 * d * d + _block(cfg), False)}[cfg.head_type]
    if cfg.head_type == "eagle":  # heads 2..K are one layer, with its fusing map
        n = len(cfg.feature_layers)
        return (each + (n + 1) * d * d * (n > 0)) * (k > 1)
    return each * (k - 1 + (first and head1))


def parameter_count(cfg: ModelConfig) -> int:
    """The parameters `MTPTransformer(cfg)` holds (tied weights counted once), from the config
    alone: the embedding, the trunk, the heads, the final norm and the unembedding."""
    d, V = cfg.d_model, cfg.vocab_size
    return (V * d + max(cfg.n_trunk_layers, 0) * _block(cfg) + _head_params(cfg) + d
            + (0 if cfg.tie_embeddings else V * d))


def _buffers(cfg: ModelConfig) -> int:
    """The model's buffers: the fp64 rotary tables and the draft vocabulary's ids."""
    return 2 * cfg.max_seq_len * (cfg.attn_head_dim // 2) * 8 + cfg.draft_vocab * _ID


def _activations_per_token(cfg: ModelConfig, attending: bool = True) -> int:
    """Elements one block keeps per token for its backward: the two norms' inputs and outputs,
    q, k and v (and their rotated copies), the attention output, the MLP's gate, up, product
    and its SiLU."""
    kv = 2 * cfg.attn_kv_heads * cfg.attn_head_dim
    return 8 * cfg.d_model + 2 * kv + 4 * cfg.ffn_dim if attending else 2 * cfg.d_model


def training_need(cfg: ModelConfig, *, batch_size: int, seq_len: int, naive: bool = False,
                  heads_only: bool = False, trunk_cache_bytes: int = 0, param_bytes: int = 4,
                  activation_bytes: int = 4, shards: int = 1) -> MemoryNeed:
    """What one training process holds: the weights, gradients and AdamW state (each `1/shards`
    of it under FSDP), and one step: the batch, its K targets, every trunk block's activations,
    then one head at a time (`naive`: all K heads, and their K logits of N x V with their
    gradients), and with `heads_only` the frozen trunk's cache.

    Args:
        cfg: The model.
        batch_size: Windows per step (B).
        seq_len: Input tokens per window (T).
        naive: The `naive` loss (`--loss.strategy naive`), else the sequential pass.
        heads_only: Only heads 2..K learn (`--optim.train heads`).
        trunk_cache_bytes: The frozen trunk's cache (`--optim.trunk_cache_mb`).
        param_bytes: Bytes of a parameter (2 under `--trainer.precision bf16-true`).
        activation_bytes: Bytes of an activation (2 under bf16 or fp16 autocast).
        shards: Devices the weights and optimiser state are sharded over (FSDP).
    """
    n_params = parameter_count(cfg)
    trainable = _head_params(cfg, first=False) if heads_only else n_params
    n, d, k = batch_size * seq_len, cfg.d_model, cfg.n_future
    one_head = _activations_per_token(cfg, cfg.head_type in ("block", "deepseek", "eagle"))
    heads = (k * one_head if naive else one_head) + 3 * d  # + dL/dh and the normed output
    logits = 2 * k * n * cfg.vocab_size * 4 if naive else 0
    step = (batch_size * (seq_len + k) * _ID + k * n * _ID  # the windows and the K targets
            + n * (max(cfg.n_trunk_layers, 0) * _activations_per_token(cfg) + d + heads)
            * activation_bytes + logits)
    return MemoryNeed({
        "weights": -(-n_params * param_bytes // shards) + _buffers(cfg),
        "gradients": -(-trainable * param_bytes // shards),
        "AdamW state": -(-2 * trainable * param_bytes // shards),
        "one step": step,
        "trunk cache": trunk_cache_bytes if heads_only else 0,
    })


def inference_need(cfg: ModelConfig, *, batch_size: int = 1, param_bytes: int = 4,
                   seq_len: int | None = None, prompt_len: int | None = None) -> MemoryNeed:
    """What decoding `batch_size` rows needs: the weights, the KV cache of every attending
    layer over `seq_len` positions a row (the decode's cache is sized to the longest prompt
    and the new tokens), a block's activations over `prompt_len` positions a row (a prefill,
    which unembeds each row's last position only), and the logits of a round of up to
    `_ROUND_TOKENS` tokens. Both lengths default to the whole context, where the prompts and
    the tokens asked are not known."""
    from mtp.model.heads import head_cache_layers

    layers = max(cfg.n_trunk_layers, 0) + len({x for x in head_cache_layers(cfg)
                                                if x is not None})
    seq_len = cfg.max_seq_len if seq_len is None else min(seq_len, cfg.max_seq_len)
    prompt_len = seq_len if prompt_len is None else min(prompt_len, seq_len)
    cache = 2 * layers * batch_size * cfg.attn_kv_heads * seq_len * cfg.attn_head_dim
    return MemoryNeed({
        "weights": parameter_count(cfg) * param_bytes + _buffers(cfg),
        "KV cache": cache * 4,
        "prefill": batch_size * prompt_len * _activations_per_token(cfg) * 4,
        "logits": batch_size * min(seq_len, _ROUND_TOKENS) * cfg.vocab_size * 4,
    })


#: The tokens of a decode round the estimate counts logits for: a default or dynamic tree (32
#: nodes at most) with a lookup branch. A wider `--tree` holds more, as its own forward shows.
_ROUND_TOKENS = 64


#: The model's sizes whose smallest value `check_memory` tries, each alone, to say which drive
#: a need.
_MODEL_SIZES = (("n_future", 1), ("n_layers", 1), ("d_model", 1), ("vocab_size", 1),
                ("max_seq_len", 1), ("ffn_hidden", 1))


def check_memory(need: Callable[[ModelConfig, dict[str, int]], MemoryNeed], cfg: ModelConfig,
                 sizes: dict[str, int], available: int, *, doing: str, where: str,
                 error: type[Exception] = ConfigError, source: str = "",
                 model_flags: dict[str, str | None] | None = None) -> None:
    """Refuse, before anything is allocated, what needs more memory than is available.

    The message gives the estimate, the memory available and the flags that drive the estimate:
    those whose smallest value alone would bring it within the memory, else the two that
    shrink it most.

    Args:
        need: The estimate of a model config and of `sizes` (`training_need` or
            `inference_need`, the other arguments bound).
        cfg: The model config; its sizes are called `--model.<field>`.
        sizes: The other sizes the estimate takes, by flag (`{"--data.batch_size": 8}`).
        available: Bytes available (`mtp.util.environment.available_memory`).
        doing: What needs the memory, for the message ("training", "loading the model").
        where: Where the memory is ("on the CPU", "on cuda:0").
        error: The error to raise (`ConfigError` for flags, `InputError` for a file's config).
        source: What the config came from, for the message (a file); empty for flags.
        model_flags: The flag that sets a model field, where it is not `--model.<field>`
            (`mtp bench train --ks` sets `n_future`); None: a field no flag sets.
    """
    estimate = need(cfg, sizes)
    if estimate.total <= available:
        return
    savings = []
    flags = {name: f"--model.{name}" for name, _ in _MODEL_SIZES} | (model_flags or {})
    for name, smallest in _MODEL_SIZES:
        value = getattr(cfg, name)
        if value is not None and value > smallest and flags[name] is not None:
            smaller = copy.copy(cfg)  # not validated: an estimate only
            setattr(smaller, name, smallest)
            savings.append((estimate.total - need(smaller, sizes).total,
                            f"{flags[name]} {value}"))
    for flag, value in sizes.items():
        if value > 1:
            savings.append((estimate.total - need(cfg, {**sizes, flag: 1}).total,
                            f"{flag} {value}"))
    savings.sort(key=lambda saving: -saving[0])
    enough = [flag for saved, flag in savings if estimate.total - saved <= available]
    drivers = enough or [flag for saved, flag in savings[:2] if saved > 0]
    if source:
        raise error(f"{source} describes a model ({', '.join(drivers)}) that needs "
                    f"{estimate.describe()} for {doing}, more than the "
                    f"{format_bytes(available)} of memory available {where}")
    lower = f"; lower {' or '.join(drivers)}" if drivers else ""
    raise error(f"{doing} needs {estimate.describe()}, more than the "
                f"{format_bytes(available)} of memory available {where}{lower}")
