"""Shared plumbing of the studies: presets, model shapes, resumable CSV results, summaries,
plots, reports.

Every study appends one CSV row per finished run, keyed by the run's coordinates (for example
K and seed), so a rerun of the same command skips what is done and continues where an
interruption stopped it. Reports and plots are regenerated from the CSV alone, so every number
in a report is a number some run wrote.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtp.util.errors import ConfigError, InputError, UserError
from mtp.util.yaml_file import read_yaml_mapping

REPO = Path(__file__).resolve().parents[1]


def single_thread() -> None:
    """Pin torch (and the BLAS libraries it calls) to one CPU thread.

    The studies are sized for a shared 2-core machine; one thread keeps timings of the
    self-speculative decoder comparable between runs and leaves a core to everything else.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)


def study_main(main: Callable[[], int]) -> int:
    """Run a study's `main`; a user's mistake (`mtp.util.errors.UserError`: an unknown preset, a
    malformed file, no results to report) is one line on stderr and exit status 2."""
    try:
        return main()
    except UserError as err:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        return 2


def _single_threaded(fn: Callable, args: tuple):
    single_thread()
    return fn(*args)


def map_runs(fn: Callable, calls: Sequence[tuple], jobs: int = 1) -> Iterable:
    """`fn(*args)` for every args of `calls`, `jobs` worker processes at a time (spawned, one
    CPU thread each; `fn` must be a module-level function), yielding results as they finish so
    that the caller can record each run at once."""
    if jobs < 2 or len(calls) < 2:
        for args in calls:
            yield fn(*args)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in as_completed([pool.submit(_single_threaded, fn, a) for a in calls]):
            yield done.result()


def load_preset(study: str, name_or_path: str) -> dict:
    """A study's preset: `experiments/presets/<study>_<name>.yaml` or an explicit YAML path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = REPO / "experiments" / "presets" / f"{study}_{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem.removeprefix(f"{study}_")
                       for p in (REPO / "experiments" / "presets").glob(f"{study}_*.yaml"))
        raise ConfigError(f"--preset {name_or_path}: no such preset for {study} (known: "
                          f"{', '.join(known)}) and no such file")
    preset = read_yaml_mapping(path, f"--preset {path}")
    preset["_path"] = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    return preset


def fit_sections(preset: dict) -> dict:
    """The `model`, `data` and `trainer` settings of a K-sweep preset's runs: those of its base
    `mtp fit` config, overridden key by key by the preset's `fit`."""
    import yaml

    with open(REPO / preset["fit_config"]) as f:
        base = yaml.safe_load(f)
    over = preset.get("fit", {})
    return {sec: {**base.get(sec, {}), **over.get(sec, {})} for sec in ("model", "data",
                                                                      "trainer")}


def parse_int_list(text: str | Sequence[int]) -> list[int]:
    """`"1,2,4"` -> [1, 2, 4]; lists pass through."""
    if isinstance(text, str):
        return [int(x) for x in text.split(",") if x.strip()]
    return [int(x) for x in text]


# -- resumable results ------------------------------------------------------------------------


class ResultsCSV:
    """An append-only CSV of finished runs, keyed by some of its columns.

    Rows are appended (and flushed) as each run finishes, so killing a study loses at most the
    run in progress; `done` tells a rerun which runs to skip.
    """

    def __init__(self, path: str | os.PathLike, columns: Sequence[str],
                 key: Sequence[str], defaults: dict[str, str] | None = None) -> None:
        self.path, self.columns, self.key = Path(path), list(columns), list(key)
        self.defaults = dict(defaults or {})  # of columns an older CSV lacks

    def rows(self) -> list[dict[str, str]]:
        """Every finished run, as strings."""
        if not self.path.is_file():
            return []
        with open(self.path, newline="") as f:
            return [{**self.defaults, **r} for r in csv.DictReader(f)]

    def _header(self) -> list[str]:
        with open(self.path, newline="") as f:
            return next(csv.reader(f), [])

    def _key(self, row: dict) -> tuple[str, ...]:
        return tuple(str(row.get(k, self.defaults.get(k, ""))) for k in self.key)

    def done(self) -> set[tuple[str, ...]]:
        """Keys of the finished runs (values as strings)."""
        return {self._key(r) for r in self.rows()}

    def is_done(self, **key: object) -> bool:
        return self._key(key) in self.done()

    def append(self, row: dict) -> None:
        """Write one finished run (missing columns stay empty)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.is_file()
        if not new and self._header() != self.columns:
            # appending under another header would garble the rows already written
            raise InputError(f"{self.path} holds results with other columns (an older version "
                             "of this study): give another --out")
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="raise")
            if new:
                writer.writeheader()
            writer.writerow({c: _fmt(row.get(c, "")) for c in self.columns})
            f.flush()
            os.fsync(f.fileno())


def _fmt(v: object) -> object:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return v


def to_float(v: object) -> float:
    """A CSV cell as a float (empty -> nan)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


# -- summaries (the tests and their verdicts: experiments/stats.py) ---------------------

def summarize(values: Iterable[float]) -> dict[str, float]:
    """Mean, sample standard deviation and count of the finite values."""
    xs = [v for v in values if not math.isnan(v)]
    n = len(xs)
    if n == 0:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else float("nan")
    return {"mean": mean, "std": std, "n": n}


def head1_depth(model) -> int:
    """Transformer blocks on a model's next-token path (trunk and head 1)."""
    from mtp.model.layers import Block

    return model.cfg.n_trunk_layers + sum(isinstance(m, Block) for m in model.heads[0].modules())


@dataclass(frozen=True)
class Shape:
    """What the time estimate (`experiments.budget`) and the pages' compute need of a model:
    parameters, FLOPs per training token, transformer blocks."""

    params: int
    flops_per_token: float
    blocks: int


def model_shape(model_cfg, seq_len: int) -> Shape:
    """A `ModelConfig`'s parameters (all, embeddings included), FLOPs per training token at
    `seq_len` and transformer blocks, from a model built without memory (on the meta device)."""
    import torch

    from mtp.model.layers import Block
    from mtp.model.transformer import build_model

    with torch.device("meta"):
        model = build_model(model_cfg)
    return Shape(model.num_params(), model.flops_per_token(seq_len),
                 sum(isinstance(m, Block) for m in model.modules()))


NOT_RECORDED = "not recorded"
"""What a report prints for a setting or provenance field its rows do not hold (rows written
before the study recorded it)."""


def cpu_model() -> str:
    """The CPU's model name and core count (`AMD EPYC x2`), as `mtp eval` keys its reference
    times (`mtp.util.environment.machine_key`, whose first field this is)."""
    from mtp.util.environment import machine_key

    return machine_key().split(" | ")[0]


def provenance() -> dict[str, str]:
    """What made a run, for its CSV row: the git revision (`+dirty` with uncommitted code),
    the software, the CPU model (and the GPU, where one is visible) and the UTC time."""
    import torch

    from mtp.util.environment import git_state, versions

    rev, dirty = git_state(REPO, exclude=["experiments/reports"], untracked=True)
    found = versions("torch")
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return {"git": rev + ("+dirty" if dirty else ""),
            "environment": f"python {found['python']}, torch {found.get('torch')}, "
                           f"{platform.machine()} (torch threads: {torch.get_num_threads()})"
                           f"{gpu}",
            "cpu": cpu_model(),
            "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def trained_here(prov: dict[str, str]) -> dict[str, str]:
    """The training columns of a run trained and evaluated in one call (`provenance()`'s)."""
    return {"fit_git": prov["git"], "fit_cpu": prov["cpu"]}


def _revisions(values: list[str]) -> str:
    """The distinct revisions of a column, marked where code was uncommitted."""
    revs = sorted({v for v in values if v})
    if not revs:
        return NOT_RECORDED
    dirty = any("+dirty" in v for v in revs)
    missing = sum(not v for v in values)
    return (f"{', '.join(revs)}{' (uncommitted changes!)' if dirty else ' (committed code)'}"
            + (f", {NOT_RECORDED} for {missing} of {len(values)} runs" if missing else ""))


def _distinct(values: list[str]) -> str:
    found = sorted({v for v in values if v})
    missing = sum(not v for v in values)
    if not found:
        return NOT_RECORDED
    return "; ".join(found) + (f" ({NOT_RECORDED} for {missing} of {len(values)} runs)"
                               if missing else "")


def provenance_line(rows: list[dict]) -> str:
    """The report's provenance, from the rows alone (so `--report-only` rewrites the same): the
    revision that trained the runs, the one that evaluated them, the CPU, software and times.
    A field the rows do not hold reads `not recorded`."""
    if {r.get("git", "") for r in rows} == {""}:
        return ("Provenance: the runs of this CSV recorded no git revision, environment or "
                "time (their rows predate those columns); see the git history of the CSV.")
    envs = sorted({r.get("environment", "") for r in rows})
    times = sorted(r.get("utc", "") for r in rows)
    fit_cpu = [r.get("fit_cpu", "") for r in rows]
    cpu = [r.get("cpu", "") for r in rows]
    where = (f"CPU: {_distinct(cpu)}" if fit_cpu == cpu else
             f"CPU that trained them: {_distinct(fit_cpu)}; that evaluated them: "
             f"{_distinct(cpu)}")
    return (f"Git revision that trained the runs: "
            f"{_revisions([r.get('fit_git', '') for r in rows])}; that evaluated them: "
            f"{_revisions([r.get('git', '') for r in rows])}; {where}; {'; '.join(envs)}; "
            f"runs finished {times[0]} to {times[-1]} UTC.")


def column(rows: list[dict], col: str) -> list[float]:
    """One column of the rows as floats (empty cells: nan)."""
    return [to_float(r.get(col, "")) for r in rows]


def per_seed(rows: list[dict], col: str, digits: int = 3) -> str:
    """A column's values in seed order, for a report's per-seed cell."""
    return ", ".join(f"{to_float(r.get(col, '')):.{digits}f}"
                     for r in sorted(rows, key=lambda r: int(r["seed"])))


def wall_minutes(rows: list[dict]) -> tuple[float, float]:
    """Minutes of training and of evaluation over the rows."""
    return (sum(to_float(r["fit_s"]) for r in rows) / 60,
            sum(to_float(r["eval_s"]) for r in rows) / 60)


def pm(stats: dict[str, float], digits: int = 3) -> str:
    """`mean ± std (n)` for a report table."""
    if stats["n"] == 0:
        return "–"
    if stats["n"] == 1 or math.isnan(stats["std"]):
        return f"{stats['mean']:.{digits}f} (n=1)"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def group(rows: list[dict], by: Sequence[str]) -> dict[tuple, list[dict]]:
    """Rows grouped by the values of some columns (insertion order kept)."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in by), []).append(r)
    return out


# -- the settings a report's rows were made with -------------------------------------------


class Recorded:
    """The settings a report's runs were made with, as their rows recorded them (a JSON
    mapping in each row's `settings` column), so that a page describes what made its numbers
    and not today's preset file.

    Values every recording row agrees on are kept; a value that differs between rows or that
    some rows lack, or any value at all where no row recorded settings, reads `not recorded`
    (`text`), and `note` says which rows lacked settings and which keys were not the same.
    """

    def __init__(self, rows: list[dict], column: str = "settings") -> None:
        try:
            found = [json.loads(r[column]) for r in rows if r.get(column)]
        except ValueError as err:
            raise InputError(f"a `{column}` cell of the results is not JSON ({err}): the CSV "
                             "was edited by hand or cut") from None
        self.rows, self.missing = len(rows), len(rows) - len(found)
        self.values: dict = {}
        self.differ: list[str] = []
        if found:
            self.values = _agreed(found, "", self.differ)

    def get(self, *path: str) -> object | None:
        """The recorded value at a path of keys (`get("eval", "val_windows")`), or None."""
        node: object = self.values
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def text(self, *path: str) -> str:
        """The recorded value for a page (lists as `1, 2`, mappings as JSON), or
        `not recorded`."""
        value = self.get(*path)
        if value is None:
            return NOT_RECORDED
        if isinstance(value, list):
            return ", ".join(str(v) for v in value)
        if isinstance(value, dict):
            return f"`{json.dumps(value)}`"
        return str(value)

    def note(self, ignore: Sequence[str] = ()) -> str:
        """Which rows recorded no settings and which settings differ between rows, apart from
        those under an `ignore` prefix ("" when every row recorded the same)."""
        parts = []
        if self.missing:
            parts.append(f"{self.missing} of {self.rows} runs recorded no settings (their rows "
                         "predate the `settings` column)")
        differ = [k for k in self.differ if not any(k.startswith(p) for p in ignore)]
        if differ:
            parts.append("not every run recorded the same " + ", ".join(f"`{k}`"
                                                                      for k in differ))
        return "; ".join(parts)


def _agreed(found: list, prefix: str, differ: list[str]) -> dict:
    """The keys whose values all mappings of `found` share (recursively); the dotted names of
    those that differ go to `differ`."""
    out = {}
    for key in dict.fromkeys(k for d in found for k in d):
        values = [d.get(key) for d in found]
        if all(isinstance(v, dict) for v in values):
            out[key] = _agreed(values, f"{prefix}{key}.", differ)
        elif all(v == values[0] for v in values):
            out[key] = values[0]
        else:
            differ.append(prefix + key)
    return out


def settings_line(recorded: Recorded, keys: Sequence[str], ignore: Sequence[str] = ()) -> str:
    """One line naming each setting of `keys` (dotted paths: `eval.val_windows`) as the rows
    recorded them; differences under the `ignore` prefixes are expected and not noted."""
    if recorded.missing == recorded.rows:
        return (f"Settings, as the rows recorded them: {NOT_RECORDED} (the rows of all "
                f"{recorded.rows} runs predate the `settings` column).")
    note = recorded.note(ignore)
    return ("Settings, as the rows recorded them: "
            + "; ".join(f"`{key}` {recorded.text(*key.split('.'))}" for key in keys)
            + (f" ({note})" if note else "") + ".")


def preset_settings(preset: dict, plan: Sequence[str]) -> dict:
    """A preset as a row records it: its path and every key but those of `plan` (which runs
    to make: the row's own columns say which run it is)."""
    return {"preset": preset["_path"],
            **{k: v for k, v in preset.items() if k != "_path" and k not in plan}}


def steps_line(rows: list[dict], by: str) -> str:
    """The training steps of the rows (their `steps` column), per value of `by` where they
    differ."""
    steps = {r[by]: r.get("steps", "") or NOT_RECORDED for r in rows}
    if len(set(steps.values())) == 1:
        return f"Steps: {next(iter(steps.values()))} (every run)."
    return "Steps: " + ", ".join(f"{steps[v]} at {by} {v}"
                                 for v in sorted(steps, key=to_float)) + "."


# -- plots and reports -------------------------------------------------------------------------


def errorbar_plot(path: Path, series: dict[str, tuple[list[float], list[float], list[float]]], *,
                  xlabel: str, ylabel: str, title: str, logx: bool = False,
                  hline: float | None = None, hline_label: str | None = None) -> None:
    """One PNG of mean ± std error bars, one line per series {label: (x, mean, std)}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=110)
    for label, (x, mean, std) in series.items():
        ax.errorbar(x, mean, yerr=[0 if math.isnan(s) else s for s in std], marker="o",
                    capsize=4, label=label)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label=hline_label)
    if logx:
        ax.set_xscale("log", base=2)
        xs = sorted({x for s in series.values() for x in s[0]})
        ax.set_xticks(xs, [str(int(x)) if float(x).is_integer() else str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if len(series) > 1 or hline_label:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def curve_plot(path: Path, curves: dict[str, list[list[tuple[int, float]]]], *, ylabel: str,
               title: str, hline: float | None = None, hline_label: str | None = None) -> None:
    """Learning curves, one thin line per seed and one colour per label {label: [curve]}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=110)
    for i, (label, runs) in enumerate(curves.items()):
        for j, run in enumerate(runs):
            ax.plot([s for s, _ in run], [v for _, v in run], color=f"C{i}", alpha=0.6,
                    linewidth=1, label=label if j == 0 else None)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label=hline_label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def command_line() -> str:
    """The command that is running, as a user would retype it from the repository root."""
    script = Path(sys.argv[0])
    if script.is_absolute() and script.is_relative_to(REPO):
        script = script.relative_to(REPO)
    # `--report-only` rewrites a report from its CSV; the command that makes the numbers is the
    # same one without it.
    args = [a for a in sys.argv[1:] if a != "--report-only"]
    return shlex.join(["python", str(script), *args])


def log_hparams(log_dir: Path, hparams: dict, metrics: dict) -> None:
    """One TensorBoard hyperparameter summary (HPARAMS tab) for one finished run."""
    from torch.utils.tensorboard import SummaryWriter

    clean_h = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
               for k, v in hparams.items()}
    clean_m = {k: float(v) for k, v in metrics.items()
               if isinstance(v, (int, float)) and not math.isnan(float(v))}
    log_dir.mkdir(parents=True, exist_ok=True)
    with SummaryWriter(log_dir=str(log_dir)) as w:
        w.add_hparams(clean_h, clean_m, run_name=".")
