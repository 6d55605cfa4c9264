"""`--model.init_from`: a pretrained Llama-family model as trunk and head 1, plus new heads."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import REPO

from mtp.config import ModelConfig
from mtp.data.bpe import train_tokenizer
from mtp.decoding.generation import generate
from mtp.interop.hf_export import export
from mtp.interop.hf_import import init_from_pretrained, pretrained_config
from mtp.model.checkpoint import load_checkpoint
from mtp.model.transformer import MTPTransformer
from mtp.train.loss import mtp_loss
from mtp.train.targets import mtp_inputs_targets
from mtp.util.errors import ConfigError, ExportError

LLAMA3_EOS = "<|end_of_text|>"
TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, 300, 1 << 20)


@pytest.fixture(scope="module")
def llama3_tokenizer():
    """A tokenizer whose end-of-text token is Llama 3's ``<|end_of_text|>``."""
    return train_tokenizer(TEXTS, 300, 1 << 20, eot_token=LLAMA3_EOS)


def _pretrained(tmp_path: Path, tokenizer, kind: str = "llama", eos: str | None = None,
                **kw) -> Path:
    """A tiny randomly initialised transformers model, saved as `save_pretrained` does, with
    norm gains and biases away from their initial values so a misplaced one shows; with `eos`,
    a ``tokenizer_config.json`` naming it."""
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=500.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=0) | kw  # id 0: train_tokenizer's end of text
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.5)
    out = tmp_path / kind
    model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    if eos is not None:
        (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return out


def _ids(n=2, t=40):
    return torch.randint(0, 320, (n, t), generator=torch.Generator().manual_seed(3))


def _head_1_against_transformers(cfg: ModelConfig, path, with_model: bool = False):
    """All heads' logits (K, B, T, V) of the model `init_from_pretrained` builds from `path`,
    after checking head 1's against transformers' own to 1e-5 relative."""
    model = MTPTransformer(cfg)
    init_from_pretrained(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        ours = model.eval()(_ids())
        want = hf(_ids()).logits
    rel = (ours[0] - want).norm() / want.norm()
    assert rel <= 1e-5, f"relative error {rel:.2e}"
    return (ours, model) if with_model else ours


@pytest.mark.parametrize("kind, tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_head_1_is_the_pretrained_model_before_training(tmp_path, tokenizer, kind, tie):
    path = _pretrained(tmp_path, tokenizer, kind, tie_word_embeddings=tie)
    cfg = pretrained_config(path, ModelConfig(n_future=3, max_seq_len=64))
    assert (cfg.n_layers, cfg.d_model, cfg.attn_kv_heads, cfg.attn_bias, cfg.tie_embeddings) == \
        (2, 64, 2, kind == "qwen2", tie)
    ours = _head_1_against_transformers(cfg, path)
    # heads 2..K start as copies of head 1's block: the same logits, until trained
    for k in (1, 2):
        torch.testing.assert_close(ours[k], ours[0], rtol=0, atol=0)


@pytest.mark.parametrize("head_type", ["medusa", "medusa1", "linear", "deepseek", "eagle"])
def test_every_head_type_starts_from_the_pretrained_model(tmp_path, tokenizer, head_type):
    """The trunk holds every pretrained layer; head 1 is the identity where it has weights (so
    its logits are the pretrained model's), and medusa, medusa1 and linear heads 2..K start as
    head 1."""
    path = _pretrained(tmp_path, tokenizer)
    cfg = pretrained_config(path, ModelConfig(n_future=3, max_seq_len=64, head_type=head_type))
    assert cfg.n_trunk_layers == 3
    ours, model = _head_1_against_transformers(cfg, path, with_model=True)
    if head_type in ("deepseek", "eagle"):  # each module's block is the last layer
        torch.testing.assert_close(model.heads[1].block.attn.qkv.weight,
                                   model.blocks[-1].attn.qkv.weight, rtol=0, atol=0)
    else:
        for k in (1, 2):
            torch.testing.assert_close(ours[k], ours[0], rtol=0, atol=0)
    if head_type == "deepseek":  # (ModelConfig refuses matched_params for the others)
        with pytest.raises(ExportError, match="matched_params"):
            pretrained_config(path, ModelConfig(n_future=3, head_type=head_type,
                                                matched_params=True))


def test_eagle_feature_layers_start_from_the_pretrained_model_as_without_them(tmp_path,
                                                                            tokenizer):
    """`--model.feature_layers` with `init_from`: checked against the pretrained depth; the
    fusing map starts as the last layer's output alone, so every head computes what it computes
    without the feature layers."""
    path = _pretrained(tmp_path, tokenizer)
    base = ModelConfig(n_future=3, max_seq_len=64, head_type="eagle")
    with pytest.raises(ConfigError, match=r"below the trunk's last block, 3 \(got \[3\]\)"):
        pretrained_config(path, dataclasses.replace(base, feature_layers=[3]))
    models = []
    for layers in ([1], []):
        model = MTPTransformer(pretrained_config(path, dataclasses.replace(
            base, feature_layers=layers)))
        init_from_pretrained(model)
        models.append(model.eval())
    # the layer's own projection is drawn at random: the same in both
    models[1].load_state_dict({k: v for k, v in models[0].state_dict().items()
                               if ".fuse." not in k})
    with torch.no_grad():
        torch.testing.assert_close(models[0](_ids()), models[1](_ids()), rtol=0, atol=0)


def test_qwen2_model_exports_and_reads_back(tmp_path, tokenizer):
    path = _pretrained(tmp_path, tokenizer, "qwen2")
    model = MTPTransformer(pretrained_config(path, ModelConfig(n_future=2, max_seq_len=64)))
    init_from_pretrained(model)
    out = export(model, tokenizer, tmp_path / "export")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        rel = (hf(_ids()).logits - model.eval()(_ids(), heads=1)[0]).norm()
    assert rel / hf(_ids()).logits.norm() <= 1e-5
    back, _ = load_checkpoint(out)
    for name, w in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], w), name


@pytest.mark.parametrize("change, why", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not a supported causal LM"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rotary scaling"),
    ({"attention_bias": True}, "output-projection bias"),
])
def test_unsupported_pretrained_models_are_refused_with_the_reason(tmp_path, tokenizer, change,
                                                                    why):
    path = _pretrained(tmp_path, tokenizer)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None) if "rope_scaling" in change else None
    (path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ExportError, match=why):
        pretrained_config(path, ModelConfig())
    with pytest.raises(ExportError, match="no config.json"):
        pretrained_config(tmp_path, ModelConfig())


def _head_losses(model, tokenizer) -> torch.Tensor:
    ids = torch.tensor(tokenizer.encode("".join(TEXTS)).ids[:8 * 35]).view(8, 35)
    inputs, targets = mtp_inputs_targets(ids, model.cfg.n_future)
    with torch.no_grad():
        return mtp_loss(model.eval(), inputs, targets, path="metrics").head_losses


def test_medusa_1_trains_only_the_new_heads(tmp_path, llama3_tokenizer, monkeypatch):
    """`mtp fit --model.init_from DIR --optim.train heads`: the base model is bit-identical
    afterwards, heads 2..K learned, and greedy self-speculation still equals greedy. The
    pretrained tokenizer's end-of-text token is Llama 3's, named only by its
    tokenizer_config.json: it separates the documents, and the checkpoint and its export keep it."""
    tokenizer = llama3_tokenizer
    path = _pretrained(tmp_path, tokenizer, eos=LLAMA3_EOS)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"f{i}.py").write_text("".join(TEXTS[i % 2:]) * 3)
    from mtp.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(REPO / "configs/debug.yaml"), "--model.init_from",
                 str(path), "--model.n_future", "3", "--optim.train", "heads", "--optim.lr",
                 "0.01", "--trainer.max_steps", "30", "--trainer.val_check_interval", "30",
                 "--trainer.enable_progress_bar", "false", "--data.source", str(corpus),
                 "--data.cache_dir", str(tmp_path / "cache"),
                 "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]) == 0
    trained, tok = load_checkpoint(next((tmp_path / "runs").rglob("last.ckpt")))
    assert tok.to_str() == tokenizer.to_str()  # the pretrained model's tokenizer
    assert trained.cfg.eot_token == LLAMA3_EOS
    eos = tokenizer.token_to_id(LLAMA3_EOS)
    (meta_file,) = (tmp_path / "cache").rglob("meta.json")
    meta = json.loads(meta_file.read_text())
    tokens = np.concatenate([np.fromfile(meta_file.parent / f"{s}.bin", dtype=meta["dtype"])
                             for s in ("train", "val")])
    assert meta["eot_token"] == LLAMA3_EOS
    assert (tokens == eos).sum() == sum(meta["documents"].values()) == 20
    exported = export(trained, tok, tmp_path / "exported")
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert (hf_tok.eos_token, hf_tok.eos_token_id) == (LLAMA3_EOS, eos)
    base = MTPTransformer(trained.cfg)
    init_from_pretrained(base)
    new = {f"heads.{i}." for i in range(1, 3)}
    changed = []
    for name, w in base.state_dict().items():
        if not any(name.startswith(p) for p in new):
            assert torch.equal(trained.state_dict()[name], w), f"{name} moved"
        elif not torch.equal(trained.state_dict()[name], w):
            changed.append(name)
    assert changed  # the new heads did learn
    before, after = _head_losses(base, tokenizer), _head_losses(trained, tokenizer)
    assert after[0] == before[0] and (after[1:] < before[1:]).all(), (before, after)
    prompt = [tokenizer.encode("def add(a, b):").ids]
    greedy, _ = generate(trained, prompt, 24, decoder="greedy")
    spec, _ = generate(trained, prompt, 24, decoder="self-spec")
    assert spec == greedy


def test_medusa_2_gives_the_pretrained_part_a_smaller_learning_rate():
    from mtp.config import LossConfig, OptimConfig
    from mtp.train.module import MTPModule

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_attn_heads=2, n_future=3,
                      max_seq_len=32)
    module = MTPModule(cfg, OptimConfig(lr=1e-2, decay_steps=10, pretrained_lr_scale=0.1),
                       LossConfig())
    optimizer = module.configure_optimizers()["optimizer"]
    lr_of = {id(p): g["initial_lr"] for g in optimizer.param_groups for p in g["params"]}
    for name, p in module.model.named_parameters():
        new = name.startswith(("heads.1.", "heads.2."))
        assert lr_of[id(p)] == pytest.approx(1e-2 if new else 1e-3), name
    assert len(lr_of) == len(list(module.model.parameters()))  # every parameter, once


def test_medusa_2_delay_trains_the_new_heads_alone_first():
    from mtp.config import LossConfig, OptimConfig
    from mtp.train.module import MTPModule

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_attn_heads=2, n_future=3,
                      max_seq_len=32)
    module = MTPModule(cfg, OptimConfig(lr=1e-2, warmup_steps=2, decay_steps=10,
                                        min_lr_ratio=0.1, weight_decay=0.1,
                                        pretrained_lr_scale=0.1, pretrained_delay_steps=3),
                       LossConfig())
    config = module.configure_optimizers()
    optimizer, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    heads = ("heads.1.", "heads.2.")  # heads 2 and 3: new; the rest is pretrained
    new = {id(p) for n, p in module.model.named_parameters() if n.startswith(heads)}
    start = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    window = torch.randint(0, 64, (4, 19))
    rates = []
    for step in range(10):
        rates.append({("new" if id(g["params"][0]) in new else "old"): g["lr"]
                      for g in optimizer.param_groups})
        optimizer.zero_grad()
        mtp_loss(module.model, *module.inputs_targets(window)).loss.backward()
        optimizer.step()
        schedule.step()
        if step == 2:  # three steps: the pretrained part has not moved, decay included
            for name, p in module.model.named_parameters():
                assert torch.equal(p, start[name]) != name.startswith(heads), name
    # heads 2..K: warmup over 2 steps, cosine to a tenth at step 10, as without the delay
    assert [r["new"] for r in rates[:2]] == pytest.approx([5e-3, 1e-2])
    # the pretrained part: 0 for 3 steps, then its own warmup and a cosine over the 7 left
    assert [r["old"] for r in rates[:5]] == pytest.approx([0, 0, 0, 5e-4, 1e-3])
    assert rates[4]["new"] < 1e-2 and rates[9]["old"] > rates[9]["new"] / 10
    assert any(not torch.equal(p, start[n]) for n, p in module.model.named_parameters()
               if n.startswith("blocks."))


@pytest.mark.parametrize("flags, why", [
    (dict(train="heads", pretrained_delay_steps=5), "which --optim.train heads never starts"),
    (dict(pretrained_delay_steps=-1), "must be >= 0"),
    (dict(decay_steps=10, pretrained_delay_steps=10), "leaves the pretrained part no step"),
])
def test_medusa_2_delay_refuses_what_it_cannot_do(flags, why):
    from mtp.config import LossConfig, OptimConfig
    from mtp.train.module import MTPModule

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_attn_heads=2, n_future=2,
                      max_seq_len=32)
    with pytest.raises(ValueError, match=why):
        MTPModule(cfg, OptimConfig(**flags), LossConfig()).configure_optimizers()


def test_self_targets_are_the_models_own_greedy_predictions():
    from mtp.train.targets import self_targets

    torch.manual_seed(0)
    model = MTPTransformer(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_attn_heads=2,
                                       n_future=3, max_seq_len=32)).eval()
    window = torch.randint(0, 50, (2, 9))  # T = 6, K = 3
    got = self_targets(model, window, chunk=5)
    assert got.shape == (3, 2, 6)
    with torch.no_grad():  # prefix by prefix: the next token after each prefix, independently
        for b in range(2):
            for i in range(3):
                for t in range(6):
                    prefix = window[b:b + 1, :t + i + 1]
                    assert got[i, b, t] == model(prefix, heads=1)[0, 0, -1].argmax()


def test_self_distillation_teaches_the_new_heads_the_models_own_continuations():
    from mtp.config import DataConfig, LossConfig, OptimConfig, RunConfig
    from mtp.train.module import MTPModule
    from mtp.train.targets import self_targets

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_attn_heads=2, n_future=3,
                      max_seq_len=32)
    module = MTPModule(cfg, OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=60,
                                        train="heads"), LossConfig(targets="self"))
    optimizer = module.configure_optimizers()["optimizer"]
    window = torch.randint(0, 50, (8, 19))

    def head_losses():
        inputs, _ = mtp_inputs_targets(window, 3)
        with torch.no_grad():
            return mtp_loss(module.model, inputs, self_targets(module.model, window),
                            path="metrics").head_losses

    before = head_losses()
    for _ in range(60):
        optimizer.zero_grad()
        mtp_loss(module.model, *module.inputs_targets(window)).loss.backward()
        optimizer.step()
    after = head_losses()
    assert after[0] == before[0] and (after[1:] < before[1:] - 0.5).all(), (before, after)
    with pytest.raises(ValueError, match="--loss.targets self predicts over"):
        RunConfig(model=cfg, data=DataConfig(seq_len=32), loss=LossConfig(targets="self"))


@pytest.mark.parametrize("problem, why", [
    ("bigger", "has 7\\d\\d tokens but the embedding of --model.init_from"),
    ("no_eot", "has no end-of-text token '</s>' \\(--model.eot_token\\)"),
    ("missing", "does not exist"),
])
def test_fit_refuses_a_pretrained_tokenizer_that_does_not_fit(tmp_path, tokenizer, capsys,
                                                              problem, why):
    from tokenizers import Tokenizer, models

    from mtp.cli import main

    path = _pretrained(tmp_path, tokenizer)
    tok_file = path / "tokenizer.json"
    if problem == "bigger":
        bigger = Tokenizer.from_str(tokenizer.to_str())
        bigger.add_tokens([f"extra{i}" for i in range(450)])
        bigger.save(str(tok_file))
    elif problem == "no_eot":
        Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tok_file))
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    else:
        tok_file.unlink()
    code = main(["fit", "--config", str(REPO / "configs/debug.yaml"), "--model.init_from",
                 str(path), "--data.cache_dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert code == 2 and re.search(why, err), err
    assert not (tmp_path / "cache").exists()  # refused before any data was read


def test_the_end_of_text_token_is_the_pretrained_tokenizers_own(tmp_path, llama3_tokenizer):
    """tokenizer_config.json's eos_token (a string or an AddedToken dict), else the first
    eos_token_id of generation_config.json or config.json; an explicit --model.eot_token wins."""
    from mtp.interop.hf_import import pretrained_eos

    path = _pretrained(tmp_path, llama3_tokenizer)
    assert pretrained_eos(path) == LLAMA3_EOS  # eos_token_id 0, from generation_config.json
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 0]}))
    assert pretrained_eos(path) == llama3_tokenizer.id_to_token(5)  # the first of several
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "b", "special": True}}))
    cfg = ModelConfig(n_future=2)
    assert pretrained_eos(path) == pretrained_config(path, cfg).eot_token == "b"
    assert pretrained_config(path, ModelConfig(n_future=2, eot_token="a")).eot_token == "a"
    (path / "tokenizer_config.json").unlink()
    (path / "generation_config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    del config["eos_token_id"]
    (path / "config.json").write_text(json.dumps(config))
    assert pretrained_eos(path) is None
    assert pretrained_config(path, cfg).eot_token == "<|endoftext|>"  # mtp's default
