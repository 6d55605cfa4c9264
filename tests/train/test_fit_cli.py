"""`mtp fit`'s checks before any data is read: `--ckpt_path` on an export directory or a folder
says what it is, and `--trainer.max_steps -1` or `0` without `--optim.decay_steps` is
refused."""

from pathlib import Path

import pytest
from checkpoint_helpers import debug_checkpoint

from mtp.cli import main
from mtp.config import OptimConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """An untrained debug checkpoint with a 32-token context length."""
    return debug_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny.ckpt")


def test_fit_ckpt_path_on_an_export_says_what_it_is(ckpt, tmp_path, capsys):
    export = tmp_path / "export"
    assert main(["export", "hf", "--ckpt", str(ckpt), "--output", str(export)]) == 0
    capsys.readouterr()
    assert main(["fit", "--ckpt_path", str(export), "--data.cache_dir", "/nonexistent/cache"]) == 2
    err = capsys.readouterr().err
    assert f"--ckpt_path: {export} is an export directory (`mtp export hf`)" in err
    assert "does not exist" not in err
    assert main(["fit", "--ckpt_path", str(tmp_path), "--data.cache_dir", "/nonexistent/c"]) == 2
    assert f"--ckpt_path: {tmp_path} is a directory, neither a checkpoint file nor an mtp " \
           f"export" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--trainer.max_steps", "-1"], "--trainer.max_steps -1 (no limit) leaves the cosine "
                                    "learning-rate schedule without a length"),
    (["--trainer.max_steps", "0"], "--trainer.max_steps 0 trains no step"),
    (["--trainer.max_steps", "-5"], "--trainer.max_steps must be >= 1, or -1 for no limit "
                                    "(got -5)"),
])
def test_max_steps_without_a_length_is_refused_before_the_data(args, message, capsys):
    # the cache folder cannot exist: the error comes before any data is read
    assert main(["fit", *args, "--data.cache_dir", "/nonexistent/cache"]) == 2
    assert message in capsys.readouterr().err


def test_max_steps_minus_one_with_decay_steps_passes_the_check():
    from mtp.train.cli import _check_max_steps

    _check_max_steps(-1, OptimConfig(decay_steps=100))  # trains until stopped
    with pytest.raises(ValueError, match="--optim.decay_steps N"):
        _check_max_steps(-1, OptimConfig())
