"""Typed configuration: the single source of truth for every knob of mtp.

Each component receives only its own sub-config (`build_model(model_cfg)`,
`build_datamodule(data_cfg, ...)`); only the Lightning module and the CLI see the whole tree.
Every field has a type, a default and a docstring; the docstrings become `--help`.
Validation collects every problem of a config before raising, and each message names the flag.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from dataclasses import InitVar, dataclass, field
from typing import Literal

from mtp.util.errors import ConfigError

#: Tokens of a byte-level BPE before any merge: the 256 bytes and the end-of-text token.
BYTE_LEVEL_BASE = 257


#: The largest seed mtp takes (`--seed`, `--data.seed`, `--seed_everything`): NumPy's generator,
#: which Lightning's `seed_everything` seeds, takes 32 bits (torch's takes 64), and mtp derives
#: further seeds from one by small offsets (an epoch of windows, a batch of an evaluation), so
#: every seed is a 32-bit one. Lightning would replace a larger one with 0, torch overflow.
SEED_MAX = 2**32 - 1


def seed_problem(flag: str, value: int) -> str | None:
    """What is wrong with seed `value` of `flag`, or None: seeds lie in [0, `SEED_MAX`]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
        return f"{flag} must be a whole number in [0, {SEED_MAX}], the range of the random " \
               f"generators it seeds (got {value})"
    return None


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def feature_layers_problems(cfg: ModelConfig, depth_known: bool) -> list[str]:
    """What is wrong with `--model.feature_layers`; against the trunk's depth only where it is
    known (with `init_from`, once the pretrained shape has replaced the flags')."""
    layers = list(cfg.feature_layers)
    if not layers:
        return []
    if cfg.head_type != "eagle":
        return [f"--model.feature_layers feed eagle heads' draft layer; --model.head_type "
                f"{cfg.head_type} reads the trunk's last output alone"]
    if layers != sorted(set(layers)) or layers[0] < 1:
        return [f"--model.feature_layers must be increasing block numbers >= 1 (got {layers})"]
    if depth_known and layers[-1] >= cfg.n_trunk_layers:
        return [f"--model.feature_layers must be below the trunk's last block, "
                f"{cfg.n_trunk_layers} (got {layers})"]
    return []


@dataclass
class ModelConfig:
    """Shape of the multi-token-prediction transformer."""

    vocab_size: int = 4096
    """Vocabulary size V (rows of the embedding and of the shared unembedding)."""
    d_model: int = 192
    """Residual stream width d."""
    n_layers: int = 4
    """Trunk blocks (with `matched_params`, the trunk of the K = 1 model)."""
    n_attn_heads: int = 3
    """Attention heads per block (not output heads: those are `n_future`)."""
    n_attn_kv_heads: int | None = None
    """Key/value attention heads for grouped-query attention (None: `n_attn_heads`)."""
    n_future: int = 4
    """K: number of output heads; head 1 predicts the next token, head k the token k ahead."""
    head_type: Literal["block", "linear", "medusa", "medusa1", "deepseek", "eagle"] = "block"
    """Output heads (`mtp.model.heads`): a transformer block each (the paper's default), a linear d
    x d map each, Medusa's residual block h + SiLU(W h) each, Medusa-1 as vLLM serves it (head 1 the
    main model's output, heads 2..K residual blocks z + SiLU(W z + b) on the normalised trunk output
    z, no norm after; `mtp export medusa`), DeepSeek-V3's chain of MTP modules (head i reads head
    i - 1's output and the token it predicts), or EAGLE's draft layer (heads 2..K one such module,
    unrolled)."""
    matched_params: bool = False
    """Keep the blocks of trunk and heads at `n_layers + 1` for every K by moving K - 1 trunk
    blocks into the heads (Gloeckle et al.), so a sweep over K compares equal parameter counts.
    For `block` heads exactly; for `deepseek` heads up to each module's 2d x d projection and two
    norm gains. `linear`, `medusa` and `medusa1` heads hold no block to move."""
    max_seq_len: int = 256
    """Longest context the rotary tables and KV cache are built for."""
    ffn_hidden: int | None = None
    """SwiGLU hidden width (None: 8/3 * d rounded up to a multiple of 64)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the unembedding (untied by default, as in the paper)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    attn_bias: bool = False
    """Biases on the query, key and value projections (Qwen2's layout)."""
    eot_token: str = "<|endoftext|>"
    """The tokenizer's end-of-text token: it separates documents in the token stream and ends
    generation. With `init_from`, the pretrained tokenizer's ``eos_token`` unless set."""
    feature_layers: list[int] = field(default_factory=list)
    """`eagle` heads: trunk blocks (numbered from 1) whose outputs join the trunk's last output as
    the draft layer's first input, through a learned (n + 1) d x d map that starts as the last
    output alone (EAGLE-3's low, middle and high features; e.g. [2, 15] of 30 blocks). Empty: the
    last output alone, as EAGLE-1 and -2 read it."""
    draft_vocab: int = 0
    """Heads 2..K predict over this many tokens only, the most frequent of the training data (set
    before the first step; EAGLE-3's draft vocabulary): drafting and their loss then cost
    draft_vocab / V of the unembedding, and head 1 verifies over the whole vocabulary, so greedy
    output is unchanged. 0: every head over the whole vocabulary."""
    chat_template: str | None = None
    """The Jinja chat template of an instruct model (from `init_from`'s tokenizer metadata):
    `mtp eval --prompt-format chat` wraps each prompt in it."""
    init_from: str | None = None
    """A local transformers checkpoint of the Llama family (Llama, Mistral, Qwen2), or a Llama
    `.gguf` file, to start from: its shape replaces the other `--model.*` shape flags, its layers
    become the trunk and head 1, heads 2..K start as copies of its last layer, and its tokenizer
    becomes the default `--data.tokenizer` (`mtp.interop.hf_import.pretrained_config`)."""

    n_heads: InitVar[int | None] = None
    """Deprecated: `n_attn_heads`."""
    n_kv_heads: InitVar[int | None] = None
    """Deprecated: `n_attn_kv_heads`."""

    def __post_init__(self, n_heads: int | None = None, n_kv_heads: int | None = None) -> None:
        p = []
        for old, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if value is not None:
                new = RENAMED_MODEL_FIELDS[old]
                warnings.warn(f"--model.{old} is deprecated: it is now --model.{new} (attention "
                              f"heads, not output heads)", FutureWarning, stacklevel=3)
                setattr(self, new, value)
        for name in ("vocab_size", "d_model", "n_layers", "n_attn_heads", "n_future",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                p.append(f"--model.{name} must be >= 1 (got {getattr(self, name)})")
        if self.n_attn_heads >= 1 and self.d_model % self.n_attn_heads:
            p.append(
                f"--model.d_model ({self.d_model}) must be divisible by --model.n_attn_heads "
                f"({self.n_attn_heads})"
            )
        elif self.n_attn_heads >= 1 and (self.d_model // self.n_attn_heads) % 2:
            p.append(f"--model.d_model / --model.n_attn_heads must be even for RoPE (got "
                     f"{self.d_model // self.n_attn_heads})")
        if self.n_attn_kv_heads is not None and (
            self.n_attn_kv_heads < 1 or self.n_attn_heads % self.n_attn_kv_heads
        ):
            p.append(
                f"--model.n_attn_kv_heads ({self.n_attn_kv_heads}) must be >= 1 and divide "
                f"--model.n_attn_heads ({self.n_attn_heads})"
            )
        if self.head_type not in HEAD_TYPES:
            p.append(f"--model.head_type must be one of {', '.join(HEAD_TYPES)} (got "
                     f"{self.head_type!r})")
        if self.matched_params:
            if self.head_type not in ("block", "deepseek"):
                p.append(f"--model.matched_params does not apply to --model.head_type "
                         f"{self.head_type}: it moves trunk blocks into heads that are blocks "
                         f"(block or deepseek), and {self.head_type} heads hold none")
            elif self.n_future >= 1 and self.n_trunk_layers < 1:
                p.append(
                    f"--model.matched_params moves K - 1 = {self.n_future - 1} trunk blocks into "
                    f"the heads, which leaves none of --model.n_layers = {self.n_layers}"
                )
        if not self.eot_token:
            p.append("--model.eot_token must be a token (got an empty string)")
        # with `init_from`, vocab_size is the pretrained model's
        # (`mtp.interop.hf_import.pretrained_config`)
        if self.draft_vocab < 0 or self.init_from is None and self.draft_vocab > self.vocab_size:
            p.append(f"--model.draft_vocab must be in [0, --model.vocab_size = "
                     f"{self.vocab_size}] (got {self.draft_vocab})")
        elif self.draft_vocab and self.n_future < 2:
            p.append("--model.draft_vocab applies to heads 2..K, but --model.n_future is 1")
        p += feature_layers_problems(self, depth_known=self.init_from is None)
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            p.append(f"--model.ffn_hidden must be >= 1 (got {self.ffn_hidden})")
        _raise_if(p)

    @property
    def n_trunk_layers(self) -> int:
        """Blocks in the shared trunk after the matched-parameter move. `deepseek` and `eagle`
        heads add one: the block that `block` heads give head 1 is the main model's last
        (`mtp.model.heads`).
        """
        n = self.n_layers + (self.head_type in ("deepseek", "eagle"))
        return n - (self.n_future - 1) if self.matched_params else n

    @property
    def attn_head_dim(self) -> int:
        """Width hd of one attention head."""
        return self.d_model // self.n_attn_heads

    @property
    def attn_kv_heads(self) -> int:
        """Key/value attention heads Hkv (`n_attn_kv_heads`, or one per attention head)."""
        return self.n_attn_kv_heads or self.n_attn_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-(8 * self.d_model // 3) // 64) * 64

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> ModelConfig:
        """A named size from `MODEL_REGISTRY`, with field overrides."""
        if name not in MODEL_REGISTRY:
            raise ConfigError(f"unknown model name {name!r}; known: {', '.join(MODEL_REGISTRY)}")
        return dataclasses.replace(MODEL_REGISTRY[name], **overrides)



#: Model config fields renamed, old name -> new: a config, checkpoint or export that stores an
#: old name still loads (`ModelConfig` takes the old names as deprecated init-only arguments).
RENAMED_MODEL_FIELDS = {"n_heads": "n_attn_heads", "n_kv_heads": "n_attn_kv_heads"}


def current_model_fields(stored: dict) -> dict:
    """A stored model config (a checkpoint's or an export's) with renamed fields under their
    current names."""
    return {RENAMED_MODEL_FIELDS.get(k, k): v for k, v in stored.items()}


#: The values of `--model.head_type` (`mtp.model.heads`).
HEAD_TYPES: tuple[str, ...] = typing.get_args(typing.get_type_hints(ModelConfig)["head_type"])

#: Named sizes. `debug` runs a step on CPU in milliseconds (tests, README); `cpu` is the default
#: that trains on two CPU cores in minutes; the rest are GPU sizes (parameter counts at V = 32000,
#: K = 4, matched to the K = 1 model of the same name).
MODEL_REGISTRY: dict[str, ModelConfig] = {
    "debug": ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_attn_heads=2, n_future=2,
                         max_seq_len=64),
    "cpu": ModelConfig(), "125M": ModelConfig(vocab_size=32000, d_model=768, n_layers=11,
    n_attn_heads=12, max_seq_len=2048,
                        matched_params=True),
    "350M": ModelConfig(vocab_size=32000, d_model=1024, n_layers=23, n_attn_heads=16,
                        max_seq_len=2048, matched_params=True),
    "1B": ModelConfig(vocab_size=32000, d_model=2048, n_layers=17, n_attn_heads=16,
    n_attn_kv_heads=8,
                      max_seq_len=4096, matched_params=True),
    "7B": ModelConfig(vocab_size=32000, d_model=4096, n_layers=31, n_attn_heads=32,
    n_attn_kv_heads=8,
                      ffn_hidden=11008, max_seq_len=4096, matched_params=True),
}


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenised, and how it is batched."""

    #: Keys an entry of `sources` may set; all but `source` and `weight` default to the
    #: top-level field of the same name.
    SOURCE_KEYS = ("source", "weight", "hf_config", "hf_split", "text_field", "streaming",
                   "max_documents", "max_tokens")

    source: str = "stdlib"
    """`stdlib` (the running Python's standard library sources, offline), a Hugging Face dataset
    name, or local files: a path, directory or glob of .py, .txt, .jsonl or .parquet files."""
    sources: list[dict] | None = None
    """A mixture instead of `source`: a list of `{source: ..., weight: ...}` (weight default 1),
    each entry optionally overriding `hf_config`, `hf_split`, `text_field`, `streaming`,
    `max_documents` and `max_tokens`. Each source gets its own token shards; training windows
    come from source j with probability weight_j / sum(weights); validation uses every
    source's held-out split. `source` must then stay at its default."""
    hf_config: str | None = None
    """Hugging Face dataset configuration name."""
    hf_split: str = "train"
    """Hugging Face split to read."""
    text_field: str = "text"
    """Field holding the text in Hugging Face, .jsonl and .parquet sources."""
    streaming: bool = False
    """Stream a Hugging Face dataset instead of downloading it whole."""
    max_documents: int | None = None
    """Read at most this many documents (files or rows, empty ones included)."""
    max_tokens: int | None = None
    """Stop reading a source once its training split holds this many tokens (the last document
    is cut there); validation keeps the held-out documents met on the way, so it stays about
    val_fraction of what was read. With `sources`: the default of each entry's `max_tokens`."""
    val_fraction: float = 0.02
    """Share of documents (chosen by a hash of each document's name) held out for validation."""
    tokenizer: str | None = None
    """An existing `tokenizer.json`; None trains a byte-level BPE on the training split."""
    tokenizer_train_bytes: int = 8_000_000
    """Train the BPE on at most this many bytes of training text (shared among `sources` in
    proportion to their weights)."""
    tokenize_workers: int | None = None
    """Processes that tokenise the corpus (None: one per available CPU core); the shards are
    byte-identical for any count."""
    cache_dir: str = ".mtp_cache"
    """Where tokenizers and memory-mapped token shards are kept, keyed by hashes of the source
    specification and the tokenizer."""
    seq_len: int = 128
    """Tokens of context per training window (each window holds seq_len + K tokens)."""
    batch_size: int = 16
    """Windows per batch (per device)."""
    num_workers: int = 0
    """DataLoader worker processes."""
    seed: int = 1234
    """Seed of the window order (and of the choice of source in a mixture)."""

    def __post_init__(self) -> None:
        p = []
        if not 0.0 < self.val_fraction < 1.0:
            p.append(f"--data.val_fraction must be in (0, 1) (got {self.val_fraction})")
        for name in ("seq_len", "batch_size", "tokenizer_train_bytes"):
            if getattr(self, name) < 1:
                p.append(f"--data.{name} must be >= 1 (got {getattr(self, name)})")
        if self.num_workers < 0:
            p.append(f"--data.num_workers must be >= 0 (got {self.num_workers})")
        for name in ("max_documents", "max_tokens", "tokenize_workers"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                p.append(f"--data.{name} must be >= 1 (got {getattr(self, name)})")
        if self.sources is not None:
            p += self._source_problems()
        if (problem := seed_problem("--data.seed", self.seed)) is not None:
            p.append(problem)
        _raise_if(p)

    def _source_problems(self) -> list[str]:
        if not isinstance(self.sources, list) or not self.sources:
            return [f"--data.sources must be a non-empty list of {{source: ..., weight: ...}} "
                    f"(got {self.sources!r})"]
        p = []
        if self.source != "stdlib":
            p.append(f"--data.source ({self.source!r}) and --data.sources are both set; give "
                     "the single source as the only entry of --data.sources instead")
        # the type each key must have (bool is an int in Python, so it is excluded explicitly)
        kinds = {"source": (str,), "weight": (int, float), "hf_config": (str, type(None)),
                 "hf_split": (str,), "text_field": (str,), "streaming": (bool,),
                 "max_documents": (int, type(None)), "max_tokens": (int, type(None))}
        for i, entry in enumerate(self.sources):
            flag = f"--data.sources[{i}]"
            if not isinstance(entry, dict):
                p.append(f"{flag} must be a mapping such as {{source: ..., weight: ...}} "
                         f"(got {entry!r})")
                continue
            unknown = sorted(set(entry) - set(self.SOURCE_KEYS))
            if unknown:
                p.append(f"{flag} has unknown keys {unknown}; known: "
                         f"{', '.join(self.SOURCE_KEYS)}")
            if not entry.get("source"):
                p.append(f"{flag}.source is required")
            for key, value in entry.items():
                if key not in kinds:
                    continue
                if not isinstance(value, kinds[key]) or (
                        isinstance(value, bool) and bool not in kinds[key]):
                    p.append(f"{flag}.{key} has the wrong type (got {value!r})")
                elif key == "weight" and not 0 < value < float("inf"):
                    p.append(f"{flag}.weight must be > 0 and finite (got {value})")
                elif key in ("max_documents", "max_tokens") and value is not None and value < 1:
                    p.append(f"{flag}.{key} must be >= 1 (got {value})")
        return p


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 50
    """Linear warmup length in optimizer steps."""
    decay_steps: int | None = None
    """Cosine length in optimizer steps (None: the trainer's max_steps)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (never on norms, biases or embeddings)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    train: Literal["all", "heads"] = "all"
    """`heads`: only heads 2..K learn; the trunk, head 1, embedding, final norm and unembedding
    stay as they are: frozen-trunk training (`mtp.train.frozen_trunk`), as Medusa-1 trains its
    heads on a pretrained model."""
    pretrained_lr_scale: float = 1.0
    """The learning rate of the trunk, head 1, embedding, final norm and unembedding, as a
    fraction of `lr`; heads 2..K learn at `lr` (below 1: Medusa-2's joint training)."""
    pretrained_delay_steps: int = 0
    """With `train: all`: the first N optimizer steps train heads 2..K alone (the pretrained
    part's rate is 0), and the pretrained part's own warmup and cosine start after them, so that
    new heads are trained before they pull the trunk (Medusa-2's two stages in one run)."""
    trunk_cache_mb: int = 4096
    """With `train: heads`: memory (MiB) for the frozen trunk's outputs (and self-distillation
    targets) of the training windows, computed once and reused in later epochs
    (`mtp.train.frozen_trunk`); 0 recomputes them every step."""
    trunk_cache_dir: str | None = None
    """With `train: heads`: keep the frozen trunk's outputs on disk here instead, in half
    precision, memory-mapped, for this run's later epochs and for every later run of the same
    model, targets and window length (a folder per such combination)."""

    def __post_init__(self) -> None:
        p = []
        if self.trunk_cache_mb < 0:
            p.append(f"--optim.trunk_cache_mb must be >= 0 (got {self.trunk_cache_mb})")
        if self.lr <= 0:
            p.append(f"--optim.lr must be > 0 (got {self.lr})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            p.append(f"--optim.min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        if self.warmup_steps < 0:
            p.append(f"--optim.warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.decay_steps is not None and self.decay_steps < 1:
            p.append(f"--optim.decay_steps must be >= 1 (got {self.decay_steps})")
        if self.weight_decay < 0:
            p.append(f"--optim.weight_decay must be >= 0 (got {self.weight_decay})")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            p.append(f"--optim.betas must lie in [0, 1) (got {self.betas})")
        if self.pretrained_delay_steps < 0:
            p.append(f"--optim.pretrained_delay_steps must be >= 0 (got "
                     f"{self.pretrained_delay_steps})")
        if self.pretrained_delay_steps and self.train == "heads":
            p.append("--optim.pretrained_delay_steps delays the pretrained part's training, "
                     "which --optim.train heads never starts: use --optim.train all")
        if not 0.0 < self.pretrained_lr_scale <= 1.0:
            p.append(f"--optim.pretrained_lr_scale must be in (0, 1] (got "
                     f"{self.pretrained_lr_scale})")
        _raise_if(p)


@dataclass
class LossConfig:
    """How the sum over heads of the cross-entropies is computed."""

    strategy: Literal["naive", "sequential"] = "sequential"
    """`naive` holds all K heads' logits at once; `sequential` runs one head at a time."""
    head_weights: list[float] | None = None
    """Weight w_i of head i in the loss (None: 1 for every head)."""
    schedule: Literal["constant", "ramp", "curriculum"] = "constant"
    """How the weights of heads 2..K move over training (`mtp.train.loss.scheduled_head_weights`):
    `constant` keeps `head_weights`; `ramp` scales them linearly from 0 at step 0 to their full
    value at `schedule_steps`; `curriculum` switches head i on at step
    (i - 1) / (K - 1) * `schedule_steps`, so the heads join one at a time. Head 1's weight
    never moves; validation uses the full weights. The weights in use are logged as
    `train/head_weight{i}`."""
    schedule_steps: int | None = None
    """Steps in which `ramp` and `curriculum` reach every head's full weight."""
    targets: Literal["data", "self", "greedy"] = "data"
    """`self`: head i learns the model's own greedy prediction of the token i ahead (head 1's
    argmax given the text so far, computed without gradient before each step) instead of the
    data's token: Medusa's self-distillation, for heads added to a pretrained model whose
    training data is not at hand. `greedy`: the same, only where the data's next i - 1 tokens
    are the model's own greedy ones (elsewhere ignored), so head i learns token i of the greedy
    continuation itself, which is what greedy speculation accepts."""
    soft_targets: bool = False
    """Head i learns the frozen model's own distribution of its token (head 1's, restricted to
    the draft vocabulary) instead of one token, wherever `targets` scores it. With `--optim.train
    heads` the frozen model is the trunk itself (EAGLE-3's loss; path `frozen_trunk_soft`); with
    `--optim.train all` it is a frozen copy of the `--model.init_from` model, so head 1 keeps
    its distribution while the trunk trains (Medusa-2's self-distillation;
    `mtp.train.loss.soft_sequential_path`)."""
    feature_weight: float = 0.0
    """With eagle heads and `--optim.train heads`: each unrolled step's output feature also
    regresses (smooth L1) to the frozen trunk's output at the position of the token it predicts
    the next one from, weighted this much times the step's head weight (EAGLE-1's feature
    loss; 0: off)."""

    def __post_init__(self) -> None:
        p = []
        if self.feature_weight < 0:
            p.append(f"--loss.feature_weight must be >= 0 (got {self.feature_weight})")
        if self.head_weights is not None and any(w < 0 for w in self.head_weights):
            p.append(f"--loss.head_weights must be >= 0 (got {self.head_weights})")
        if self.schedule != "constant" and (self.schedule_steps is None or
                                            self.schedule_steps < 1):
            p.append(f"--loss.schedule {self.schedule} needs --loss.schedule_steps >= 1 (got "
                     f"{self.schedule_steps})")
        if self.schedule == "constant" and self.schedule_steps is not None:
            p.append("--loss.schedule_steps applies to --loss.schedule ramp or curriculum only "
                     "(got --loss.schedule constant)")
        _raise_if(p)


@dataclass
class CompileConfig:
    """`torch.compile` of the training step's blocks."""

    enabled: bool = False
    """Compile every trunk block and head with `torch.compile` (each once: all blocks of a kind
    share one graph). Eager is the default: on a CPU compiling costs more than it saves in
    short runs (see `mtp bench train --compile`)."""
    mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    """`torch.compile` mode."""


@dataclass
class RunConfig:
    """Everything a training run needs besides the Trainer's own flags."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)

    def __post_init__(self) -> None:
        p = []
        if self.data.seq_len > self.model.max_seq_len:
            p.append(
                f"--data.seq_len ({self.data.seq_len}) exceeds --model.max_seq_len "
                f"({self.model.max_seq_len})"
            )
        if self.loss.targets != "data" and self.data.seq_len + self.model.n_future - 1 > \
                self.model.max_seq_len:
            p.append(f"--loss.targets {self.loss.targets} predicts over --data.seq_len + "
                     f"--model.n_future - 1 = {self.data.seq_len + self.model.n_future - 1} "
                     f"positions, more than "
                     f"--model.max_seq_len ({self.model.max_seq_len})")
        if self.data.tokenizer is None and self.model.init_from is None and \
                self.model.vocab_size < BYTE_LEVEL_BASE:
            p.append(f"--model.vocab_size ({self.model.vocab_size}) is below the "
                     f"{BYTE_LEVEL_BASE} tokens a byte-level BPE starts from (256 bytes and the "
                     f"end-of-text token); give at least {BYTE_LEVEL_BASE}, or a --data.tokenizer")
        if self.loss.soft_targets and self.optim.train == "all" and \
                (self.model.init_from is None or self.loss.strategy != "sequential"):
            p.append("--loss.soft_targets with --optim.train all learns the distributions of "
                     "the pretrained model training starts from, by the sequential pass: it "
                     "needs --model.init_from and --loss.strategy sequential")
        if self.loss.feature_weight and (self.model.head_type != "eagle" or
                                         self.optim.train != "heads"):
            p.append("--loss.feature_weight regresses eagle's draft features to the frozen "
                     "trunk's: it needs --model.head_type eagle and --optim.train heads (got "
                     f"--model.head_type {self.model.head_type}, --optim.train "
                     f"{self.optim.train})")
        if self.optim.train == "heads" and self.model.n_future < 2:
            p.append("--optim.train heads trains heads 2..K, but --model.n_future is 1")
        if self.model.head_type == "eagle" and self.model.n_future > 1 and \
                self.optim.train == "all" and self.loss.strategy == "sequential":
            p.append("--model.head_type eagle trains with --optim.train heads or --loss.strategy "
                     "naive: each unrolled step attends to the steps before it, which the "
                     "sequential strategy, one head at a time, does not keep")
        if self.loss.schedule != "constant" and self.model.n_future < 2:
            p.append(f"--loss.schedule {self.loss.schedule} moves the weights of heads 2..K, but "
                     "--model.n_future is 1")
        w = self.loss.head_weights
        if w is not None and len(w) != self.model.n_future:
            p.append(
                f"--loss.head_weights has {len(w)} entries but --model.n_future is "
                f"{self.model.n_future}"
            )
        _raise_if(p)
