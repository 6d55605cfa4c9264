"""The README's commands: CI runs the test command, every `mtp ...` line is a valid command."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from mtp.cli import main
from mtp.config import (
    CompileConfig,
    DataConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
)

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _code_lines() -> list[str]:
    """Command lines of the README's bash blocks, continuation lines joined, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line:
                lines.append(line)
    return lines


def test_ci_runs_the_readme_test_command():
    setup_and_test = [line for line in _code_lines() if line.endswith("&& pytest")]
    assert len(setup_and_test) == 1, "the README gives one command that sets up and runs tests"
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    for step in setup_and_test[0].split(" && "):
        assert step in ci, f"README step {step!r} is not in .ci/run"
    assert setup_and_test[0].replace("&& pytest", "&& mtp fit") in _code_lines(), \
        "the train command is the test command's setup followed by `mtp fit`"


def _mtp_commands() -> list[list[str]]:
    cmds = []
    for line in _code_lines():
        for part in line.split(" && "):
            words = shlex.split(part)
            if words[:1] == ["mtp"]:
                cmds.append(words[1:])
    return cmds


@pytest.mark.parametrize("args", [c for c in _mtp_commands() if c and c[0] == "fit"],
                         ids=lambda c: " ".join(c)[:60])
def test_readme_fit_commands_parse(args, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--print_config"])  # parses every key and type, trains nothing
    out = capsys.readouterr()
    assert exit_.value.code in (0, None), out.err
    if "--help" in args:
        return
    cfg = yaml.safe_load(out.out)
    RunConfig(model=ModelConfig(**cfg["model"]), data=DataConfig(**cfg["data"]),
              optim=OptimConfig(**cfg["optim"]), loss=LossConfig(**cfg["loss"]),
              compile=CompileConfig(**cfg["compile"]))  # values


@pytest.mark.parametrize("args", [c for c in _mtp_commands() if c and c[0] != "fit"],
                         ids=lambda c: " ".join(c)[:60])
def test_readme_other_commands_exist(args):
    sub = args[:2] if args[0] in ("bench", "eval") else args[:1]
    with pytest.raises(SystemExit) as exit_:
        main([*sub, "--help"])
    assert exit_.value.code in (0, None)
