"""experiments/: generated tasks, resumable results, reports, and the K sweep end to end (tiny)."""

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from experiments import arithmetic, common, induction, k_report, k_sweep
from experiments.synthetic import (
    InductionTask,
    PolynomialTask,
    SyntheticDataModule,
    _rng,
    arithmetic_accuracy,
    induction_accuracy,
)
from mtp.config import InputError, ModelConfig

REPO = Path(__file__).resolve().parents[1]

# -- induction data ---------------------------------------------------------------------------


def test_induction_targets_are_copies_of_earlier_tokens():
    task = InductionTask()
    first_ids = range(1, 1 + task.n_first)
    marked = 0
    for i in range(50):
        tokens, copy = task.sequence(_rng(3, 0, i), 64)
        assert tokens.shape == copy.shape == (64,)
        assert tokens.min() >= 1 and tokens.max() < task.vocab_size
        for t in np.flatnonzero(copy):
            a = tokens[t - 1]
            assert a in first_ids
            # an earlier occurrence of the same first token, followed by the same token
            earlier = [s for s in range(t - 1) if tokens[s] == a]
            assert earlier and all(tokens[s + 1] == tokens[t] for s in earlier)
            marked += 1
    assert marked > 50  # the task has plenty of copyable positions


def test_generators_are_deterministic_and_seed_dependent():
    task = InductionTask()
    a, _ = task.sequence(_rng(1, 0, 7), 48)
    b, _ = task.sequence(_rng(1, 0, 7), 48)
    c, _ = task.sequence(_rng(2, 0, 7), 48)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    poly = PolynomialTask()
    assert poly.example(_rng(1, 2, 3), 4) == poly.example(_rng(1, 2, 3), 4)


# -- polynomial data --------------------------------------------------------------------------


def _independent_eval(tokens: list[int], task: PolynomialTask) -> np.ndarray:
    """Evaluate prefix tokens right to left with a stack and numpy convolution."""
    stack = []
    i = len(tokens)
    # literals are m tokens < p; walk tokens from the end, grouping coefficients
    buf = []
    while i > 0:
        i -= 1
        t = tokens[i]
        if t < task.p:
            buf.insert(0, t)
            if len(buf) == task.m:
                stack.append(np.array(buf))
                buf = []
            continue
        assert not buf
        if t == task.NEG:
            stack.append((-stack.pop()) % task.p)
        else:
            x, y = stack.pop(), stack.pop()
            r = x + y if t == task.ADD else np.convolve(x, y)[: task.m]
            stack.append(r % task.p)
    assert len(stack) == 1
    return stack[0]


@pytest.mark.parametrize("p,m", [(7, 2), (5, 3), (11, 1)])
def test_polynomial_answers_match_an_independent_evaluation(p, m):
    task = PolynomialTask(p=p, m=m)
    for n_ops in range(0, 7):
        for i in range(40):
            ex, start = task.example(_rng(n_ops, 0, i), n_ops)
            assert ex[start - 1] == task.EQ and ex[-1] == task.SEP
            prompt, answer = ex[: start - 1], ex[start : start + m]
            assert sum(t in (task.ADD, task.MUL, task.NEG) for t in prompt) == n_ops
            assert list(_independent_eval(prompt, task)) == answer


def test_polynomial_windows_start_with_an_example_and_mark_answers():
    task = PolynomialTask()
    tokens, answer = task.sequence(_rng(0, 0, 0), 64)
    ex, start = task.example(_rng(0, 0, 0))
    assert list(tokens[: len(ex)]) == ex
    assert answer[start : start + task.m].all() and not answer[:start].any()


def test_datamodule_windows_shape_and_determinism():
    task = PolynomialTask()
    kw = dict(seq_len=32, n_future=4, batch_size=5, train_steps=3, seed=0)
    a = next(iter(SyntheticDataModule(task, **kw).train_dataloader()))
    b = next(iter(SyntheticDataModule(task, **kw).train_dataloader()))
    assert a.shape == (5, 36) and a.dtype == torch.int64 and torch.equal(a, b)


class _Oracle(torch.nn.Module):
    """A stand-in for head 1 that predicts by a rule: `rule(x)` gives, for every row and
    position of the input x (B, T), the token it predicts next (B, T)."""

    def __init__(self, rule, vocab_size: int) -> None:
        super().__init__()
        self.rule, self.vocab_size = rule, vocab_size
        self.device_probe = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x, *, heads=None):
        return torch.nn.functional.one_hot(self.rule(x), self.vocab_size).float()[None]


def _copy_rule(task: InductionTask):
    """What an induction head does: after a name's first token, the token that followed its
    latest earlier occurrence."""
    def rule(x):
        out = torch.zeros_like(x)
        for r, row in enumerate(x.tolist()):
            last = {}
            for t, tok in enumerate(row):
                if t > 0:
                    last[row[t - 1]] = tok
                if 1 <= tok <= task.n_first and tok in last:
                    out[r, t] = last[tok]
        return out
    return rule


def _answer_rule(task: PolynomialTask, shift: int = 0):
    """The right answer at each answer position (an independent evaluation of the prompt),
    written `shift` positions late."""
    def rule(x):
        out = torch.full_like(x, task.SEP)
        for r, row in enumerate(x.tolist()):
            eq = row.index(task.EQ)
            for i, tok in enumerate(_independent_eval(row[:eq], task)):
                if eq + i + shift < len(row):
                    out[r, eq + i + shift] = int(tok)
        return out
    return rule


def test_an_induction_oracle_scores_one_and_a_copier_of_the_wrong_token_zero():
    task = InductionTask()
    oracle = _Oracle(_copy_rule(task), task.vocab_size)
    assert induction_accuracy(oracle, task, n_seqs=16, length=64) == 1.0
    # repeating the current token is never the copy (name tokens differ): a mask or target
    # off by one position would let it score
    echo = _Oracle(lambda x: x, task.vocab_size)
    assert induction_accuracy(echo, task, n_seqs=16, length=64) == 0.0


def test_an_arithmetic_oracle_scores_one_and_a_late_one_does_not():
    task = PolynomialTask()
    oracle = _Oracle(_answer_rule(task), task.vocab_size)
    assert arithmetic_accuracy(oracle, task, 3, n_examples=20) == (1.0, 1.0)
    late = _Oracle(_answer_rule(task, shift=1), task.vocab_size)
    exact, _ = arithmetic_accuracy(late, task, 3, n_examples=20)
    assert exact < 0.5


# -- results, statistics, reports -------------------------------------------------------------


def test_results_csv_appends_and_knows_what_is_done(tmp_path):
    res = common.ResultsCSV(tmp_path / "r.csv", ["K", "seed", "x"], ["K", "seed"])
    assert res.done() == set()
    res.append({"K": 1, "seed": 0, "x": 0.5})
    res.append({"K": 2, "seed": 0, "x": float("nan")})
    assert res.is_done(K=1, seed=0) and res.is_done(K=2, seed=0)
    assert not res.is_done(K=1, seed=1)
    assert [r["x"] for r in res.rows()] == ["0.5", ""]


def test_summarize_matches_numpy():
    xs = [0.1, 0.4, 0.35]
    s = common.summarize(xs + [float("nan")])
    assert s["n"] == 3 and s["mean"] == pytest.approx(np.mean(xs))
    assert s["std"] == pytest.approx(np.std(xs, ddof=1))


def _write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


_PROV = {"git": "abc1234", "environment": "here", "utc": "2026-12-02 00:00"}


def _line(page: str, *parts: str) -> str:
    return next(x for x in page.splitlines() if all(p in x for p in parts))


def test_induction_report_checks_the_floor_counts_copying_runs_and_computes_verdicts(tmp_path):
    floor = 0.4
    # d = 32: K = 1 copies in 1 of 5 seeds, K = 2 in all 5; d = 64: every run at the floor
    acc = {(32, 1): [0.41, 0.93, 0.42, 0.40, 0.40], (32, 2): [0.96, 0.97, 0.95, 0.98, 0.99],
           (64, 1): [0.40, 0.41, 0.40, 0.39, 0.41], (64, 2): [0.41, 0.40, 0.40, 0.41, 0.39]}
    rows = [{"d_model": d, "K": k, "seed": s, "params": 1000 * d, "head1_depth": 3,
             "steps": 300, "copy_acc": a, "floor": floor, "chance": 1 / 32,
             "curve": json.dumps([[100, 0.3], [200, a if a > 0.9 else 0.4], [300, a]]),
             "train_s": 1.0, **_PROV}
            for (d, k), accs in acc.items() for s, a in enumerate(accs)]
    _write_csv(tmp_path / "results.csv", induction.COLUMNS, rows)
    page = induction.report(tmp_path, common.load_preset("induction", "cpu"), "cmd")
    for name in ("induction_accuracy.png", "curves_d32.png", "curves_d64.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| 32 | 32000 | 3 | 1 |" in page and "| 1 of 5 | never, 200, never, never, never |" \
        in _line(page, "| 32 | 32000 | 3 | 1 |")
    assert "| 5 of 5 | 200, 200, 200, 200, 200 |" in _line(page, "| 32 | 32000 | 3 | 2 |")
    assert "**above the floor**" in _line(page, "d = 32, the K = 1 baseline")
    assert "**not above the floor**" in _line(page, "d = 64, the K = 1 baseline")
    assert "K = 1: median step 200 over the 1 of 5 runs that copied; K = 2: median step 200 " \
        "over the 5 of 5" in _line(page, "d = 32, when copying emerged")
    assert "K = 1: none of 5 runs copied" in _line(page, "d = 64, when copying emerged")
    assert "**reproduced**" in _line(page, "d = 32, K = 2 vs K = 1")
    assert "**not testable at this scale" in _line(page, "d = 64, K = 2 vs K = 1")
    assert "Made by git abc1234 (committed code)" in page
    # --report-only rewrites the same page
    assert induction.report(tmp_path, common.load_preset("induction", "cpu"), "cmd") == page


def test_arithmetic_report_checks_the_floor_and_computes_verdicts(tmp_path):
    acc = {1: [0.30, 0.32, 0.31, 0.29, 0.33], 2: [0.31, 0.30, 0.33, 0.32, 0.29],
           4: [0.20, 0.21, 0.19, 0.22, 0.20]}
    rows = [{"d_model": 64, "K": k, "seed": s, "params": 5000 + k, "head1_depth": 5,
             "steps": 10, "acc_in": a, "acc_out": 0.1, "coef_acc_in": 0.7, "coef_acc_out": 0.3,
             "acc_by_ops": json.dumps({1: a, 2: a, 3: 0.1}), "floor_in": 0.08,
             "floor_out": 0.09, "curve": json.dumps([[5, 0.1], [10, a]]), "train_s": 1.0,
             **_PROV} for k, accs in acc.items() for s, a in enumerate(accs)]
    _write_csv(tmp_path / "results.csv", arithmetic.COLUMNS, rows)
    page = arithmetic.report(tmp_path, common.load_preset("arithmetic", "cpu"), "cmd")
    for name in ("accuracy_by_ops_d64.png", "curves_d64.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "0.30, 0.32" not in page and "0.300, 0.320, 0.310, 0.290, 0.330" in page
    assert "**above the floor**" in _line(page, "the K = 1 baseline in distribution")
    assert "**not resolved by the criterion**" in _line(page, "K = 2 vs K = 1, in distribution")
    assert "**contradicted**" in _line(page, "K = 4 vs K = 1, in distribution")
    # out of distribution every group sits at 0.1, but the baseline learned in distribution
    assert "**not resolved" in _line(page, "K = 4 vs K = 1, out of distribution")
    # nobody learned: nothing is testable
    for r in rows:
        r["acc_in"] = 0.08
    _write_csv(tmp_path / "results.csv", arithmetic.COLUMNS, rows)
    page = arithmetic.report(tmp_path, common.load_preset("arithmetic", "cpu"), "cmd")
    assert "**not above the floor**" in _line(page, "the K = 1 baseline in distribution")
    assert "**not testable at this scale" in _line(page, "K = 2 vs K = 1, in distribution")


def test_the_majority_floor_is_the_most_frequent_answer_on_the_scored_examples():
    from collections import Counter

    from experiments.synthetic import majority_accuracy, majority_answer

    task = PolynomialTask(p=5, m=2, train_ops=(1, 2))
    answer = majority_answer(task)
    assert answer == (0, 0)  # products make zero the likeliest coefficient
    exs = [task.example(_rng(10_000 + 2, 2, i), 2) for i in range(400)]
    counted = Counter(tuple(e[s : s + 2]) for e, s in exs)[answer] / 400
    assert majority_accuracy(task, 2, n_examples=400, answer=answer) == pytest.approx(counted)
    assert counted > 2 / task.p ** task.m  # well above uniform guessing


def test_learning_curves_are_probed_on_schedule_and_their_time_left_out():
    from experiments.synthetic import train_model
    from mtp.config import OptimConfig

    task = InductionTask()
    calls = []
    cfg = ModelConfig(vocab_size=task.vocab_size, d_model=16, n_layers=1, n_heads=1,
                      n_future=2, max_seq_len=24)
    trained = train_model(task, cfg, OptimConfig(lr=1e-3, warmup_steps=1), seq_len=16,
                          batch_size=2, steps=7, seed=0,
                          probe=lambda m: calls.append(m.training) or len(calls),
                          probe_every=3)
    assert [s for s, _ in trained.curve] == [3, 6, 7] and calls == [False] * 3
    assert trained.model.training is False and trained.seconds > 0


def test_studies_record_each_run_with_its_curve_depth_and_provenance(tmp_path):
    preset = common.load_preset("induction", "cpu") | {
        "sizes": [16], "ks": [1, 2], "seeds": [0], "steps": 4, "probe_every": 2,
        "eval_seqs": 8, "probe_seqs": 4, "batch_size": 2, "seq_len": 16}
    induction.run(preset, tmp_path, tmp_path / "work")
    rows = common.ResultsCSV(tmp_path / "results.csv", induction.COLUMNS, induction.KEY).rows()
    assert sorted((r["K"], r["head1_depth"]) for r in rows) == [("1", "3"), ("2", "3")]
    assert all(json.loads(r["curve"])[-1][0] == 4 and r["git"] for r in rows)


def test_map_runs_gives_every_result_with_workers_or_without():
    import operator

    calls = [(i, 10 * i) for i in range(4)]
    assert sorted(common.map_runs(operator.add, calls, jobs=2)) == [0, 11, 22, 33]
    assert list(common.map_runs(operator.add, calls)) == [0, 11, 22, 33]


def test_every_preset_loads_and_names_its_fields():
    for path in sorted((REPO / "experiments" / "presets").glob("*.yaml")):
        study, name = path.stem.split("_", 1) if not path.stem.startswith("k_sweep") else (
            "k_sweep", path.stem.removeprefix("k_sweep_"))
        preset = common.load_preset(study, name)
        assert preset["seeds"] and len(preset["seeds"]) >= 3, path
        if study == "k_sweep":
            cfg = k_sweep.run_fit_config(preset, 2, 0, Path("/tmp/x"))
            assert cfg["model"]["matched_params"] and cfg["model"]["n_future"] == 2
            assert (REPO / preset["fit_config"]).is_file()
            # every run's model is valid, depth-matched controls and scanned widths included
            for _, sweep in k_sweep.width_sweeps(preset):
                for h, k, _, n in k_sweep.plan(sweep, sweep.get("head_types", ["block"])):
                    cfg = k_sweep.run_fit_config(sweep, k, 0, Path("/tmp/x"), h, n)
                    ModelConfig(**{key: v for key, v in cfg["model"].items()
                                   if key in ModelConfig.__dataclass_fields__})


# -- the K sweep, tiny, end to end -------------------------------------------------------------


def test_fit_argv_resumes_from_last_checkpoint(tmp_path):
    assert "--ckpt_path" not in k_sweep.fit_argv(tmp_path)
    last = tmp_path / "tb" / "version_0" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 7}, last)
    argv = k_sweep.fit_argv(tmp_path)
    assert argv[argv.index("--ckpt_path") + 1] == str(last)


def _tiny_preset(tiny_corpus, tmp_path, **fields) -> Path:
    """A K-sweep preset of seconds: the debug model, 4 steps, a tiny corpus, cheap evaluation."""
    preset = {
        "fit_config": "configs/debug.yaml",
        "fit": {"trainer": {"max_steps": 4, "val_check_interval": 2, "limit_val_batches": 1,
                            "devices": 1, "accelerator": "cpu", "enable_progress_bar": False},
                "data": {"source": str(tiny_corpus), "cache_dir": str(tmp_path / "cache"),
                         "max_documents": None, "val_fraction": 0.2, "seq_len": 16,
                         "batch_size": 4},
                "model": {"vocab_size": 300, "n_layers": 2, "max_seq_len": 64}},
        "seeds": [0],
        "eval": {"device": "cpu", "val_windows": 4, "humaneval_limit": 0, "mbpp_limit": 0,
                 "max_new_tokens": 4, "batch_size": 2, "workers": 1, "spec_prompts": 2,
                 "spec_prompt_tokens": 4, "spec_new_tokens": 6, "spec_repeat": 2},
        **fields,
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(preset))
    return path


def test_k_sweep_runs_reports_and_skips_finished_runs(tiny_corpus, tmp_path, monkeypatch):
    path = _tiny_preset(tiny_corpus, tmp_path, ks=[1, 2], depth_controls=True)
    out, work = tmp_path / "out", tmp_path / "work"
    monkeypatch.setattr(k_sweep, "single_thread", lambda: None)  # keep the session's threads
    argv = ["--preset", str(path), "--out", str(out), "--work", str(work)]
    assert k_sweep.main(argv) == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [(r["K"], r["n_layers"], r["seed"]) for r in rows] == [
        ("1", "2", "0"), ("2", "2", "0"), ("1", "1", "0")]  # K = 1, K = 2, K = 2's control
    assert rows[0]["params"] == rows[1]["params"]  # matched parameter counts
    assert rows[2]["head1_depth"] == rows[1]["head1_depth"] == "2" != rows[0]["head1_depth"]
    assert float(rows[0]["spec_L"]) == 1.0 and rows[1]["spec_identical"] == "1"
    assert rows[1]["git"] and rows[1]["utc"] and float(rows[1]["spec_speedup_vs_k1"]) > 0
    page = (out / "README.md").read_text()
    assert "the objective itself" in page and "the lost depth" in page
    assert "Criterion of every verdict" in page
    names = ("README.md", "loss_vs_k.png", "L_vs_k.png", "speedup_vs_k.png")
    written = {name: (out / name).read_bytes() for name in names}
    assert all(written.values())
    assert list((work / "hparams" / "K2-s0").glob("events.out.tfevents.*"))
    # the page and plots come from the CSV alone: rebuilt, they are the same bytes
    assert k_sweep.main([*argv, "--report-only"]) == 0
    assert {name: (out / name).read_bytes() for name in names} == written

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(k_sweep, "train", no_training)
    assert k_sweep.main(argv) == 0
    assert len(list(csv.DictReader(open(out / "results.csv")))) == 3


def test_a_size_scan_runs_a_sweep_per_width_and_compares_them(tiny_corpus, tmp_path,
                                                              monkeypatch):
    path = _tiny_preset(tiny_corpus, tmp_path, ks=[1, 2], widths=[16, 32], head_dim=8)
    out, work = tmp_path / "out", tmp_path / "work"
    monkeypatch.setattr(k_sweep, "single_thread", lambda: None)
    argv = ["--preset", str(path), "--out", str(out), "--work", str(work)]
    assert k_sweep.main(argv) == 0
    for w, heads in ((16, 2), (32, 4)):
        rows = list(csv.DictReader(open(out / f"d{w}" / "results.csv")))
        assert [r["K"] for r in rows] == ["1", "2"]
        fit = yaml.safe_load((work / f"d{w}" / "K2-s0" / "fit.yaml").read_text())
        assert (fit["model"]["d_model"], fit["model"]["n_heads"]) == (w, heads)
    page = (out / "README.md").read_text()
    assert "[d = 16](d16/README.md)" in page and "d = 32, next-token loss of K = 2 vs K = 1" \
        in page and "too few seeds" in page
    first = {p: p.read_bytes() for p in sorted(out.rglob("*.md"))}
    assert k_sweep.main([*argv, "--report-only"]) == 0
    assert {p: p.read_bytes() for p in sorted(out.rglob("*.md"))} == first
    bad = _tiny_preset(tiny_corpus, tmp_path, ks=[1], widths=[20], head_dim=8)
    with pytest.raises(InputError, match=r"widths \[20\] must be multiples of its head_dim"):
        k_sweep.main(["--preset", str(bad), "--out", str(out), "--work", str(work)])


@pytest.mark.parametrize("text, why", [("- 1\n- 2\n", "must be a YAML mapping of settings (it "
                                                     "holds a list)"),
                                       ("a: [1\n", "not valid YAML: line 2, column 1:")])
def test_a_malformed_preset_is_named(tmp_path, capsys, text, why):
    path = tmp_path / "preset.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=re.escape(why)):
        common.load_preset("k_sweep", str(path))
    # a study's command line reports it in one line, exit status 2
    assert common.study_main(lambda: k_sweep.main(["--preset", str(path)])) == 2
    err = capsys.readouterr().err
    assert f"--preset {path}" in err and why in err and "Traceback" not in err


def test_an_unknown_preset_names_the_known_ones(capsys):
    assert common.study_main(lambda: k_sweep.main(["--preset", "nonsense"])) == 2
    assert ("--preset nonsense: no such preset for k_sweep (known: bytes_cpu, cpu, gpu, "
            "heads_cpu, scan_gpu)") in capsys.readouterr().err


def test_provenance_marks_uncommitted_code_but_not_the_studies_own_outputs(tmp_path,
                                                                         monkeypatch):
    """A run's row says `+dirty` for a changed source file, not for the reports under
    experiments/reports, which every run writes."""
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "code.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=repo, check=True)
    monkeypatch.setattr(common, "REPO", repo)
    (repo / "experiments" / "reports" / "other").mkdir(parents=True)  # a study's outputs
    (repo / "experiments" / "reports" / "other" / "results.csv").write_text("b\n")
    clean = common.provenance()["git"]
    assert clean and not clean.endswith("+dirty")
    (repo / "code.py").write_text("x = 2\n")
    assert common.provenance()["git"] == clean + "+dirty"
    line = common.provenance_line([{"git": clean + "+dirty", "environment": "e", "utc": "t"}])
    assert "(uncommitted changes!)" in line


def test_k_sweep_compares_head_types(tiny_corpus, tmp_path, monkeypatch):
    path = _tiny_preset(tiny_corpus, tmp_path, ks=[1, 3])
    out, work = tmp_path / "out", tmp_path / "work"
    monkeypatch.setattr(k_sweep, "single_thread", lambda: None)
    argv = ["--preset", str(path), "--out", str(out), "--work", str(work),
            "--head-types", "deepseek,linear"]
    assert k_sweep.main(argv) == 0
    rows = {(r["head_type"], r["K"]): r for r in csv.DictReader(open(out / "results.csv"))}
    assert sorted(rows) == [("block", "1"), ("deepseek", "3"), ("linear", "3")]
    d = 32  # configs/debug.yaml
    base = int(rows["block", "1"]["params"])
    # deepseek: matched blocks plus two modules' projections and norm gains; linear: the K = 1
    # trunk's blocks plus one of its own, and three d x d maps instead of the head block
    assert int(rows["deepseek", "3"]["params"]) == base + 2 * (2 * d * d + 2 * d)
    assert rows["block", "1"]["head1_depth"] == "3" and rows["deepseek", "3"]["head1_depth"] == "1"
    assert rows["linear", "3"]["head1_depth"] == "3"
    for key in (("deepseek", "3"), ("linear", "3")):
        r = rows[key]
        # draft 1 was always offered (draft 2 only where draft 1 was accepted); K = 3 has two
        assert r["spec_identical"] == "1" and r["accept_pos1"] != "" and r["accept_pos3"] == ""
        assert float(r["spec_speedup_vs_k1"]) > 0
    page = (out / "README.md").read_text()
    assert "Acceptance of draft 2, deepseek vs linear heads" in page
    assert "Bonferroni" in page and (out / "acceptance.png").stat().st_size > 0
    with pytest.raises(InputError, match="--head-types block,beam: unknown beam"):
        k_sweep.main([*argv[:-1], "block,beam"])


def test_results_csv_refuses_to_append_under_another_header(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text("K,seed\n1,0\n")
    with pytest.raises(InputError, match="holds results with other columns"):
        common.ResultsCSV(path, ["head_type", "K", "seed"], ["K", "seed"]).append(
            {"head_type": "block", "K": 2, "seed": 0})
    assert path.read_text() == "K,seed\n1,0\n"


def test_permutation_and_bootstrap_statistics():
    # every split of {1, 2, 3, 10, 11, 12} into halves: only the observed one and its mirror
    # are as extreme, 2 of C(6, 3) = 20
    assert common.permutation_p([10, 11, 12], [1, 2, 3]) == pytest.approx(0.1)
    assert common.permutation_p([1, 2, 3], [1, 2, 3]) == 1.0
    lo, hi = common.bootstrap_ci([10, 11, 12], [1, 2, 3])
    assert 7 <= lo < 9 < hi <= 11


def test_a_verdict_needs_the_bootstrap_and_the_permutation_test_to_agree():
    clear = [0.5, 0.52, 0.51, 0.49, 0.53]
    assert common.compare([x + 0.2 for x in clear], clear)[1] == "higher"
    assert common.compare(clear, [x + 0.2 for x in clear], m=3)[1] == "lower"
    # at a ceiling: one group has no spread, so every bootstrap difference is negative, but
    # the five values of each group mix (p = 0.087): no verdict
    ceiling, near = [1.0] * 5, [0.9996, 1.0, 0.9992, 1.0, 0.9998]
    lo, hi = common.bootstrap_ci(near, ceiling, level=1 - 0.05 / 3)
    assert hi <= 0 and common.permutation_p(near, ceiling) > 0.05
    assert common.compare(near, ceiling, m=3)[1] == "not distinguishable"
    assert common.compare(clear[:3], clear[:3])[1].startswith("too few seeds")


@pytest.mark.parametrize("form", ["module", "script"])
def test_studies_run_as_modules_and_as_scripts(form):
    """`python -m experiments.<study>` (no path set up by anyone) and `python
    experiments/<study>.py` both start each study."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for study in ("k_sweep", "arithmetic", "induction"):
        target = ["-m", f"experiments.{study}"] if form == "module" else \
            [f"experiments/{study}.py"]
        proc = subprocess.run([sys.executable, *target, "--help"], cwd=REPO, env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 0 and "--preset" in proc.stdout, proc.stderr


def _synthetic_rows(out: Path, losses: dict[int, list[float]]) -> None:
    """A results.csv of made-up runs: K -> next-token loss per seed."""
    table = k_sweep.results(out)
    for k, values in losses.items():
        for seed, loss in enumerate(values):
            table.append({"head_type": "block", "K": k, "n_layers": 8, "seed": seed,
                          "params": 1000, "steps": 10, "head1_depth": 10 - k,
                          "next_token_loss": loss, "val_loss_mean": loss,
                          **{f"loss_head{i}": loss for i in range(1, k + 1)},
                          "spec_L": 1.0 + 0.1 * k, "spec_identical": 1, "spec_speedup": 1.1,
                          "fit_s": 1, "eval_s": 1, "git": "abc1234", "environment": "here",
                          "utc": "2026-12-02 00:00"})


def test_byte_level_report_gives_bits_per_byte_and_a_computed_verdict(tmp_path):
    out, seeds, verdict = tmp_path / "out", 5, "reproduced"
    # K = 8 clearly below K = 1 in five seeds (three could not show it: p >= 0.1)
    _synthetic_rows(out, {1: [2.0 + 0.01 * s for s in range(seeds)],
                          8: [1.5 + 0.01 * s for s in range(seeds)]})
    preset = common.load_preset("k_sweep", "bytes_cpu")
    page = k_report.report(out, preset, "python experiments/k_sweep.py --preset bytes_cpu",
                           k_sweep.results(out).rows(), k_sweep.base_layers(preset))
    header = next(x for x in page.splitlines() if x.startswith("| K |"))
    assert "| per seed | bits per byte |" in header
    row = next(x for x in page.splitlines() if x.startswith("| 1 |"))
    mean = sum(2.0 + 0.01 * s for s in range(seeds)) / seeds
    assert f"| {mean / math.log(2):.3f} ± " in row  # K = 1's mean in bits
    line = next(x for x in page.splitlines() if "byte-level models gain the most" in x)
    assert f"**{verdict}" in line
    assert "Made by git abc1234 (committed code)" in page


def test_byte_level_verdict_is_the_objective_against_the_depth_matched_control(tmp_path):
    """K = 8 loses to the full K = 1 model (its head 1 is shallower) but beats the K = 1 model
    of its own head-1 depth: the objective helps, and the verdict says so."""
    out = tmp_path / "out"
    _synthetic_rows(out, {1: [2.0 + 0.01 * s for s in range(5)],
                          8: [2.5 + 0.01 * s for s in range(5)]})
    table = k_sweep.results(out)
    for seed in range(5):  # K = 1 controls of K = 8's head-1 depth (10 - 8 blocks)
        loss = 3.0 + 0.01 * seed
        table.append({"head_type": "block", "K": 1, "n_layers": 1, "seed": seed,
                      "params": 500, "steps": 10, "head1_depth": 2, "next_token_loss": loss,
                      "val_loss_mean": loss, "loss_head1": loss, "spec_L": 1.0,
                      "spec_identical": 1, "spec_speedup": 1.0, "fit_s": 1, "eval_s": 1,
                      "git": "abc1234", "environment": "here", "utc": "2026-12-02 00:00"})
    preset = common.load_preset("k_sweep", "bytes_cpu")
    page = k_report.report(out, preset, "python experiments/k_sweep.py --preset bytes_cpu",
                           k_sweep.results(out).rows(), k_sweep.base_layers(preset))
    lines = page.splitlines()
    assert "**higher**" in next(x for x in lines if "K = 8 vs K = 1 at equal parameters" in x)
    line = next(x for x in lines if "byte-level models gain the most" in x)
    assert "K = 8: **reproduced** (against its depth-matched control)" in line
