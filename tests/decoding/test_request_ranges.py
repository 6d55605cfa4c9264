"""Numbers a decode request takes, in range (issue 41, cases 8, 10 and 11): `--seed` within
the generators' range, a temperature too small to divide by refused, rounds of drafts no longer
than the context, `--threads` no more than the CPUs; a `--ckpt` that is a pipe named as one.
Each is one line naming the flag, exit 2, before anything is allocated."""

from __future__ import annotations

import os

import pytest
import torch
from checkpoint_helpers import debug_checkpoint

from mtp.cli import main
from mtp.decoding.generation import generate
from mtp.decoding.request import MIN_TEMPERATURE, DecodeRequest, RequestError
from mtp.model.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """An untrained debug checkpoint with a 32-token context (K = 2)."""
    return debug_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny.ckpt")


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("args, message", [
    (["--decoder", "sample", "--seed", "1180591620717411303424"],
     "--seed must be a whole number in [0, 4294967295], the range of the random generators it "
     "seeds (got 1180591620717411303424)"),
    (["--decoder", "sample", "--seed", "-1"], "--seed must be a whole number in [0, "),
    (["--decoder", "sample", "--temperature", "1e-40"],
     "--temperature 1e-40 is too small to divide the logits by (the quotients overflow float32 "
     "and sampling fails): give 0 for greedy decoding, or at least 1e-05"),
    (["--decoder", "self-spec", "--temperature", "1e-9"], "--temperature 1e-09 is too small"),
    (["--decoder", "draft", "--gamma", "1000000000"],
     "--gamma 1000000000: a round of more drafts than the context length (32 tokens) holds "
     "cannot be verified"),
    (["--decoder", "self-spec", "--lookup", "1000000000000"],
     "--lookup 1000000000000: a round of more drafts than the context length"),
    (["--threads", "100000"], "--threads must be in [1, "),
], ids=["seed-huge", "seed-negative", "temperature", "temperature-speculative", "gamma",
        "lookup", "threads"])
def test_numbers_out_of_range_are_refused_naming_the_flag(ckpt, capsys, args, message):
    extra = ["--draft-ckpt", str(ckpt)] if "draft" in args else []
    err = _refused(["generate", "--ckpt", str(ckpt), "--prompt", "def f():", *extra, *args],
                   capsys)
    assert message in err


def test_the_smallest_temperature_samples_and_a_smaller_one_is_refused_in_generate(ckpt):
    """The rule lives in the request's one validator: `generate` refuses too, and at the
    smallest temperature allowed sampling is well defined (no NaN)."""
    model, tok = load_checkpoint(ckpt)
    ids = [tok.encode("def f():").ids]
    with pytest.raises(RequestError, match="temperature 1e-40 is too small to divide"):
        generate(model, ids, 4, decoder="sample", temperature=1e-40)
    new, _ = generate(model, ids, 4, decoder="sample", temperature=MIN_TEMPERATURE,
                      generator=torch.Generator().manual_seed(0))
    greedy, _ = generate(model, ids, 4, decoder="greedy")
    assert new == greedy  # this cold, sampling is greedy in effect
    assert DecodeRequest(decoder="sample", temperature=MIN_TEMPERATURE).problems() == []


def test_a_checkpoint_that_is_a_pipe_or_a_device_is_named_for_what_it_is(ckpt, tmp_path,
                                                                         capsys):
    pipe = tmp_path / "model.ckpt"
    os.mkfifo(pipe)
    err = _refused(["generate", "--ckpt", str(pipe), "--prompt", "x"], capsys)
    assert f"--ckpt: checkpoint {pipe} is a named pipe, not a checkpoint file" in err
    err = _refused(["generate", "--ckpt", "/dev/zero", "--prompt", "x"], capsys)
    assert "--ckpt: checkpoint /dev/zero is a character device, not a checkpoint file" in err
