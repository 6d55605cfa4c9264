"""K sweep: train matched-parameter models for several K and seeds, evaluate, report.

For every (K, seed) of a preset: `mtp fit` (through `mtp.cli.main`, the public entry point)
with `--model.matched_params true`, so every K has the same number of transformer blocks and
parameters, the same data and the same seeds; then measure it (`experiments/k_eval.py`):

- per-head and next-token (head 1) validation loss on the same validation windows for every K;
- HumanEval and MBPP pass@k through `mtp eval` (cheap settings by default: a few tasks, greedy);
- self-speculative decoding (`mtp.decoding.generate`, decoder `self-spec`) against greedy on
  validation prompts: L (tokens per forward), wall-clock speedup, and whether outputs match.

A preset with `widths` is a size scan: the sweep runs once per width (`--model.d_model`, with
`n_heads = d_model / head_dim`) into `<out>/d<width>/`, and `<out>/README.md` compares the K
across widths.

Each finished run is appended to `<out>/results.csv`; a rerun skips finished runs and resumes an
interrupted training from its `last.ckpt`. `<out>/README.md` and PNG plots (loss, L and speedup
vs K) are regenerated from the CSV; TensorBoard hyperparameter summaries go to
`<work>/hparams` (`tensorboard --logdir <work>`).

    python experiments/k_sweep.py --preset cpu --out experiments/reports/k_sweep

A preset may give `tokens_per_param` instead of `--trainer.max_steps`: every width then trains
on that many tokens per parameter of its K = 1 model. `--estimate` prints what a GPU preset's
runs cost (tokens per parameter, power, time on one H200; `experiments/budget.py`) and trains
nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script, `python experiments/<study>.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from experiments import curves, head_report, k_eval, k_report  # noqa: E402
from experiments.common import (
    REPO,
    ResultsCSV,
    command_line,
    head1_depth,
    load_preset,
    log_hparams,
    model_shape,
    parse_int_list,
    provenance,
    single_thread,
    study_main,  # noqa: E402 (a script puts the repository on the path first)
)
from mtp.util.errors import InputError  # noqa: E402

MAX_K = 8
COLUMNS = ["head_type", "K", "n_layers", "seed", "params", "steps", "head1_depth",
           "next_token_loss", "val_loss_mean", *[f"loss_head{i}" for i in range(1, MAX_K + 1)],
           "acc_head1", "humaneval_pass@1", "mbpp_pass@1", "humaneval_tasks", "mbpp_tasks",
           "spec_L", *[f"accept_pos{i}" for i in range(1, MAX_K)], "greedy_ms_per_token",
           "spec_ms_per_token", "spec_speedup", "spec_identical", "k1_greedy_ms_per_token",
           "spec_speedup_vs_k1", "curve", "fit_s", "eval_s", "git", "environment", "utc", "fit_git",
           "fit_cpu", "cpu", "settings"]
"""One row per run. `n_layers` is the run's `--model.n_layers`, `head1_depth` the blocks on its
next-token path, `accept_pos{i}` the rate at which draft i was accepted given drafts 1..i - 1
were. `curve` is the run's learning curve, [[step, next-token validation loss], ...] as `mtp
fit` logged it every `val_check_interval` steps (`val/next_token_loss`). `fit_git` and
`fit_cpu` name the revision and CPU that trained the run (recorded in its work directory when it
trained: an evaluation may reuse a run trained by an earlier invocation), `git`, `cpu`,
`environment` and `utc` what evaluated it, and `settings` (JSON) the settings it trained with
(`training_settings`) and the evaluation settings."""
KEY = ["head_type", "K", "n_layers", "seed"]
#: Heads that are blocks, into which matched parameters move trunk blocks.
BLOCK_HEADS = ("block", "deepseek")
#: Preset keys that plan a sweep (a row's own columns say which K, seed, head type and width it
#: is) or evaluate it, rather than set how its runs train.
PLAN_KEYS = ("_path", "ks", "seeds", "head_types", "widths", "eval")


def results(out: Path) -> ResultsCSV:
    """The study's CSV (rows of an older column set read with block heads as their type)."""
    return ResultsCSV(out / "results.csv", COLUMNS, KEY, defaults={"head_type": "block"})


def base_layers(preset: dict) -> int:
    """`--model.n_layers` of the preset: the K = 1 model has n_layers + 1 blocks."""
    with open(REPO / preset["fit_config"]) as f:
        base = yaml.safe_load(f).get("model", {}).get("n_layers")
    return int(preset.get("fit", {}).get("model", {}).get("n_layers", base))


def run_dir_name(head_type: str, k: int, seed: int, n_layers: int | None = None) -> str:
    """A run's work directory; `n_layers` only for a depth-matched K = 1 control."""
    name = f"K{k}-s{seed}" if head_type == "block" else f"{head_type}-K{k}-s{seed}"
    return name if n_layers is None else f"K{k}-L{n_layers}-s{seed}"


# -- configuration -----------------------------------------------------------------------------


def width_sweeps(preset: dict) -> list[tuple[int | None, dict]]:
    """(width, preset) for each sweep of a preset: one per entry of its `widths` (a size scan),
    else [(None, preset)]."""
    widths = preset.get("widths")
    if not widths:
        return [(None, sized(preset))]
    head_dim = preset.get("head_dim")
    bad = [w for w in widths if not isinstance(w, int) or not head_dim or w % head_dim]
    if bad:
        raise InputError(f"--preset {preset['_path']}: widths {bad} must be multiples of its "
                         f"head_dim (got {head_dim!r})")
    return [(w, sized(_deep_merge(preset, {"fit": {"model": {"d_model": w,
                                                              "n_attn_heads": w // head_dim}}})))
            for w in widths]


def sized(preset: dict) -> dict:
    """The preset with `--trainer.max_steps` set by its `tokens_per_param`, if it states one:
    the fewest steps that give every parameter of the K = 1 model that many training tokens
    (every run of the sweep trains as long)."""
    tpp = preset.get("tokens_per_param")
    if tpp is None:
        return preset
    if "max_steps" in preset.get("fit", {}).get("trainer", {}):
        raise InputError(f"--preset {preset['_path']}: give tokens_per_param or "
                         "fit.trainer.max_steps, not both")
    from experiments.budget import steps_for

    cfg = sweep_config(preset)
    shape = model_shape(model_config(cfg["model"] | {"n_future": 1}), cfg["data"]["seq_len"])
    steps = steps_for(tpp, shape.params, k_report.tokens_per_step(cfg))
    return _deep_merge(preset, {"fit": {"trainer": {"max_steps": steps}}})


def model_config(model: dict):
    from mtp.config import ModelConfig

    return ModelConfig(**{k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__})


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k),
                                                                              dict) else v
    return out


def sweep_config(preset: dict) -> dict:
    """The `mtp fit` config every run of a sweep shares: the base config overridden key by key
    by the preset's `fit`."""
    with open(REPO / preset["fit_config"]) as f:
        return _deep_merge(yaml.safe_load(f), preset.get("fit", {}))


def training_settings(preset: dict) -> dict:
    """What a run of the sweep trains with, as its row records it: the preset's path, its
    training keys (base config, overrides, depth controls, tokens per parameter ...) and the
    resolved `mtp fit` config; not its plan or evaluation (`PLAN_KEYS`)."""
    return {"preset": preset["_path"],
            **{k: v for k, v in preset.items() if k not in PLAN_KEYS},
            "resolved": sweep_config(preset)}


def run_fit_config(preset: dict, k: int, seed: int, run_dir: Path,
                   head_type: str = "block", n_layers: int | None = None) -> dict:
    """The complete `mtp fit` YAML of one run: base config + preset overrides + K and seed.

    Only the model's K and head type, the seeds and where logs go differ between runs of a
    sweep; the data, the model's total blocks and the optimisation are the same. Block and
    deepseek heads get matched parameters (K - 1 trunk blocks move into the heads); linear and
    medusa heads hold no block, so their trunk keeps all `n_layers + 1` blocks, and their K
    d x d maps are the parameters they add. `n_layers` sets a depth-matched control's trunk.
    """
    cfg = sweep_config(preset)
    model: dict = {"n_future": k, "matched_params": head_type in BLOCK_HEADS}
    if head_type != "block":
        model["head_type"] = head_type
    if head_type not in BLOCK_HEADS:
        model["n_layers"] = cfg["model"]["n_layers"] + 1
    if n_layers is not None:
        model["n_layers"] = n_layers
    cfg = _deep_merge(cfg, {
        "seed_everything": seed,
        "model": model,
        "data": {"seed": seed},
        "trainer": {
            "default_root_dir": str(run_dir),
            # version 0: a resumed run logs into the same TensorBoard directory as before
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(run_dir), "name": "tb", "version": 0,
                                     "default_hp_metric": False}},
        },
    })
    return cfg


def fit_argv(run_dir: Path) -> list[str]:
    """`mtp fit` arguments of a run; resumes from `last.ckpt` when an earlier attempt left one."""
    argv = ["fit", "--config", str(run_dir / "fit.yaml")]
    last = last_checkpoint(run_dir)
    if last is not None:
        argv += ["--ckpt_path", str(last)]
    return argv


def last_checkpoint(run_dir: Path) -> Path | None:
    """The `last.ckpt` Lightning's ModelCheckpoint wrote for a run, if any."""
    found = sorted(run_dir.glob("tb/version_0/checkpoints/last.ckpt"))
    return found[0] if found else None


# -- one run -----------------------------------------------------------------------------------


def train(preset: dict, k: int, seed: int, run_dir: Path, head_type: str = "block",
          n_layers: int | None = None) -> dict:
    """Train one (head type, K, seed) model through `mtp fit` unless it already finished; its
    training record (`training_record`).

    `<run_dir>/fit_done.json` records a finished training: its wall seconds, the revisions and
    CPU that trained it and the settings it trained with (`training_settings`), so that an
    evaluation that reuses the run, in this invocation or a later one, names what trained it.
    Each attempt notes its provenance in `fit_attempts.json` as it starts: a run resumed from
    the `last.ckpt` of an interrupted attempt was trained by every attempt since it began.
    """
    done = run_dir / "fit_done.json"
    if done.is_file():
        return training_record(json.loads(done.read_text()))
    from mtp.cli import main as mtp_main

    run_dir.mkdir(parents=True, exist_ok=True)
    attempts_file = run_dir / "fit_attempts.json"
    attempts = (json.loads(attempts_file.read_text())
                if attempts_file.is_file() and last_checkpoint(run_dir) is not None else [])
    attempts.append({key: v for key, v in provenance().items() if key in ("git", "cpu", "utc")})
    attempts_file.write_text(json.dumps(attempts))
    cfg = run_fit_config(preset, k, seed, run_dir, head_type, n_layers)
    (run_dir / "fit.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = fit_argv(run_dir)
    print(f"[k_sweep] {head_type} K={k} seed={seed}"
          f"{'' if n_layers is None else f' n_layers={n_layers}'}: mtp {' '.join(argv)}",
          flush=True)
    start = time.perf_counter()
    status = mtp_main(argv)
    seconds = time.perf_counter() - start
    if status or last_checkpoint(run_dir) is None:
        raise RuntimeError(f"mtp fit failed for K={k} seed={seed} (status {status})")
    record = {"seconds": seconds,
              "git": " then ".join(dict.fromkeys(a["git"] for a in attempts)),
              "cpu": " then ".join(dict.fromkeys(a["cpu"] for a in attempts)),
              "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "settings": training_settings(preset)}
    done.write_text(json.dumps(record))
    return training_record(record)


def training_record(done: dict) -> dict:
    """A run's training columns from its `fit_done.json`: wall seconds, the revision and CPU
    that trained it, the settings it trained with (empty where the file predates them)."""
    return {"fit_s": done["seconds"], "fit_git": done.get("git", ""),
            "fit_cpu": done.get("cpu", ""), "settings": done.get("settings", {})}


def evaluate(preset: dict, k: int, seed: int, run_dir: Path, head_type: str = "block",
             baseline: Path | None = None) -> dict:
    """Every measurement of one trained run (`experiments.k_eval`); `baseline` is the K = 1
    run's checkpoint, whose greedy decoding self-speculation is also timed against."""
    import torch

    from mtp.config import DataConfig
    from mtp.data import build_datamodule
    from mtp.model.checkpoint import load_checkpoint
    from mtp.model.vocab import eot_id

    ev = preset["eval"]
    ckpt = last_checkpoint(run_dir)
    model, tokenizer = load_checkpoint(ckpt, device=ev["device"])
    cfg = yaml.safe_load((run_dir / "fit.yaml").read_text())
    # head 1's path: the trunk's blocks and those of head 1 itself
    row: dict = {"head_type": head_type, "n_layers": model.cfg.n_layers,
                 "params": model.num_params(), "steps": cfg["trainer"]["max_steps"],
                 "head1_depth": head1_depth(model),
                 "curve": json.dumps(validation_curve(run_dir))}
    base = None if baseline is None or k == 1 else load_checkpoint(baseline,
                                                                   device=ev["device"])[0]
    start = time.perf_counter()
    with torch.no_grad():
        dm = build_datamodule(DataConfig(**cfg["data"]), vocab_size=model.cfg.vocab_size,
                              n_future=k)
        dm.setup("validate")
        row |= k_eval.validation_losses(model, dm, k_eval.n_val_windows(dm, preset),
                                        cfg["data"]["batch_size"])
        row |= k_eval.speculative(model, dm, ev, eot_id(tokenizer, model.cfg), base)
    for bench in ("humaneval", "mbpp"):
        score, n = k_eval.pass_at_1(ckpt, bench, run_dir / "eval" / bench, ev)
        row[f"{bench}_pass@1"], row[f"{bench}_tasks"] = score, n
    row["eval_s"] = time.perf_counter() - start
    return row | provenance()


def validation_curve(run_dir: Path) -> list[list[float]]:
    """[[optimizer steps done, next-token validation loss], ...] of a run, from the
    `val/next_token_loss` its `mtp fit` logged to TensorBoard. Lightning validates inside the
    step before counting it, so a validation after N optimizer steps is logged at step N - 1."""
    logged = curves.tensorboard_curve(run_dir / "tb" / "version_0", "val/next_token_loss")
    return [[step + 1, value] for step, value in logged]


Run = tuple[str, int, int, int | None]
"""(head type, K, seed, n_layers of a depth-matched control or None)."""


def plan(preset: dict, head_types: list[str]) -> list[Run]:
    """Every run of a sweep. K = 1 is the next-token baseline: one head, the same model for
    block and deepseek heads, so it runs once, with block heads. With `depth_controls` in the
    preset, each K > 1 of block heads also gets a K = 1 control whose next-token path has the
    K model's depth: matched parameters leave head 1 n_layers + 2 - K blocks, so the control
    has n_layers + 1 - K."""
    ks, seeds = preset["ks"], preset["seeds"]
    runs: list[Run] = [("block", 1, s, None) for s in seeds if 1 in ks]
    runs += [(h, k, s, None) for h in head_types for k in ks if k > 1 for s in seeds]
    if preset.get("depth_controls"):
        n = base_layers(preset)
        runs += [("block", 1, s, n + 1 - k) for k in ks if k > 1 for s in seeds]
    return runs


def _train_job(job: tuple) -> dict:
    """`train` in a worker process of `--jobs`, on one CPU thread."""
    single_thread()
    return train(*job)


def _done(csv: ResultsCSV, preset: dict, run: Run) -> bool:
    h, k, seed, n_layers = run
    if n_layers is None:
        n_layers = base_layers(preset) + (h not in BLOCK_HEADS)
    return csv.is_done(head_type=h, K=k, n_layers=n_layers, seed=seed)


def run(preset: dict, out: Path, work: Path, head_types: list[str] | None = None,
        jobs: int = 1) -> None:
    """Train and evaluate every run that `<out>/results.csv` does not hold yet.

    Training comes first, `jobs` runs at a time; evaluation then runs one run at a time, so no
    training of the study runs beside a timed decode.
    """
    head_types = head_types or ["block"]
    csv = results(out)
    todo = []
    for r in plan(preset, head_types):
        if _done(csv, preset, r):
            print(f"[k_sweep] {r[0]} K={r[1]} seed={r[2]}: done, skipped", flush=True)
        else:
            todo.append(r)
    dirs = [work / run_dir_name(h, k, seed, n) for h, k, seed, n in todo]
    jobs_args = [(preset, k, seed, d, h, n) for (h, k, seed, n), d in zip(todo, dirs)]
    if jobs > 1 and len(todo) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            trained = list(pool.map(_train_job, jobs_args))
    else:
        trained = [train(*a) for a in jobs_args]
    for (h, k, seed, n), run_dir, fit in zip(todo, dirs, trained):
        baseline = last_checkpoint(work / run_dir_name("block", 1, seed))
        settings = fit.pop("settings") | {"eval": preset["eval"]}
        row = ({"K": k, "seed": seed, "settings": json.dumps(settings)} | fit
               | evaluate(preset, k, seed, run_dir, h, baseline))
        seconds = row["fit_s"]
        csv.append(row)
        log_hparams(work / "hparams" / run_dir.name,
                    {"head_type": h, "K": k, "seed": seed, "params": row["params"],
                     "n_layers": row["n_layers"], "steps": row["steps"]},
                    {m: row.get(m, float("nan")) for m in (
                        "next_token_loss", "val_loss_mean", "humaneval_pass@1",
                        "mbpp_pass@1", "spec_L", "spec_speedup")})
        print(f"[k_sweep] {run_dir.name}: next-token loss {row['next_token_loss']:.3f}, "
              f"L {row['spec_L']:.2f}, fit {seconds:.0f} s, eval {row['eval_s']:.0f} s",
              flush=True)


# -- estimate ----------------------------------------------------------------------------------


def estimate_plan(preset: dict, head_types: list[str], costs):
    """What the preset's runs cost apart from the device (`experiments.budget`): for each width
    and kind of run, its parameters, training tokens and steps, the FLOPs of its training and
    evaluation, and its host seconds (setup, each optimizer step, each validation batch and
    decode forward, each code-benchmark program); once per study, the process start, the
    corpus's tokenisation and the benchmarks' reference runs."""
    from collections import Counter

    from experiments import budget

    sweeps = width_sweeps(preset)
    runs, notes, families, tokenised = [], [], [], set()
    study = {"process start": costs.start_s}
    for width, sweep in sweeps:
        cfg = sweep_config(sweep)
        if cfg["trainer"].get("accelerator") == "cpu":
            raise InputError(f"--estimate times a GPU preset; {preset['_path']} trains on the "
                             "CPU (trainer.accelerator: cpu)")
        kinds = Counter((h, k, n) for h, k, _, n in plan(sweep, head_types))
        for (h, k, n), count in kinds.items():
            label = " ".join([*([f"d={width}"] if width else []),
                              *([] if h == "block" else [h]), f"K={k}",
                              *([] if n is None else [f"(depth control, n_layers {n})"])])
            runs.append(_run_cost(sweep, run_fit_config(sweep, k, 0, Path("."), h, n), costs,
                                  label, count, 1 in sweep["ks"]))
        vocab, data = cfg["model"]["vocab_size"], cfg["data"]
        if vocab not in tokenised:  # the BPE and the token shards are cached for the study
            tokenised.add(vocab)
            seconds, source = budget.tokenising(data, vocab, costs)
            if seconds is None:
                notes.append(source)
            else:
                study[f"tokenising {source} at vocabulary {vocab}"] = seconds
        corpus = budget.corpus_tokens(data, vocab, costs)
        tokens = runs[-1].tokens
        if corpus and tokens > corpus:
            notes.append(f"{'d = ' + str(width) if width else 'each run'}: "
                         f"{budget.count_text(tokens)} training tokens are {tokens / corpus:.1f} "
                         f"passes over the ~{budget.count_text(corpus)} training tokens of "
                         f"{data['source']}")
        families.append(k_report.planned_tests(sweep["ks"], sweep.get("depth_controls", False))
                        if head_types == ["block"] else
                        head_report.planned_tests(head_types, sweep["ks"]))
    if sweeps[0][0] is not None:
        families.append(k_report.planned_scan_tests([w for w, _ in sweeps], preset["ks"]))
    ev = preset["eval"]
    tasks = ev["humaneval_limit"] + ev["mbpp_limit"]
    if tasks:
        # `mtp eval` times each task's reference solution once per machine (then cached)
        study["code benchmarks' reference runs"] = tasks * costs.sandbox_s / ev["workers"]
    return budget.Plan(preset["_path"], runs, study, len(preset["seeds"]), max(families),
                       preset.get("tokens_per_param"), notes)


def _run_cost(sweep: dict, cfg: dict, costs, label: str, count: int, has_k1: bool):
    """One run's `budget.RunCost`: `cfg` is its `mtp fit` config, `has_k1` whether the sweep's
    K = 1 model is timed beside its self-speculation."""
    from experiments import budget

    seq, batch = int(cfg["data"]["seq_len"]), int(cfg["data"]["batch_size"])
    shape = model_shape(model_config(cfg["model"]), seq)
    trainer, ev, k = cfg["trainer"], sweep["eval"], cfg["model"]["n_future"]
    steps = int(trainer["max_steps"])
    val_batches = steps // int(trainer["val_check_interval"]) * int(trainer["limit_val_batches"])
    decoders = 1 + (k > 1) + (k > 1 and has_k1)  # greedy, self-spec, the K = 1 model's greedy
    # one forward per new token: an upper bound for self-spec, which accepts several at once
    spec = decoders * (1 + ev["spec_prompts"] * ev.get("spec_repeat", 1)) * ev["spec_new_tokens"]
    bench = sum(math.ceil(ev[f"{b}_limit"] / ev["batch_size"]) * ev["max_new_tokens"]
                for b in ("humaneval", "mbpp"))
    scored = (val_batches * batch + ev["val_windows"]) * seq + spec + bench * ev["batch_size"]
    tokens = steps * k_report.tokens_per_step(cfg)
    forwards = val_batches + math.ceil(ev["val_windows"] / batch) + spec + bench
    host = (costs.fit_run_s + costs.eval_run_s + steps * costs.step(shape.blocks)
            + forwards * costs.forward(shape.blocks)
            + (ev["humaneval_limit"] + ev["mbpp_limit"]) * costs.sandbox_s / ev["workers"])
    return budget.RunCost(label, count, shape.params, tokens, steps,
                          shape.flops_per_token * (tokens + scored / 3), host,
                          str(trainer.get("precision", "32-true")))


# -- report ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu", help="`cpu`, `gpu` or a YAML path")
    parser.add_argument("--out", type=Path, default=Path("experiments/reports/k_sweep"),
                        help="results.csv, README.md and plots (committed)")
    parser.add_argument("--work", type=Path, default=Path("runs/experiments/k_sweep"),
                        help="checkpoints, logs and TensorBoard summaries (not committed)")
    parser.add_argument("--ks", default=None, help="override the preset's K values: 1,2,4,8")
    parser.add_argument("--seeds", default=None, help="override the preset's seeds: 0,1,2")
    parser.add_argument("--head-types", default=None,
                        help="compare head types at K > 1, e.g. block,linear,medusa,deepseek "
                             "(default: the preset's `head_types`, else block)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained at a time, each on one CPU thread (evaluation and "
                             "its timings run one at a time afterwards)")
    parser.add_argument("--note", default="", help="a line added to the report")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--estimate", action="store_true",
                        help="print a GPU preset's runs, tokens per parameter, seeds against "
                             "power and time on one H200 by the FLOP model plus measured host "
                             "costs (experiments/budget.py); trains nothing")
    args = parser.parse_args(argv)
    single_thread()
    preset = load_preset("k_sweep", args.preset)
    if args.ks:
        preset["ks"] = parse_int_list(args.ks)
    if args.seeds:
        preset["seeds"] = parse_int_list(args.seeds)
    head_types = parse_head_types(args.head_types or preset.get("head_types") or ["block"])
    if args.jobs < 1:
        raise InputError(f"--jobs must be >= 1 (got {args.jobs})")
    if args.estimate:
        from experiments.budget import estimate, load_fixed_costs

        print(estimate(estimate_plan(preset, head_types, load_fixed_costs())).text())
        return 0
    sweeps = width_sweeps(preset)
    for width, sweep in sweeps:
        out, work = (args.out, args.work) if width is None else \
            (args.out / f"d{width}", args.work / f"d{width}")
        if not args.report_only:
            run(sweep, out, work, head_types, args.jobs)
        if head_types == ["block"]:
            print(k_report.report(out, sweep, command_line(), results(out).rows(),
                                  base_layers(sweep), args.note))
        else:
            print(head_report.report(out, sweep, head_types, command_line(),
                                     results(out).rows(), args.note))
    if sweeps[0][0] is not None:
        print(k_report.scan_report(args.out, preset, command_line(),
                                   {w: results(args.out / f"d{w}").rows() for w, _ in sweeps},
                                   base_layers(preset)))
    return 0


def parse_head_types(value: str | list[str]) -> list[str]:
    """`--head-types` as a list, each one a `--model.head_type`."""
    from mtp.config import HEAD_TYPES

    types = value.split(",") if isinstance(value, str) else list(value)
    bad = [t for t in types if t not in HEAD_TYPES]
    if bad or not types:
        raise InputError(f"--head-types {','.join(types)}: unknown {', '.join(bad) or 'none'}; "
                         f"choose from {', '.join(HEAD_TYPES)}")
    return types


if __name__ == "__main__":
    sys.exit(study_main(main))
