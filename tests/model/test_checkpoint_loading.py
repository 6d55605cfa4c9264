"""What `load_checkpoint` refuses: a folder that is no mtp export (also as `mtp eval` and
`mtp generate --ckpt`), and a checkpoint, export or training checkpoint whose tensors do not
match the sha256 digests written with them (on load and on resume), naming the file and tensor."""

from pathlib import Path

import pytest
import torch
from checkpoint_helpers import debug_checkpoint
from data_helpers import TINY, fit_windows

from mtp.cli import main
from mtp.util.errors import InputError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """An untrained debug checkpoint with a 32-token context length."""
    return debug_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny.ckpt")


def test_eval_and_generate_refuse_a_folder_that_is_no_export(tmp_path, capsys):
    from mtp.model.checkpoint import load_checkpoint

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["eval", "humaneval", "--ckpt", str(empty), "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--ckpt {empty} is a directory but not an mtp export" in err
    assert "Traceback" not in err
    with pytest.raises(InputError, match=rf"{empty} is not an mtp export"):
        load_checkpoint(empty)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--ckpt", str(empty), "--prompt", "x"])
    assert exit_.value.code == 2 and f"{empty} is not an mtp export" in capsys.readouterr().err


def _corrupt(path: Path, tensor: torch.Tensor) -> None:
    """XOR 256 bytes inside `tensor`'s stored bytes in the file; the zip directory stays intact."""
    raw = bytearray(path.read_bytes())
    start = raw.find(tensor.detach().contiguous().numpy().tobytes())
    assert start >= 0, "the tensor's bytes are stored as they are"
    for i in range(start + 64, start + 320):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_a_corrupted_tensor_in_a_checkpoint_is_refused_naming_file_and_tensor(ckpt, tmp_path):
    import shutil

    from mtp.model.checkpoint import load_checkpoint
    from mtp.util.digests import DIGESTS

    bad = tmp_path / "bad.ckpt"
    shutil.copy(ckpt, bad)
    model, _ = load_checkpoint(bad)
    _corrupt(bad, model.embed.weight)
    torch.load(bad, weights_only=True)  # torch itself reads it without a word
    with pytest.raises(InputError, match=rf"checkpoint {bad} is corrupted: tensor "
                                         r"model\.embed\.weight does not match the sha256"):
        load_checkpoint(bad)
    # a checkpoint written before the digests loads unchecked
    old = torch.load(ckpt, weights_only=True)
    del old["mtp"][DIGESTS]
    torch.save(old, tmp_path / "old.ckpt")
    assert torch.equal(load_checkpoint(tmp_path / "old.ckpt")[0].embed.weight, model.embed.weight)


def test_a_corrupted_tensor_in_an_export_is_refused_naming_file_and_tensor(ckpt, tmp_path):
    import json

    from safetensors.torch import load_file

    from mtp.interop.hf_export import export
    from mtp.model.checkpoint import MTP_CONFIG, MTP_HEADS, load_checkpoint, load_export
    from mtp.util.digests import DIGESTS
    from mtp.util.errors import ExportError

    model, tok = load_checkpoint(ckpt)
    out = export(model, tok, tmp_path / "hf")
    assert torch.equal(load_export(out)[0].heads[1].attn.qkv.weight,
                       model.heads[1].attn.qkv.weight)
    # Flipped bytes in a draft head: safetensors reads the file without a word.
    _corrupt(out / MTP_HEADS, model.heads[1].attn.qkv.weight)
    load_file(out / MTP_HEADS)
    with pytest.raises(ExportError, match=rf"{out / MTP_HEADS} is corrupted: tensor "
                                          r"heads\.1\.attn\.qkv\.weight does not match"):
        load_export(out)
    # An export written before the digests loads unchecked.
    meta = json.loads((out / MTP_CONFIG).read_text())
    del meta[DIGESTS]
    (out / MTP_CONFIG).write_text(json.dumps(meta))
    load_export(out)


def test_a_corrupted_training_checkpoint_is_refused_on_resume_and_load(tiny_corpus, tmp_path,
                                                                      capsys):
    from mtp.model.checkpoint import load_checkpoint

    path = tmp_path / "a.ckpt"
    _, dm = fit_windows(tiny_corpus, tmp_path / "cache", 4, 1, save_to=path)
    model, _ = load_checkpoint(path)  # the digests Lightning's checkpoint carries match
    _corrupt(path, dict(model.named_parameters())["heads.0.attn.qkv.weight"])
    with pytest.raises(InputError, match=rf"checkpoint {path} is corrupted: tensor "
                                         r"model\.heads\.0\.attn\.qkv\.weight does not match"):
        load_checkpoint(path)
    with pytest.raises(InputError, match=rf"checkpoint {path} is corrupted"):
        fit_windows(tiny_corpus, tmp_path / "cache", 4, 2, ckpt_path=path)
    # `mtp fit --ckpt_path`: before any data is read
    flags = [f"--model.{k}={getattr(TINY, k)}" for k in ("vocab_size", "d_model", "n_layers",
                                                         "n_attn_heads", "n_future", "max_seq_len")]
    assert main(["fit", *flags, "--data.seq_len", "8", "--ckpt_path", str(path),
                 "--data.cache_dir", "/nonexistent/cache"]) == 2
    assert f"--ckpt_path: checkpoint {path} is corrupted" in capsys.readouterr().err
