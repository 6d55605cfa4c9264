"""The README's and docs/'s commands: CI runs the test command, every `mtp ...` line is a valid
command."""

import csv
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from mtp.cli import main
from mtp.config import CompileConfig, DataConfig, LossConfig, ModelConfig, OptimConfig, RunConfig

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
#: The README and the guides it links to (docs/*.md), whose commands are checked alike.
DOCS = "\n".join([README, *(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))])
DATA = Path(os.environ.get("MTP_SHARED_DATA", REPO.parent / "shared" / "data"))
MBPP_FILE = str(DATA / "mbpp" / "mbpp.jsonl")


def _code_lines() -> list[str]:
    """Command lines of the bash blocks of the README and docs/, continuation lines joined,
    comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", DOCS, flags=re.S):
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


# What each README command is run with beyond its own flags, to keep it to seconds: sizes only
# (argparse keeps the last value of a flag, so these override the README's where both give one).
SHRINK = {
    ("generate",): ["--max-new-tokens", "4"],
    ("eval", "humaneval"): ["--limit", "1", "--n-samples", "10", "--max-new-tokens", "8",
                            "--batch-size", "10"],
    ("eval", "mbpp"): ["--limit", "1", "--data-file", MBPP_FILE],  # offline: the local copy
    ("export",): [],
    ("distill",): ["--requests", "2", "--max-new-tokens", "4", "--batch-size", "2"],
    ("bench", "loss"): ["--n", "64", "--d", "32", "--vocab", "128", "--seq-len", "32", "--ks",
                        "1", "--reps", "1", "--warmup", "0"],
    ("bench", "train"): ["--model", "debug", "--ks", "1,2", "--seq-len", "16", "--batch-size",
                         "2", "--reps", "1", "--warmup", "0"],
    ("bench", "kernel"): ["--shapes", "64,32,128", "--reps", "1", "--warmup", "0"],
    ("bench", "decode"): ["--prompts", "PROMPTS", "--limit", "1", "--max-new-tokens", "4",
                          "--repeat", "1", "--auto-tree", "0", "--warmup", "0"],
    ("bench", "sandbox"): ["--limit", "2", "--rounds", "1"],
}
#: Commands parsed with their flags but not run here, and the test that runs them.
PARSE_ONLY = {
    ("bench", "tokenize"): "tests/bench/test_bench.py (a 1 MiB corpus)",
    ("bench", "loss", "--fsdp"): "tests/bench/test_bench.py (FSDP over two processes)",
}


#: README commands that another test runs in full (this one has no task data for them).
RUN_ELSEWHERE = {
    ("lm-eval",): "tests/interop/test_lmeval.py (lm-eval tasks built from a local JSON file, "
                  "--model mtp against --model hf on the export)",
    ("demo",): "tests/decoding/test_demo.py (`mtp demo` serving a small checkpoint, driven "
               "through its API) and tests/integration/test_demo_browser.py (in Chromium)",
}


def _elsewhere(args: list[str]) -> bool:
    return any(tuple(args[:len(k)]) == k for k in RUN_ELSEWHERE)


def _shrink(args: list[str]) -> list[str] | None:
    return next((v for k, v in SHRINK.items() if tuple(args[:len(k)]) == k), None)


def _parse_only(args: list[str]) -> bool:
    return any(all(w in args for w in k) and args[:len(k) - 1] == list(k[:len(k) - 1])
               for k in PARSE_ONLY)


def test_every_readme_command_is_run_or_named():
    for args in _mtp_commands():
        if args and args[0] != "fit" and "--help" not in args:
            assert _parse_only(args) or _shrink(args) is not None or _elsewhere(args), args


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory) -> dict[str, str]:
    """The README's placeholders as real (tiny) files."""
    import json

    import torch
    from mtp.eval.data import load_benchmark

    from mtp.data.bpe import train_tokenizer
    from mtp.model.checkpoint import save_checkpoint
    from mtp.model.transformer import MTPTransformer

    d = tmp_path_factory.mktemp("readme")
    tok = train_tokenizer(["def fib(n):\n    return n\n"] * 20, 300, 10**6)
    out = {}
    for name, k, heads in (("CKPT", 4, "block"), ("SMALL_K1_CKPT", 1, "block"),
                           ("MEDUSA1_CKPT", 4, "medusa1")):
        torch.manual_seed(k)
        cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=k, max_seq_len=64,
                                    head_type=heads)
        out[name] = str(d / f"{name}.ckpt")
        save_checkpoint(out[name], MTPTransformer(cfg), tok)
    task = load_benchmark("mbpp", MBPP_FILE).tasks[0]
    (d / "samples.jsonl").write_text(json.dumps({"task_id": task.task_id,
                                                 "completion": task.canonical_solution}) + "\n")
    (d / "prompts.jsonl").write_text(json.dumps({"prompt": "def fib(n):"}) + "\n")
    out["PROMPTS"] = str(d / "prompts.jsonl")
    return out


@pytest.mark.parametrize("args", [c for c in _mtp_commands() if c and c[0] != "fit"
                                  and "--help" not in c and not _elsewhere(c)],
                         ids=lambda c: " ".join(c)[:60])
def test_readme_command_runs_with_its_flags(args, placeholders, monkeypatch, tmp_path, capsys):
    """Each non-`fit` command of the README, with its own flags, on tiny inputs (the `fit`
    lines are parsed in full by `test_readme_fit_commands_parse`)."""
    monkeypatch.chdir(tmp_path)  # outputs like out/he and hf/ land here
    (tmp_path / "samples.jsonl").write_text(
        Path(placeholders["CKPT"]).with_name("samples.jsonl").read_text())
    args = [placeholders.get(a, a) for a in args]
    if _parse_only(args):
        import mtp.bench

        top, _ = mtp.bench.parser()
        top.parse_args(args[1:])
        return
    extra = [placeholders.get(a, a) for a in _shrink(args)]
    if args[0] == "bench":
        extra += ["--csv", str(tmp_path / "bench.csv")]
    code = main([*args, *extra])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    if args[0] == "eval":
        assert "pass@1" in out.out
    if args[0] != "bench":
        return
    rows = list(csv.DictReader((tmp_path / "bench.csv").open()))
    # every row says what produced it: the command line, the code and the machine
    assert rows and {r["command"] for r in rows} == {shlex.join(["mtp", *args, *extra])}
    assert all(r["git_rev"] and r["torch"] and r["hardware"] for r in rows)
    if args[1] == "loss":  # at this shape K = 1 moves no memory: its ratios stay empty
        assert all(r["status"] == "ok" for r in rows), rows
        for r in rows:
            assert (r["transient_vs_K1"] == "") == (float(r["transient_mib"]) == 0)
    if args[1] == "train":
        assert [(r["K"], r["compiled"]) for r in rows] == [("1", "False"), ("2", "False")]
        for r in rows:
            ratio = float(r["time_vs_K1"]) / float(r["flops_ratio_vs_K1"])
            assert abs(float(r["time_over_flops_ratio"]) - ratio) < 1e-9
        assert float(rows[1]["flops_ratio_vs_K1"]) > 1  # K = 2 runs its unembedding twice


def test_readme_is_a_guide_and_its_links_resolve():
    """The README stays a short guide (at most 250 lines); every relative link of the README and
    of docs/ names a file or folder of the repository."""
    assert len(README.splitlines()) <= 250, "README.md: move details to docs/"
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+:", target):
                assert (page.parent / target).exists(), f"{page.name}: link to {target}"
