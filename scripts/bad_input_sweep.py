"""A hostile user's command lines against every command, with a verdict for each.

    python scripts/bad_input_sweep.py [--jobs 2] [--only fit,generate,...] [--data DIR]

Builds fixtures in a temporary directory (a K = 4 and a K = 1 checkpoint, a text file, a
malformed YAML, broken completion files, odd corpora, truncated GGUF files, exports with a side
file deleted or edited, ...), runs each case as its own process with a time limit, and prints a
markdown table: the command, its exit status, the last line it printed and a verdict.

Besides one command, a case may send its process a signal once it reaches a stage (a line in
its output, or a file it creates), or start several commands at once; either may then check what
they left behind (the printed resume command runs, an output folder holds no contradictory
results, ...). Those cases, and the odd files they use, are in `hostile_sweep.py`; the cases of
sizes beyond the memory, writes that fail (full and read-only disks, mounted as tmpfs where this
runs as root, and quotas), Lightning's `--trainer.*` flags, paths that are not files and numbers
out of range are in `limits_sweep.py`.

    clear      exit status 2 (or the expected one), no traceback, and the message holds what
               the case expects (the flag, file or value at fault)
    handled    the command succeeded where the input is valid but unusual, and did the right
               thing; or a signal stopped it as promised, or commands run at once kept apart
               (one refused, or all consistent), and what they left passed the case's check
    BAD        anything else: a traceback, a wrong flag blamed, a silent success, a time-out, a
               failed check

The exit status is the number of BAD cases. Nothing here is a test (each case starts torch, so
the sweep takes minutes); `tests/` holds one test per guarded case.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hostile_sweep import MTP, REPO, Case, Run, env, odd_cases, odd_fixtures
from limits_sweep import limits_cases, limits_fixtures, unmount_all


def fixtures(root: Path, data: Path) -> dict[str, str]:
    """Checkpoints and files the cases point at."""
    import torch

    from mtp.config import ModelConfig
    from mtp.data.bpe import train_tokenizer
    from mtp.model.checkpoint import save_checkpoint
    from mtp.model.transformer import MTPTransformer

    tok = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300, 10**6)
    paths = {}
    for name, k, head_type in (("K4", 4, "block"), ("K1", 1, "block"), ("DS4", 4, "deepseek"),
                               ("M4", 4, "medusa1")):
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
    paths.update(odd_fixtures(root, tok, paths, data))
    paths.update(limits_fixtures(root, paths))
    return paths



def cases(p: dict[str, str]) -> list[Case]:
    fit, gen, ev = [*MTP, "fit"], [*MTP, "generate", "--prompt", "def f():"], [*MTP, "eval"]
    bench = [*MTP, "bench"]
    k4, k1 = ["--ckpt", p["K4"]], ["--ckpt", p["K1"]]
    return [
        # mtp fit: each must fail before any corpus is read
        Case("fit", [*fit, "--model.vocab_size", "100"], "--model.vocab_size"),
        Case("fit", [*fit, "--model.n_future", "0"], "--model.n_future must be >= 1"),
        Case("fit", [*fit, "--model.d_model", "100", "--model.n_attn_heads", "3"],
             "--model.n_attn_heads"),
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
    ] + odd_cases(p) + limits_cases(p)


# -- running a case -----------------------------------------------------------------------------


class _Output(threading.Thread):
    """Collects a process's output as it comes (a stage is a text in it)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.proc, self.chunks = proc, []
        self.start()

    def run(self) -> None:
        while chunk := os.read(self.proc.stdout.fileno(), 1 << 16):
            self.chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", "replace")


def _reached(at: str, proc: _Output, folder: Path) -> bool:
    return any(folder.glob(at[5:])) if at.startswith("file:") else at in proc.text()


def _quota(limit: int | None):
    """What a case's process runs before its command: a limit on the size of every file it
    writes (a quota; Python ignores SIGXFSZ, so a write past it fails with EFBIG)."""
    if limit is None:
        return None

    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def run(case: Case, root: Path) -> dict:
    # in the temporary directory, or a folder of its own there: whatever a case writes (runs/,
    # caches) goes there
    folder = root / case.cwd if case.cwd else root
    folder.mkdir(exist_ok=True)
    deadline = time.monotonic() + case.timeout
    procs = [subprocess.Popen(argv, cwd=folder, env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, preexec_fn=_quota(case.file_size_limit))
             for argv in [case.argv, *case.also]]
    outputs = [_Output(proc) for proc in procs]
    missed = ""
    if case.signal is not None:
        while not _reached(case.at, outputs[0], folder) and procs[0].poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        if _reached(case.at, outputs[0], folder):
            time.sleep(case.delay)
            procs[0].send_signal(case.signal)  # nothing, if it has ended meanwhile
        else:
            missed = f"(ended before {case.at!r}) "
    timed_out = False
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
    for proc, output in zip(procs, outputs):
        output.join()
        proc.stdout.close()
    results = [(proc.returncode, output.text()) for proc, output in zip(procs, outputs)]
    seconds = case.timeout - (deadline - time.monotonic())
    if timed_out:
        return {"status": "timeout", "last": missed, "verdict": "BAD", "seconds": seconds}

    def shown(out: str) -> str:
        lines = [line for line in out.splitlines() if line.strip()]
        line = next((line for line in reversed(lines) if case.expect in line),
                    lines[-1] if lines else "")
        return line.replace(str(root) + "/", "").strip()[:160]

    good = (all("Traceback" not in out for _, out in results)
            and any(status == case.status and case.expect in out for status, out in results))
    last = " / ".join(shown(out) for _, out in results)
    if good and case.check is not None:
        try:
            problem = case.check(Run(case, folder, results))
        except Exception as err:  # what the case left is not what the check reads
            problem = f"the check failed: {type(err).__name__}: {err}"
        if problem:
            good, last = False, problem.replace(str(root) + "/", "")
    special = case.signal is not None or case.also
    verdict = ("handled" if case.status == 0 or special else "clear") if good else "BAD"
    return {"status": ", ".join(str(status) for status, _ in results), "last": missed + last,
            "verdict": verdict, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once")
    parser.add_argument("--only", default=None, help="comma-separated groups")
    parser.add_argument("--data", type=Path, default=Path(os.environ.get(
        "MTP_SHARED_DATA", REPO.parent / "shared" / "data")),
                        help="local benchmark data (mbpp/mbpp.jsonl), as the tests find it; the "
                             "MBPP case needs it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return _sweep(Path(tmp), args)
        finally:
            unmount_all()  # the small and read-only disks of `limits_sweep`


def _sweep(root: Path, args: argparse.Namespace) -> int:
    """Build the fixtures under `root`, run the cases, print the table; the BAD count."""
    todo = cases(fixtures(root, args.data))
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
    slowest = sorted(range(len(todo)), key=lambda i: -results[id(todo[i])]["seconds"])[:10]
    print("slowest cases (#, seconds): " + ", ".join(
        f"{i + 1} {results[id(todo[i])]['seconds']:.0f}" for i in slowest), file=sys.stderr)
    return bad


def p_out(case: Case, root: Path) -> bool:
    return str(root / "out") in case.argv


if __name__ == "__main__":
    sys.exit(main())
