"""`mtp export hf`: transformers reads head 1 as a LlamaForCausalLM, and mtp reads it all back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from mtp.cli import main as cli_main
from mtp.config import ModelConfig
from mtp.data.bpe import train_tokenizer
from mtp.decoding.generation import generate
from mtp.interop.hf_export import export
from mtp.model.checkpoint import EOT_TOKEN, load_checkpoint, load_export, save_checkpoint
from mtp.model.transformer import MTPTransformer
from mtp.util.errors import ExportError, InputError

TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"] * 20
MTP = [str(Path(sys.executable).parent / "mtp")]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, 300, 1 << 20)


def _model(K=4, n_attn_kv_heads=None, tie=False, head_type="block", seed=0) -> MTPTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_attn_heads=4,
                      n_attn_kv_heads=n_attn_kv_heads,
                      n_future=K, max_seq_len=64, tie_embeddings=tie, head_type=head_type,
                      rope_theta=500.0, norm_eps=1e-6)
    model = MTPTransformer(cfg).eval()
    with torch.no_grad():  # norm gains away from 1, so a misplaced norm shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("K, n_kv_heads, tie", [(1, None, False), (4, None, False),
                                                (4, 2, False), (4, 1, True)],
                         ids=["K1", "K4", "K4-gqa", "K4-mqa-tied"])
def test_transformers_logits_are_head_1s(tmp_path, tokenizer, K, n_kv_heads, tie):
    model = _model(K, n_kv_heads, tie)
    export(model, tokenizer, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, 320, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids, heads=1)[0]
        got = hf(ids).logits
    rel = (got - want).norm() / want.norm()
    assert rel <= 1e-5, f"relative error {rel:.2e}"


def test_round_trip_equals_the_original_in_every_parameter(tmp_path, tokenizer):
    for tie in (False, True):
        model = _model(4, 2, tie)
        out = export(model, tokenizer, tmp_path / f"hf-{tie}")
        back, tok = load_checkpoint(out)
        assert back.cfg == model.cfg and tok.to_str() == tokenizer.to_str()
        want = model.state_dict()
        got = back.state_dict()
        assert got.keys() == want.keys()
        for name, w in want.items():
            assert torch.equal(got[name], w), name


def test_tokenizer_and_greedy_generation_agree_with_transformers(tmp_path, tokenizer):
    model = _model(4)
    export(model, tokenizer, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def add(a, b):\n    return a"
    assert hf_tok(text)["input_ids"] == tokenizer.encode(text).ids
    assert hf_tok.eos_token == EOT_TOKEN
    assert hf_tok.eos_token_id == tokenizer.token_to_id(EOT_TOKEN)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = tokenizer.encode(text).ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    ours, _ = generate(model, [prompt], 20, decoder="greedy")
    assert out[0, len(prompt):].tolist() == ours[0]


def test_medusa1_head_1_is_the_trunk_and_heads_2_to_k_read_back(tmp_path, tokenizer):
    """medusa1's head 1 is the trunk's own output: the Llama holds the trunk's layers alone, its
    logits are head 1's and its last hidden state (after the final norm) is what heads 2..K
    read; the heads, biases included, read back bit for bit."""
    model = _model(4, head_type="medusa1")
    with torch.no_grad():  # heads away from their zero start (the biases are set by _model)
        for head in model.heads[1:]:
            head.proj.weight.normal_(0, 0.1)
    out = export(model, tokenizer, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == model.cfg.n_trunk_layers == 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 320, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = hf(ids).logits
        last = hf.model(ids).last_hidden_state  # (B, T, d), after the final norm
        want = model(ids)  # (K, B, T, V)
        z = model.norm(model.trunk(ids)[0])
    assert (logits - want[0]).norm() / want[0].norm() <= 1e-5
    torch.testing.assert_close(last, z, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for i in (1, 2, 3):  # head i + 1 from the Llama's last hidden state
            x = last + torch.nn.functional.silu(model.heads[i].proj(last))
            torch.testing.assert_close(model.unembed(x), want[i], rtol=1e-5, atol=1e-5)
    back, _ = load_checkpoint(out)
    assert back.cfg == model.cfg
    for name, w in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], w), name


@pytest.mark.parametrize("head_type", ["deepseek", "eagle"])
def test_chained_heads_export_the_trunk_as_head_1_and_read_back_whole(tmp_path, tokenizer,
                                                                     head_type):
    """DeepSeek's modules and eagle's layer leave head 1 the trunk's own output: the Llama holds
    the trunk's layers alone and its logits are head 1's; eagle's one layer is written once and
    every head reads it back; every parameter reads back bit for bit."""
    from safetensors.torch import load_file

    model = _model(4, head_type=head_type)
    out = export(model, tokenizer, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == model.cfg.n_trunk_layers == 3  # head 1's block too
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 320, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids, heads=1)[0]
        torch.testing.assert_close(want, model.unembed(model.norm(model.trunk(ids)[0])))
        logits = hf(ids).logits
    assert (logits - want).norm() / want.norm() <= 1e-5
    written = {k.split(".")[1] for k in load_file(out / "mtp_heads.safetensors") if
               k.startswith("heads.")}
    assert written == ({"1"} if head_type == "eagle" else {"1", "2", "3"})
    back, _ = load_checkpoint(out)
    assert back.cfg == model.cfg
    assert (back.heads[1] is back.heads[3]) == (head_type == "eagle")
    for name, w in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], w), name
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), rtol=0, atol=0)


def test_bad_exports_are_refused_and_nothing_is_overwritten(tmp_path, tokenizer):
    for head_type in ("linear", "medusa"):
        with pytest.raises(ExportError, match=f"--model.head_type {head_type}: .* neither"):
            export(_model(head_type=head_type), tokenizer, tmp_path / head_type)
        assert not (tmp_path / head_type).exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty directory"):
        export(_model(), tokenizer, taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    assert (taken / "keep.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="not an mtp export"):
        load_export(taken)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def _edit_config(out: Path, **change) -> None:
    meta = json.loads((out / "mtp_config.json").read_text())
    meta["model_config"].update(change)
    (out / "mtp_config.json").write_text(json.dumps(meta))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize("edit, message", [
    (lambda out: (out / "tokenizer.json").unlink(), "tokenizer.json is not a readable tokenizer"),
    (lambda out: (out / "tokenizer.json").write_text("{"), "tokenizer.json is not a readable"),
    (lambda out: _cut(out / "mtp_config.json"),
     "mtp_config.json does not hold an mtp model config: JSONDecodeError"),
    (lambda out: _edit_config(out, bogus=1),
     "mtp_config.json does not hold an mtp model config: TypeError"),
    (lambda out: _edit_config(out, n_future=0), "--model.n_future must be >= 1"),
    (lambda out: _edit_config(out, d_model=128),
     "the weights do not fit the model config of mtp_config.json (size mismatch for"),
    (lambda out: _cut(out / "model.safetensors"), "model.safetensors cannot be read"),
], ids=["tokenizer-deleted", "tokenizer-edited", "config-cut", "config-unknown-key",
        "config-bad-value", "config-other-width", "weights-cut"])
def test_an_export_with_a_file_deleted_or_edited_is_refused_naming_it(tmp_path, tokenizer, edit,
                                                                      message):
    out = export(_model(4), tokenizer, tmp_path / "hf")
    edit(out)
    with pytest.raises(InputError) as err:  # a user's input: `mtp` reports it in a line or two
        load_checkpoint(out)
    assert message in str(err.value) and str(out) in str(err.value), err.value


def test_cli_export_to_a_path_below_a_file_is_refused(tmp_path, tokenizer, capsys):
    ckpt = tmp_path / "model.ckpt"
    save_checkpoint(ckpt, _model(2), tokenizer)
    (tmp_path / "notes.txt").write_text("a file\n")
    assert cli_main(["export", "hf", "--ckpt", str(ckpt), "--output",
                     str(tmp_path / "notes.txt" / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"--output {tmp_path / 'notes.txt' / 'hf'}: " in err and "nothing was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt", "notes.txt"]


def test_cli_exports_and_the_directory_serves_as_a_checkpoint(tmp_path, tokenizer):
    ckpt = tmp_path / "model.ckpt"
    save_checkpoint(ckpt, _model(4), tokenizer)
    proc = subprocess.run([*MTP, "export", "hf", "--ckpt", str(ckpt), "--output",
                           str(tmp_path / "hf")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "heads 2..4 in mtp_heads.safetensors" in proc.stdout
    again = subprocess.run([*MTP, "export", "hf", "--ckpt", str(ckpt), "--output",
                            str(tmp_path / "hf")], capture_output=True, text=True)
    assert again.returncode == 2 and "not an empty directory" in again.stderr
    assert "Traceback" not in again.stderr
    gen = subprocess.run([*MTP, "generate", "--ckpt", str(tmp_path / "hf"), "--prompt",
                          "def add(", "--max-new-tokens", "12", "--decoder", "self-spec",
                          "--compare", "greedy"], capture_output=True, text=True)
    assert gen.returncode == 0, gen.stderr
    assert "speedup" in gen.stdout + gen.stderr


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, tokenizer):
    out = export(_model(2), tokenizer, tmp_path / "hf")
    bigger = Tokenizer.from_str(tokenizer.to_str())
    bigger.add_tokens([f"extra{i}" for i in range(400)])
    bigger.save(str(out / "tokenizer.json"))
    n = bigger.get_vocab_size()
    with pytest.raises(ValueError, match=f"has {n} tokens but the model's vocabulary"):
        load_checkpoint(out)


def test_cli_export_to_a_full_disk_is_named_and_leaves_nothing(tmp_path, tokenizer, monkeypatch,
                                                               capsys):
    """Issue 41, case 5: a full disk while `mtp export hf` writes is one line naming --output,
    exit 2, no temporary folder left; on a real small disk safetensors' own error is named the
    same way."""
    from disk_helpers import failing_fsync, small_disk

    ckpt = tmp_path / "model.ckpt"
    save_checkpoint(ckpt, _model(2), tokenizer)
    failing_fsync(monkeypatch, "model.safetensors")
    out = tmp_path / "hf"
    assert cli_main(["export", "hf", "--ckpt", str(ckpt), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"mtp export: error: --output: cannot write the export {out}: No space left on " \
           "device; nothing was left there" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]
    monkeypatch.undo()
    with small_disk(tmp_path / "disk", "64k") as disk:
        assert cli_main(["export", "hf", "--ckpt", str(ckpt), "--output",
                         str(disk / "hf")]) == 2
        err = capsys.readouterr().err
        assert f"cannot write the export {disk / 'hf'}: No space left on device" in err
        assert "Traceback" not in err and "SafetensorError" not in err
        assert list(disk.iterdir()) == []
