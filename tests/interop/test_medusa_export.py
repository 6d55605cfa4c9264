"""`mtp export medusa`: heads 2..K of a medusa1 model in the layout of vLLM's Medusa loader.

`load_like_vllm` below is written from vLLM's own source, not from mtp's:
`vllm/transformers_utils/configs/medusa.py` (`MedusaConfig`: its defaults, and its
`from_pretrained`, which renames keys holding "num" and "heads" or "layers"),
`vllm/model_executor/models/medusa.py` (`ResidualBlock`: x = x + SiLU(Linear(x)) per layer, with
a bias where the config has ``medusa_fc_bias``; `Medusa`: one block and one lm_head of
``truncated_vocab_size`` rows per head, `load_weights` dropping a ``medusa_heads.`` prefix,
keeping ``token_map`` only when the vocabulary is truncated and cutting an lm_head of more rows
than the map down to the map's rows, `compute_logits` scattering a truncated head's logits into a
row of -inf) and `vllm/config/speculative.py` (``num_speculative_tokens`` becomes the config's
``num_heads``). vLLM itself is not run here (its Medusa path needs a GPU build).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from mtp.cli import main
from mtp.config import HEAD_TYPES, ModelConfig
from mtp.data.bpe import train_tokenizer
from mtp.interop.hf_export import export as export_hf
from mtp.interop.vllm_medusa import export
from mtp.model.checkpoint import save_checkpoint
from mtp.model.transformer import MTPTransformer
from mtp.util.errors import ExportError

V, K = 320, 4


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300, 1 << 20)


def _model(head_type: str = "medusa1", n_future: int = K, draft_vocab: int = 0,
           seed: int = 0) -> MTPTransformer:
    """A small fp32 model with every weight away from its initial value: the heads' weights and
    biases random and non-zero, the norm gains away from 1 (so a misplaced norm shows), and a
    draft vocabulary that is neither a prefix of the ids nor sorted."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_attn_heads=2, n_future=n_future,
                      max_seq_len=64, head_type=head_type, draft_vocab=draft_vocab)
    model = MTPTransformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("heads."):
                p.normal_(0, 0.2)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5)
        if draft_vocab:
            model.draft_ids.copy_(torch.randperm(V)[:draft_vocab])
    return model


# ------------------------------------------------------------------------------------------
# vLLM's Medusa loader, as its source reads


class _ResidualBlock(nn.Module):
    def __init__(self, config: dict, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(hidden_size, hidden_size, bias=config.get("medusa_fc_bias", False))
            for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class _Medusa(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            _ResidualBlock(config, config["hidden_size"], config["num_hidden_layers"])
            for _ in range(config["num_heads"]))
        self.orig_vocab_size = config["vocab_size"]
        self.truncated_vocab_size = config["truncated_vocab_size"]
        self.lm_heads = nn.ModuleList(
            nn.Linear(config["hidden_size"], self.truncated_vocab_size, bias=False)
            for _ in range(config["num_heads"]))
        self.logit_scale = config.get("logit_scale", 1.0)
        self.token_map = None

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded, weights_map = set(), {}
        for name, w in weights:
            name = name.replace("medusa_heads.", "")
            if name == "token_map":
                if self.truncated_vocab_size < self.orig_vocab_size:
                    self.token_map = w
            elif name in params:
                weights_map[name] = w
        for name, w in weights_map.items():
            if "lm_head" in name and self.token_map is not None and \
                    w.shape[0] > self.token_map.shape[0]:
                w = w[self.token_map]
            assert params[name].shape == w.shape, (name, params[name].shape, w.shape)
            with torch.no_grad():
                params[name].copy_(w)
            loaded.add(name)
        assert self.truncated_vocab_size == self.orig_vocab_size or self.token_map is not None
        return loaded

    def forward(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """Each head's logits (N, vocab_size) from the target's final hidden states (N, d)."""
        out = []
        for block, lm_head in zip(self.blocks, self.lm_heads):
            logits = lm_head(block(hidden_states)) * self.logit_scale
            if self.token_map is not None:
                full = -torch.inf * torch.ones(*logits.shape[:-1], self.orig_vocab_size,
                                               dtype=logits.dtype)
                full[..., self.token_map] = logits
                logits = full
            out.append(logits)
        return out


def load_like_vllm(path: Path, num_speculative_tokens: int | None = None) -> _Medusa:
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "medusa" and raw["architectures"] == ["MedusaModel"]
    for key in list(raw):  # MedusaConfig.from_pretrained
        if "num" in key:
            if "heads" in key:
                raw["num_heads"] = raw.pop(key)
            elif "layers" in key:
                raw["num_hidden_layers"] = raw.pop(key)
    config = {"hidden_size": 4096, "vocab_size": 32001, "num_heads": 5, "num_hidden_layers": 1,
              "truncated_vocab_size": None} | raw
    if config["truncated_vocab_size"] is None:
        config["truncated_vocab_size"] = config["vocab_size"]
    if num_speculative_tokens is not None:  # SpeculativeConfig sets num_lookahead_tokens
        config["num_heads"] = num_speculative_tokens
    model = _Medusa(config)
    weights = {}
    for f in sorted(path.glob("*.safetensors")):  # the default loader reads every one
        weights |= load_file(f)
    loaded = model.load_weights(weights.items())
    # vLLM refuses a model with a parameter the checkpoint did not fill
    assert loaded == set(dict(model.named_parameters())), loaded
    return model


# ------------------------------------------------------------------------------------------


def _ids(t: int = 24) -> torch.Tensor:
    return torch.randint(0, V, (3, t), generator=torch.Generator().manual_seed(1))


def _assert_reproduces(medusa: _Medusa, z: torch.Tensor, model: MTPTransformer,
                       heads: int) -> None:
    """vLLM heads 0..heads-1, fed the final hidden states z (B, T, d), give mtp heads
    2..heads+1's draft logits."""
    with torch.no_grad():
        got = medusa(z.flatten(0, 1))  # vLLM feeds a flat batch of tokens
        want = model(_ids())[1:]  # (K - 1, B, T, V): draft_logits of heads 2..K
    assert len(got) == heads
    for j in range(heads):
        torch.testing.assert_close(got[j], want[j].flatten(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("draft_vocab", [0, 40], ids=["full-vocab", "draft-vocab"])
def test_the_export_reproduces_the_draft_logits(tmp_path, draft_vocab):
    model = _model(draft_vocab=draft_vocab)
    out = export(model, tmp_path / "medusa")
    config = json.loads((out / "config.json").read_text())
    assert (config["num_heads"], config["num_hidden_layers"], config["hidden_size"],
            config["vocab_size"], config["medusa_fc_bias"]) == (K - 1, 1, 32, V, True)
    assert config.get("truncated_vocab_size") == (draft_vocab or None)
    names = set(load_file(out / "model.safetensors"))
    assert ("token_map" in names) == bool(draft_vocab)
    assert {f"blocks.{j}.layers.0.{w}" for j in range(K - 1) for w in ("weight", "bias")} \
        | {f"lm_heads.{j}.weight" for j in range(K - 1)} <= names
    medusa = load_like_vllm(out)
    with torch.no_grad():
        z = model.norm(model.trunk(_ids())[0])  # the target's final hidden state
    _assert_reproduces(medusa, z, model, K - 1)
    if draft_vocab:  # drafts come from the draft vocabulary alone
        outside = torch.ones(V, dtype=torch.bool)
        outside[model.draft_ids] = False
        assert torch.isinf(medusa(z[0])[0][:, outside]).all()


def test_fewer_speculative_tokens_run_the_first_heads(tmp_path):
    """vLLM builds `num_speculative_tokens` heads and loads those: mtp heads 2 and 3 here."""
    model = _model()
    medusa = load_like_vllm(export(model, tmp_path / "medusa"), num_speculative_tokens=2)
    with torch.no_grad():
        z = model.norm(model.trunk(_ids())[0])
    _assert_reproduces(medusa, z, model, 2)


def test_the_heads_draft_from_the_export_hf_target(tmp_path, tokenizer):
    """The pair vLLM serves: `mtp export hf` as the target (transformers' final hidden state,
    after its final norm) and `mtp export medusa` as the draft give mtp's head 1 and draft
    logits."""
    transformers = pytest.importorskip("transformers")
    model = _model(draft_vocab=40)
    target = export_hf(model, tokenizer, tmp_path / "hf")
    medusa = load_like_vllm(export(model, tmp_path / "medusa"))
    llama = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        z = llama.model(_ids()).last_hidden_state  # (B, T, d)
        torch.testing.assert_close(llama.lm_head(z), model(_ids(), heads=1)[0], rtol=1e-5,
                                   atol=1e-5)
    _assert_reproduces(medusa, z, model, K - 1)


def test_every_other_head_type_is_refused_naming_it(tmp_path):
    others = [t for t in HEAD_TYPES if t != "medusa1"]
    assert others
    for head_type in others:
        with pytest.raises(ExportError) as err:
            export(_model(head_type), tmp_path / head_type)
        assert f"--model.head_type {head_type}: " in str(err.value)
        assert "only medusa1 heads have vLLM's Medusa layout" in str(err.value)
    with pytest.raises(ExportError, match="--model.n_future 1: the model has no heads 2..K"):
        export(_model(n_future=1), tmp_path / "k1")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left


def test_an_output_in_use_is_refused_and_kept(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("a file")
    for output in (taken, tmp_path / "file"):
        with pytest.raises(ExportError, match="exists and is not an empty directory"):
            export(_model(), output)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    assert (tmp_path / "file").read_text() == "a file"
    empty = tmp_path / "empty"
    empty.mkdir()
    export(_model(), empty)  # an empty directory is taken
    assert sorted(p.name for p in empty.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "taken"]


def test_cli_exports_and_refuses_with_exit_2(tmp_path, tokenizer, capsys):
    ckpt, block = tmp_path / "medusa1.ckpt", tmp_path / "block.ckpt"
    model = _model()
    save_checkpoint(ckpt, model, tokenizer)
    save_checkpoint(block, _model("block"), tokenizer)
    assert main(["export", "medusa", "--ckpt", str(ckpt), "--output", str(tmp_path / "m")]) == 0
    assert "vLLM Medusa heads 0..2 (mtp heads 2..4)" in capsys.readouterr().out
    with torch.no_grad():
        z = model.norm(model.trunk(_ids())[0])
    _assert_reproduces(load_like_vllm(tmp_path / "m"), z, model, K - 1)
    assert main(["export", "medusa", "--ckpt", str(ckpt), "--output", str(tmp_path / "m")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["export", "medusa", "--ckpt", str(block), "--output", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "mtp export: error: --model.head_type block: " in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()
    # `mtp export hf` carries medusa1 checkpoints: the pair vLLM serves, from one checkpoint
    assert main(["export", "hf", "--ckpt", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    assert "LlamaForCausalLM of 2 layers (head 1), heads 2..4" in capsys.readouterr().out
    assert main(["export", "medusa", "--ckpt", str(tmp_path / "hf"), "--output",
                 str(tmp_path / "m2")]) == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "m" / name).read_bytes() == (tmp_path / "m2" / name).read_bytes()
