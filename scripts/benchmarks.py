"""Write docs/benchmarks.md: every benchmark table of the documentation, from one run of this
script at one committed revision, named at the top of the page.

    python scripts/benchmarks.py [--decode-ckpt CKPT] [--output docs/benchmarks.md]

Each section runs one `mtp bench` command in a fresh process, one after another (time it on a
quiet machine: nothing else running), and the page keeps the command beside the table it printed.
The CSVs go to a temporary folder; the rows of each carry the command, machine and revision too.
The tree must be clean (`git status` shows no change to a tracked file), so that the revision on
the page is the code that ran. `--decode-ckpt` adds the decoding section (a checkpoint with heads:
the real-model recipe's, see experiments/reports/pretrained/); without it the page says that it
was left out. `--dry-run` prints the commands only.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Section:
    title: str
    args: tuple[str, ...]  # after `mtp bench`
    about: str  # what the table measures and how to read it


SECTIONS = (
    Section("Loss path: peak memory and time over K",
            ("loss", "--reps", "1", "--warmup", "0", "--ks", "1,8"),
            "The loss path of one training step at N = 4096 tokens, d = 512, V = 32768 (fp32 on "
            "a CPU), each configuration in a fresh process. `peak_mib` is the resident memory "
            "above the step's start; `transient_mib` the peak above the step's end state, which "
            "holds the parameter gradients every method must produce (K heads' worth). The "
            "naive pass holds all K heads' logits at once and grows K-fold; the sequential pass "
            "with the fused kernel grows only by the heads' own gradients. On a CPU the fused "
            "kernel is the chunked torch path; the Triton kernel is for GPUs."),
    Section("Loss path under FSDP, two ranks",
            ("loss", "--reps", "1", "--warmup", "0", "--methods", "sequential+fused",
             "--ks", "1,8", "--fsdp", "2"),
            "The same per rank (the worst rank), heads sharded with FSDP2 over two gloo "
            "processes, N tokens per rank: each rank keeps only its shard of the extra heads' "
            "gradients."),
    Section("Training step over K at matched parameters",
            ("train", "--ks", "1,4", "--compile", "both", "--reps", "3"),
            "A whole training step of the `cpu` model (16 x 128 tokens, fp32), K = 1 against "
            "K = 4 at matched parameters (K - 1 trunk blocks moved into the heads), eager and "
            "compiled, the configurations' steps interleaved, medians. The FLOP model "
            "(`MTPTransformer.flops_per_token`) counts the unembedding once per head; the "
            "target is a time ratio K = 4 / K = 1 at most 1.05x the FLOP ratio."),
    Section("The fused linear cross-entropy alone",
            ("kernel",),
            "Forward and backward of the loss alone against torch's materialising cross-entropy "
            "and the other fused implementations that are installed, at the default CPU shape."),
    Section("Tokenisation over worker counts",
            ("tokenize", "--size-mb", "64", "--workers", "1,2"),
            "Tokenising a 64 MiB corpus of Python files into shards with 1 and 2 worker "
            "processes: bytes per second, peak memory of the parent and the workers, and "
            "whether the shards are identical."),
    Section("Scoring the HumanEval references in the sandbox",
            ("sandbox", "--rounds", "1"),
            "Scoring the 164 HumanEval reference solutions under each isolation that works on the "
            "machine (bubblewrap, unshare, a bare process), completion and tests in processes of "
            "their own."),
)

DECODE = Section(
    "Decoding a pretrained model with its heads",
    ("decode", "--prompts", "humaneval", "--prompt-format", "chat", "--limit", "8",
     "--max-new-tokens", "128", "--decoders", "greedy,self-spec,lookup", "--heads", "4",
     "--lookup", "10", "--auto-tree", "0", "--repeat", "1", "--transformers",
     "greedy,prompt-lookup"),
    "Every decoder takes its turn on each prompt; `speedup` is against mtp's greedy in the same "
    "run, `L` the tokens per forward, `equal_to_greedy` counts the prompts whose output is "
    "greedy's token for token. `transformers` rows are transformers' own `generate` on the same "
    "weights (head 1 as a LlamaForCausalLM).")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def bench_command(section: Section, csv: Path, ckpt: str | None) -> list[str]:
    args = list(section.args)
    if section is DECODE:
        args[1:1] = ["--ckpt", ckpt]
    # -P: the repository root stays off the path, where its kernels/ folder would shadow the
    # Hugging Face `kernels` package that transformers imports.
    return [sys.executable, "-P", "-m", "mtp.bench", *args, "--csv", str(csv)]


def shown(section: Section, ckpt: str | None) -> str:
    """The command as a reader types it (no interpreter path, no temporary CSV)."""
    args = list(section.args)
    if section is DECODE:
        args[1:1] = ["--ckpt", ckpt]
    return shlex.join(["mtp", "bench", *args])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--decode-ckpt", default=None, metavar="CKPT",
                        help="checkpoint for the decoding section (left out without it)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    sections = [*SECTIONS, *([DECODE] if args.decode_ckpt else [])]
    if args.decode_ckpt and not Path(args.decode_ckpt).exists():
        parser.error(f"--decode-ckpt {args.decode_ckpt}: no such file")
    if args.dry_run:
        print("\n".join(shown(s, args.decode_ckpt) for s in sections))
        return 0
    dirty = git("status", "--porcelain", "--untracked-files=no")
    if dirty:
        parser.error("the tree has uncommitted changes to tracked files; commit them so that the "
                     f"page names the code that ran:\n{dirty}")
    revision = git("rev-parse", "--short", "HEAD")
    invoked = shlex.join(["python", "scripts/benchmarks.py", *(argv if argv is not None
                                                               else sys.argv[1:])])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, section in enumerate(sections):
            cmd = bench_command(section, Path(tmp) / f"{i}.csv", args.decode_ckpt)
            print(f"[{i + 1}/{len(sections)}] {shown(section, args.decode_ckpt)}", flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                print(f"{shown(section, args.decode_ckpt)} exited {proc.returncode}; "
                      f"{args.output} is left as it was", file=sys.stderr)
                return 1
            parts.append(f"## {section.title}\n\n{section.about}\n\n"
                         f"`{shown(section, args.decode_ckpt)}` ({seconds:.0f} s):\n\n"
                         f"```\n{proc.stdout.rstrip()}\n```\n")
    if not args.decode_ckpt:
        parts.append(f"## {DECODE.title}\n\nLeft out of this run (no `--decode-ckpt`). "
                     "`experiments/reports/pretrained/` has the decoding tables of "
                     "SmolLM2-135M-Instruct with trained heads.\n")
    head = (f"# Benchmarks\n\nEvery table on this page was printed by `{invoked}` at git "
            f"{revision} (started {started}), one benchmark after another in fresh processes "
            "on a quiet machine; each table's first line names the machine, threads and "
            "versions. Rerun the same command to refresh the whole page; it refuses a tree "
            "with uncommitted changes.\n")
    from mtp.util.atomic import write_text  # after the runs: a failed run leaves the page as it was

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, "\n".join([head, *parts]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
