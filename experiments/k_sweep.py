"""K sweep: train matched-parameter models for several K and seeds, evaluate, report.

For every (K, seed) of a preset: `mtp fit` (through `mtp.cli.main`, the public entry point)
with `--model.matched_params true`, so every K has the same number of transformer blocks and
parameters, the same data and the same seeds; then

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
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script, `python experiments/<study>.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from experiments import head_report, k_report  # noqa: E402
from experiments.common import (
    REPO,
    ResultsCSV,
    command_line,
    head1_depth,
    load_preset,
    log_hparams,
    parse_int_list,
    provenance,
    single_thread,
    study_main,  # noqa: E402 (a script puts the repository on the path first)
)
from mtp.config import InputError  # noqa: E402

MAX_K = 8
COLUMNS = ["head_type", "K", "n_layers", "seed", "params", "steps", "head1_depth",
           "next_token_loss", "val_loss_mean", *[f"loss_head{i}" for i in range(1, MAX_K + 1)],
           "acc_head1", "humaneval_pass@1", "mbpp_pass@1", "humaneval_tasks", "mbpp_tasks",
           "spec_L", *[f"accept_pos{i}" for i in range(1, MAX_K)], "greedy_ms_per_token",
           "spec_ms_per_token", "spec_speedup", "spec_identical", "k1_greedy_ms_per_token",
           "spec_speedup_vs_k1", "fit_s", "eval_s", "git", "environment", "utc"]
"""One row per run. `n_layers` is the run's `--model.n_layers`, `head1_depth` the blocks on its
next-token path, `accept_pos{i}` the rate at which draft i was accepted given drafts 1..i - 1
were; `git`, `environment` and `utc` say what made the row."""
KEY = ["head_type", "K", "n_layers", "seed"]
#: Heads that are blocks, into which matched parameters move trunk blocks.
BLOCK_HEADS = ("block", "deepseek")


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
        return [(None, preset)]
    head_dim = preset.get("head_dim")
    bad = [w for w in widths if not isinstance(w, int) or not head_dim or w % head_dim]
    if bad:
        raise InputError(f"--preset {preset['_path']}: widths {bad} must be multiples of its "
                         f"head_dim (got {head_dim!r})")
    return [(w, _deep_merge(preset, {"fit": {"model": {"d_model": w,
                                                        "n_heads": w // head_dim}}}))
            for w in widths]



def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k),
                                                                              dict) else v
    return out


def run_fit_config(preset: dict, k: int, seed: int, run_dir: Path,
                   head_type: str = "block", n_layers: int | None = None) -> dict:
    """The complete `mtp fit` YAML of one run: base config + preset overrides + K and seed.

    Only the model's K and head type, the seeds and where logs go differ between runs of a
    sweep; the data, the model's total blocks and the optimisation are the same. Block and
    deepseek heads get matched parameters (K - 1 trunk blocks move into the heads); linear and
    medusa heads hold no block, so their trunk keeps all `n_layers + 1` blocks, and their K
    d x d maps are the parameters they add. `n_layers` sets a depth-matched control's trunk.
    """
    with open(REPO / preset["fit_config"]) as f:
        cfg = yaml.safe_load(f)
    cfg = _deep_merge(cfg, preset.get("fit", {}))
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
          n_layers: int | None = None) -> float:
    """Train one (head type, K, seed) model through `mtp fit` unless it already finished; wall
    seconds."""
    done = run_dir / "fit_done.json"
    if done.is_file():
        return json.loads(done.read_text())["seconds"]
    from mtp.cli import main as mtp_main

    run_dir.mkdir(parents=True, exist_ok=True)
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
    done.write_text(json.dumps({"seconds": seconds}))
    return seconds


def validation_losses(model, dm, n_windows: int, batch_size: int) -> dict[str, float]:
    """Per-head loss and head-1 accuracy on the first `n_windows` validation windows."""
    import torch

    from mtp.loss import head_metrics, mtp_inputs_targets

    k = model.cfg.n_future
    losses, acc, seen = torch.zeros(k, dtype=torch.float64), 0.0, 0
    with torch.no_grad():
        for a in range(0, n_windows, batch_size):
            batch = torch.stack([dm.val_set[i] for i in range(a, min(a + batch_size,
                                                                    n_windows))])
            batch = batch.to(next(model.parameters()).device)
            out = head_metrics(model, *mtp_inputs_targets(batch, k))
            losses += out.head_losses.double() * len(batch)
            acc += float(out.head_accuracies[0]) * len(batch)
            seen += len(batch)
    losses /= seen
    row = {f"loss_head{i + 1}": float(v) for i, v in enumerate(losses)}
    row |= {"next_token_loss": float(losses[0]), "val_loss_mean": float(losses.mean()),
            "acc_head1": acc / seen}
    return row


def n_val_windows(dm, preset: dict) -> int:
    """Validation windows scored for every K: the same windows, whatever K's window width."""
    seq_len = dm.cfg.seq_len
    widest = seq_len + max(preset["ks"])
    available = (len(dm.val_tokens) - widest) // seq_len + 1
    return max(1, min(preset["eval"]["val_windows"], available))


def pass_at_1(ckpt: Path, benchmark: str, out_dir: Path, ev: dict) -> tuple[float, int]:
    """pass@1 and task count from `mtp eval <benchmark> --ckpt ...` with the preset's settings."""
    limit = ev[f"{benchmark}_limit"]
    if not limit:
        return float("nan"), 0
    from mtp.eval.cli import main as eval_main

    argv = [benchmark, "--ckpt", str(ckpt), "--limit", str(limit), "--n-samples", "1",
            "--temperature", "0", "--k", "1", "--max-new-tokens", str(ev["max_new_tokens"]),
            "--batch-size", str(ev["batch_size"]), "--workers", str(ev["workers"]),
            "--device", ev["device"], "--output", str(out_dir)]
    if benchmark == "mbpp" and ev.get("mbpp_file"):
        argv += ["--data-file", str(REPO / ev["mbpp_file"])]
    status = eval_main(argv)
    if status:
        raise RuntimeError(f"mtp eval {' '.join(argv)} failed with status {status}")
    summary = json.loads((out_dir / "summary.json").read_text())
    return float(summary["pass@1"]), int(summary["n_tasks"])


def speculative(model, dm, ev: dict, eot_id: int | None, baseline=None) -> dict:
    """L, per-position acceptance and speedups of self-speculative decoding (batch 1).

    Prompts are the starts of validation windows (code the model has not trained on). Timing is
    interleaved: for every prompt, `spec_repeat` rounds each run greedy, self-spec and, given
    `baseline` (the K = 1 model), its greedy, in an order that rotates from round to round and
    prompt to prompt, so load on the machine falls on all of them alike. A decoder's time on a
    prompt is the median of its rounds; its ms per token is the sum of those medians over the
    tokens it emitted. Each decoder runs once on the first prompt before timing, so one-time
    costs are not counted.
    """
    import statistics

    from mtp.decoding import DecodeStats, generate

    n, plen, new = ev["spec_prompts"], ev["spec_prompt_tokens"], ev["spec_new_tokens"]
    stride = max(1, len(dm.val_set) // n)
    prompts = [dm.val_set[i * stride][:plen].tolist() for i in range(n)]
    runs = {"greedy": (model, "greedy")}
    if model.cfg.n_future > 1:
        runs["self-spec"] = (model, "self-spec")
    if baseline is not None:
        runs["k1"] = (baseline, "greedy")
    names = list(runs)
    for m, dec in runs.values():
        generate(m, prompts[:1], new, decoder=dec, eot_id=eot_id)
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    outputs = {name: [] for name in names}
    stats = {name: DecodeStats() for name in names}
    for pi, p in enumerate(prompts):
        rounds = {name: [] for name in names}
        for r in range(ev.get("spec_repeat", 1)):
            shift = (pi + r) % len(names)
            for name in names[shift:] + names[:shift]:
                m, dec = runs[name]
                out, st = generate(m, [p], new, decoder=dec, eot_id=eot_id)
                rounds[name].append(st.seconds)
                if r == 0:
                    outputs[name].append(out[0])
                    stats[name].add(st)
                    tokens[name] += len(out[0])
        for name in names:
            seconds[name] += statistics.median(rounds[name])
    ms = {name: 1000 * seconds[name] / max(1, tokens[name]) for name in names}
    row = {"spec_L": stats["greedy"].tokens_per_forward, "greedy_ms_per_token": ms["greedy"]}
    if "k1" in ms:
        row["k1_greedy_ms_per_token"] = ms["k1"]
    if "self-spec" not in runs:
        # K = 1 has no draft heads: L is that of greedy decoding, and there is no speedup.
        return row
    s = stats["self-spec"]
    row |= {"spec_L": s.tokens_per_forward, "spec_ms_per_token": ms["self-spec"],
            "spec_speedup": ms["greedy"] / ms["self-spec"],
            "spec_identical": int(outputs["greedy"] == outputs["self-spec"])}
    row |= {f"accept_pos{i + 1}": a for i, a in enumerate(s.acceptance)}
    if "k1" in ms:
        row["spec_speedup_vs_k1"] = ms["k1"] / ms["self-spec"]
    return row


def evaluate(preset: dict, k: int, seed: int, run_dir: Path, head_type: str = "block",
             baseline: Path | None = None) -> dict:
    """Every measurement of one trained run (see the module docstring); `baseline` is the K = 1
    run's checkpoint, whose greedy decoding self-speculation is also timed against."""
    import torch

    from mtp.checkpoint import load_checkpoint
    from mtp.config import DataConfig
    from mtp.data import build_datamodule
    from mtp.vocab import eot_id

    ev = preset["eval"]
    ckpt = last_checkpoint(run_dir)
    model, tokenizer = load_checkpoint(ckpt, device=ev["device"])
    cfg = yaml.safe_load((run_dir / "fit.yaml").read_text())
    # head 1's path: the trunk's blocks and those of head 1 itself
    row: dict = {"head_type": head_type, "n_layers": model.cfg.n_layers,
                 "params": model.num_params(), "steps": cfg["trainer"]["max_steps"],
                 "head1_depth": head1_depth(model)}
    base = None if baseline is None or k == 1 else load_checkpoint(baseline,
                                                                   device=ev["device"])[0]
    start = time.perf_counter()
    with torch.no_grad():
        dm = build_datamodule(DataConfig(**cfg["data"]), vocab_size=model.cfg.vocab_size,
                              n_future=k)
        dm.setup("validate")
        row |= validation_losses(model, dm, n_val_windows(dm, preset), cfg["data"]["batch_size"])
        row |= speculative(model, dm, ev, eot_id(tokenizer, model.cfg), base)
    for bench in ("humaneval", "mbpp"):
        score, n = pass_at_1(ckpt, bench, run_dir / "eval" / bench, ev)
        row[f"{bench}_pass@1"], row[f"{bench}_tasks"] = score, n
    row["eval_s"] = time.perf_counter() - start
    return row | provenance()


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


def _train_job(job: tuple) -> float:
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
            fit_s = list(pool.map(_train_job, jobs_args))
    else:
        fit_s = [train(*a) for a in jobs_args]
    for (h, k, seed, n), run_dir, seconds in zip(todo, dirs, fit_s):
        baseline = last_checkpoint(work / run_dir_name("block", 1, seed))
        row = {"K": k, "seed": seed, "fit_s": seconds} | evaluate(preset, k, seed, run_dir, h,
                                                                  baseline)
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
