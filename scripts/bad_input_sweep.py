"""A hostile user's command lines against every command, with a verdict for each.

    python scripts/bad_input_sweep.py [--jobs 2] [--only fit,generate,...]

Builds tiny fixtures in a temporary directory (a K = 4 and a K = 1 checkpoint, a text file, a
malformed YAML, broken completion files, ...), runs each case as its own process with a time
limit, and prints a markdown table: the command, its exit status, the last line it printed and a
verdict.

    clear      exit status 2 (or the expected one), no traceback, and the message holds what
               the case expects (the flag, file or value at fault)
    handled    the command succeeded where the input is valid but unusual, and did the right thing
    BAD        anything else: a traceback, a wrong flag blamed, a silent success, a time-out

The exit status is the number of BAD cases. Nothing here is a test (each case starts torch, so
the sweep takes minutes); `tests/` holds one test per guarded case.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MTP = [sys.executable, "-m", "mtp.cli"]


@dataclass
class Case:
    group: str
    argv: list[str]
    expect: str  # substring of the output that names the fault (or marks success)
    status: int = 2
    timeout: float = 120

    def command(self, root: Path) -> str:
        text = shlex.join(self.argv).replace(" ".join(MTP), "mtp")
        return (text.replace(str(root) + "/", "").replace(str(REPO) + "/", "")
                .replace(sys.executable, "python"))


def fixtures(root: Path) -> dict[str, str]:
    """Checkpoints and files the cases point at."""
    import torch

    from mtp.checkpoint import save_checkpoint
    from mtp.config import ModelConfig
    from mtp.data.bpe import train_tokenizer
    from mtp.model import MTPTransformer

    tok = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300, 10**6)
    paths = {}
    for name, k, head_type in (("K4", 4, "block"), ("K1", 1, "block"), ("DS4", 4, "deepseek")):
        torch.manual_seed(k)
        cfg = ModelConfig.from_name("debug", vocab_size=320, n_future=k, max_seq_len=64,
                                    head_type=head_type)
        paths[name] = str(root / f"{name}.ckpt")
        save_checkpoint(paths[name], MTPTransformer(cfg), tok)
    files = {
        "TEXT": ("notes.txt", "not a checkpoint\n" * 10),
        "BADYAML": ("bad.yaml", "model: [1, 2\n"),
        "LISTYAML": ("list.yaml", "- model\n- data\n"),
        "BADJSONL": ("bad.jsonl",
                     '{"task_id": "HumanEval/0", "completion": "  return 1"}\n{oops\n'),
        "UNKNOWNID": ("unknown.jsonl", json.dumps({"task_id": "HumanEval/999",
                                                   "completion": "  return 1\n"}) + "\n"),
        "NOPROMPT": ("noprompt.jsonl", '{"text": "x"}\n'),
        "GOOD": ("good.jsonl", json.dumps({"task_id": "HumanEval/0",
                                           "completion": "    return 1\n"}) + "\n"),
    }
    for key, (name, text) in files.items():
        (root / name).write_text(text)
        paths[key] = str(root / name)
    (root / "existing").mkdir()
    (root / "existing" / "keep.txt").write_text("an earlier export\n")
    paths["EXISTING"] = str(root / "existing")
    paths["MISSING"] = str(root / "missing.ckpt")
    paths["OUT"] = str(root / "out")
    return paths


def cases(p: dict[str, str]) -> list[Case]:
    fit, gen, ev = [*MTP, "fit"], [*MTP, "generate", "--prompt", "def f():"], [*MTP, "eval"]
    bench = [*MTP, "bench"]
    k4, k1 = ["--ckpt", p["K4"]], ["--ckpt", p["K1"]]
    return [
        # mtp fit: each must fail before any corpus is read
        Case("fit", [*fit, "--model.vocab_size", "100"], "--model.vocab_size"),
        Case("fit", [*fit, "--model.n_future", "0"], "--model.n_future must be >= 1"),
        Case("fit", [*fit, "--model.d_model", "100", "--model.n_heads", "3"], "--model.n_heads"),
        Case("fit", [*fit, "--model.head_type", "nonsense"], "head_type"),
        Case("fit", [*fit, "--model.head_type", "linear", "--model.matched_params", "true"],
             "--model.matched_params does not apply to --model.head_type linear"),
        Case("fit", [*fit, "--model.head_type", "medusa", "--model.matched_params", "true"],
             "--model.matched_params does not apply to --model.head_type medusa"),
        Case("fit", [*fit, "--loss.schedule", "ramp"], "needs --loss.schedule_steps"),
        Case("fit", [*fit, "--loss.schedule_steps", "5"], "--loss.schedule constant"),
        Case("fit", [*fit, "--model.n_future", "1", "--loss.schedule", "curriculum",
                     "--loss.schedule_steps", "5"], "--model.n_future is 1"),
        Case("fit", [*fit, "--model.n_layers", "2", "--model.matched_params", "true"],
             "leaves none of --model.n_layers"),
        Case("fit", [*fit, "--optim.lr", "-1"], "--optim.lr"),
        Case("fit", [*fit, "--optim.lr", "abc"], "optim.lr"),
        Case("fit", [*fit, "--data.seq_len", "0"], "--data.seq_len"),
        Case("fit", [*fit, "--data.batch_size", "0"], "--data.batch_size"),
        Case("fit", [*fit, "--trainer.max_steps", "abc"], "max_steps"),
        Case("fit", [*fit, "--ckpt_path", p["MISSING"]], "--ckpt_path"),
        Case("fit", [*fit, "--ckpt_path", p["TEXT"]], "--ckpt_path"),
        Case("fit", [*fit, "--config", p["MISSING"]], "missing.ckpt"),
        Case("fit", [*fit, "--config", p["BADYAML"]], "bad.yaml"),
        Case("fit", [*fit, "--config", p["LISTYAML"]], "list.yaml"),
        Case("fit", [*fit, "--model.no_such_flag", "3"], "no_such_flag"),
        Case("fit", [*fit, "--data.source", str(Path(p["OUT"]) / "nowhere")], "nowhere"),
        Case("fit", [*fit, "--data.tokenizer", p["MISSING"]], "--data.tokenizer"),
        Case("fit", [*fit, "--model.init_from", p["EXISTING"]], "init_from"),
        Case("fit", [*fit, "--loss.head_weights", "[1, 2]"], "--loss.head_weights"),
        Case("fit", [*fit, "--data.seq_len", "512", "--model.max_seq_len", "64"],
             "--data.seq_len"),
        Case("fit", [*fit, "--ckpt_path", p["K4"], "--model.n_future", "2"], "--ckpt_path"),
        # mtp generate
        Case("generate", [*MTP, "generate", "--prompt", "x"], "--ckpt"),
        Case("generate", [*gen, "--ckpt", p["MISSING"]], "--ckpt"),
        Case("generate", [*gen, "--ckpt", p["TEXT"]], "is not a checkpoint"),
        Case("generate", [*gen, "--ckpt", p["EXISTING"]], "--ckpt"),
        Case("generate", [*gen, *k4, "--decoder", "sample", "--temperature", "nan"],
             "--temperature must be finite"),
        Case("generate", [*gen, *k4, "--decoder", "sample", "--temperature", "-1"],
             "--temperature"),
        Case("generate", [*gen, *k4, "--decoder", "sample", "--top-p", "0"], "--top-p"),
        Case("generate", [*gen, *k4, "--decoder", "sample", "--top-k", "0"], "--top-k"),
        Case("generate", [*gen, *k4, "--tree", "1000,1000,1000"], "1001001000 nodes"),
        Case("generate", [*gen, *k4, "--decoder", "tree", "--tree", "4000"],
             "wider than the vocabulary"),
        Case("generate", [*gen, *k4, "--tree", "3,x"], "--tree must be"),
        Case("generate", [*gen, *k4, "--decoder", "beam"], "--decoder"),
        Case("generate", [*gen, *k4, "--decoder", "draft"], "--draft-ckpt"),
        Case("generate", [*gen, *k4, "--decoder", "draft", "--draft-ckpt", p["MISSING"]],
             "--draft-ckpt"),
        Case("generate", [*gen, *k4, "--decoder", "self-spec", "--heads", "9"], "--heads"),
        Case("generate", [*gen, *k1, "--decoder", "self-spec"], "single head"),
        Case("generate", [*gen, *k4, "--max-new-tokens", "0"], "--max-new-tokens"),
        Case("generate", [*MTP, "generate", *k4, "--prompt", ""], "--prompt is empty"),
        Case("generate", [*MTP, "generate", *k4, "--prompt", "x = 1\n" * 80], "--prompt has"),
        Case("generate", [*gen, *k4, "--device", "gpu7"], "--device"),
        Case("generate", [*gen, *k4, "--top-k", "0", "--gamma", "0", "--threads", "0"],
             "3 problems"),
        Case("generate", [*gen, *k4, "--decoder", "self-spec", "--max-new-tokens", "4"],
             "outputs equal: yes", status=0),
        Case("generate", [*gen, "--ckpt", p["DS4"], "--decoder", "tree", "--tree", "3,2,2",
                          "--max-new-tokens", "8"], "outputs equal: yes", status=0),
        Case("generate", [*gen, "--ckpt", p["DS4"], "--decoder", "self-spec", "--heads", "5"],
             "--heads must lie in [1, 4]"),
        # mtp eval
        Case("eval", [*ev, "nonsense"], "nonsense"),
        Case("eval", [*ev, "humaneval", "--completions", p["MISSING"]], "missing.ckpt"),
        Case("eval", [*ev, "humaneval", "--completions", p["BADJSONL"]], "bad.jsonl:2"),
        Case("eval", [*ev, "humaneval", "--completions", p["UNKNOWNID"]], "HumanEval/999"),
        Case("eval", [*ev, "humaneval", "--completions", p["GOOD"], "--k", "0"], "--k"),
        Case("eval", [*ev, "humaneval", "--completions", p["GOOD"], "--k", "5"], "--k 5"),
        Case("eval", [*ev, "humaneval", *k4, "--n-samples", "4"], "--n-samples 4"),
        Case("eval", [*ev, "humaneval", "--completions", p["GOOD"], "--limit", "0"], "--limit"),
        Case("eval", [*ev, "humaneval", "--completions", p["GOOD"], "--timeout", "-1"],
             "--timeout"),
        Case("eval", [*ev, "humaneval", "--completions", p["GOOD"], "--workers", "0"],
             "--workers"),
        Case("eval", [*ev, "humaneval", "--data-file", p["MISSING"], "--completions", p["GOOD"]],
             "missing.ckpt"),
        Case("eval", [*ev, "humaneval", "--ckpt", p["MISSING"]], "--ckpt"),
        Case("eval", [*ev, "humaneval", "--completions", p["GOOD"], "--limit", "1", "--output",
                      p["OUT"]], "pass@1", status=0),
        Case("eval", [*ev, "humaneval", "--completions", p["GOOD"], "--limit", "1", "--output",
                      p["OUT"], "--timeout", "30"], "--timeout (then"),
        # mtp bench
        Case("bench", [*bench, "nonsense"], "nonsense"),
        Case("bench", [*bench, "loss", "--n", "100", "--seq-len", "64"], "--seq-len"),
        Case("bench", [*bench, "loss", "--methods", "bogus"], "--methods"),
        Case("bench", [*bench, "loss", "--ks", "0"], "--ks"),
        Case("bench", [*bench, "loss", "--ks", "1,x"], "--ks"),
        Case("bench", [*bench, "train", "--model", "nonsense"], "--model"),
        Case("bench", [*bench, "kernel", "--shapes", "1,2"], "--shapes"),
        Case("bench", [*bench, "kernel", "--impls", "bogus"], "--impls"),
        Case("bench", [*bench, "decode", *k4, "--limit", "0"], "--limit"),
        Case("bench", [*bench, "decode", *k4, "--prompts", p["MISSING"]], "--prompts"),
        Case("bench", [*bench, "decode", *k4, "--prompts", p["NOPROMPT"]], "line 1"),
        Case("bench", [*bench, "decode", *k4, "--decoders", "greedy,beam"], "beam"),
        Case("bench", [*bench, "tokenize", "--size-mb", "0"], "--size-mb"),
        Case("bench", [*bench, "sandbox", "--rounds", "0"], "--rounds"),
        Case("bench", [*bench, "sandbox", "--limit", "0"], "--limit"),
        # mtp export
        Case("export", [*MTP, "export", "hf", "--ckpt", p["MISSING"], "--output", p["OUT"]],
             "missing.ckpt"),
        Case("export", [*MTP, "export", "hf", *k4, "--output", p["EXISTING"]],
             "is not an empty directory"),
        Case("export", [*MTP, "export", "nonsense"], "nonsense"),
        Case("export", [*MTP, "export", "hf", "--ckpt", p["DS4"], "--output", p["OUT"] + "/ds"],
             "--model.head_type deepseek"),
        # the entry point and the experiments
        Case("mtp", [*MTP, "nonsense"], "unknown command"),
        Case("experiments", [sys.executable, str(REPO / "experiments" / "k_sweep.py"),
                             "--preset", "nonsense"], "nonsense"),
        Case("experiments", [sys.executable, str(REPO / "experiments" / "arithmetic.py"),
                             "--preset", p["LISTYAML"]], "list.yaml"),
    ]


def run(case: Case, root: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}
    try:  # in the temporary directory: whatever a case writes (runs/, caches) goes there
        proc = subprocess.run(case.argv, cwd=root, env=env, capture_output=True, text=True,
                              timeout=case.timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "last": "", "verdict": "BAD"}
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if line.strip()]
    shown = next((line for line in reversed(lines) if case.expect in line), lines[-1] if lines
                 else "").replace(str(root) + "/", "")
    good = (proc.returncode == case.status and "Traceback" not in out and case.expect in out)
    verdict = ("handled" if case.status == 0 else "clear") if good else "BAD"
    return {"status": proc.returncode, "last": shown.strip()[:160], "verdict": verdict}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once")
    parser.add_argument("--only", default=None, help="comma-separated groups")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        todo = cases(fixtures(root))
        if args.only:
            todo = [c for c in todo if c.group in args.only.split(",")]
        # the eval cases that write into out/ must run in order
        ordered = [c for c in todo if p_out(c, root)]
        rest = [c for c in todo if not p_out(c, root)]
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = dict(zip(map(id, rest), pool.map(lambda c: run(c, root), rest)))
        results.update({id(c): run(c, root) for c in ordered})
        print("| # | command | exit | verdict | what it printed |\n|---|---|---|---|---|")
        for i, c in enumerate(todo, 1):
            r = results[id(c)]
            cmd = c.command(root).replace("|", "\\|")
            last = r["last"].replace("|", "\\|")
            print(f"| {i} | `{cmd}` | {r['status']} | {r['verdict']} | {last} |")
        bad = sum(results[id(c)]["verdict"] == "BAD" for c in todo)
        print(f"\n{len(todo)} cases: {len(todo) - bad} clear or handled, {bad} BAD")
    return bad


def p_out(case: Case, root: Path) -> bool:
    return str(root / "out") in case.argv


if __name__ == "__main__":
    sys.exit(main())
