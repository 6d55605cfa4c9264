"""experiments/: provenance of each run (the revision and CPU that trained and evaluated it,
uncommitted code) and the settings a page describes, as the rows recorded them."""

import csv
import json
from pathlib import Path

import pytest
from experiments_helpers import synthetic_rows

from experiments import common, induction, k_report, k_sweep
from mtp.util.errors import InputError


def test_studies_record_each_run_with_its_curve_depth_and_provenance(tmp_path):
    preset = common.load_preset("induction", "cpu") | {
        "sizes": [16], "ks": [1, 2], "seeds": [0], "steps": 4, "probe_every": 2,
        "eval_seqs": 8, "probe_seqs": 4, "batch_size": 2, "seq_len": 16}
    induction.run(preset, tmp_path, tmp_path / "work")
    rows = common.ResultsCSV(tmp_path / "results.csv", induction.COLUMNS, induction.KEY).rows()
    assert sorted((r["K"], r["head1_depth"]) for r in rows) == [("1", "3"), ("2", "3")]
    assert all(json.loads(r["curve"])[-1][0] == 4 and r["git"] for r in rows)
    # trained and scored in one call: the revision and CPU that trained it are those that
    # scored it; the CPU is the machine's model; the settings are the preset's but its plan
    cpu = _proc_cpu_model()
    for r in rows:
        assert r["fit_git"] == r["git"] and r["fit_cpu"] == r["cpu"] == common.cpu_model()
        assert cpu is None or r["cpu"].startswith(cpu)
        settings = json.loads(r["settings"])
        assert settings["seq_len"] == 16 and settings["task"] == preset["task"]
        assert settings["preset"] == preset["_path"] and "sizes" not in settings
    page = induction.report(tmp_path, "cmd")
    assert "`seq_len` 16; `batch_size` 2;" in page and "Steps: 4 (every run)." in page
    assert f"trained the runs: {rows[0]['git']}" in page and f"CPU: {rows[0]['cpu']};" in page


def _proc_cpu_model() -> str | None:
    """The CPU's model name as /proc/cpuinfo gives it (None elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((x.split(":", 1)[1].strip() for x in text.splitlines()
                 if x.startswith("model name")), None)


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


def test_a_resumed_training_names_every_revision_that_trained_it(tmp_path, monkeypatch):
    """`train` records its attempts as they start: a run resumed from an interrupted attempt's
    checkpoint was trained by both revisions; a finished record is read back, not retrained."""
    monkeypatch.setattr(k_sweep, "provenance", lambda: {
        "git": "bbb2222", "cpu": "New CPU x8", "utc": "2026-12-03 00:00", "environment": "e"})
    preset = common.load_preset("k_sweep", "cpu")
    resumed = tmp_path / "K2-s0"
    last = resumed / "tb" / "version_0" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"an interrupted attempt's checkpoint")
    (resumed / "fit_attempts.json").write_text(json.dumps(
        [{"git": "aaa1111", "cpu": "Old CPU x2", "utc": "2026-12-02 00:00"}]))
    calls = []
    monkeypatch.setattr("mtp.cli.main", lambda argv: calls.append(argv) or 0)
    record = k_sweep.train(preset, 2, 0, resumed)
    assert "--ckpt_path" in calls[0]
    assert (record["fit_git"], record["fit_cpu"]) == ("aaa1111 then bbb2222",
                                                      "Old CPU x2 then New CPU x8")
    assert record["settings"]["preset"] == "experiments/presets/k_sweep_cpu.yaml"
    assert record["settings"]["resolved"]["model"]["vocab_size"] == 512
    assert k_sweep.train(preset, 2, 0, resumed) == record and len(calls) == 1
    # a fresh start (no checkpoint to resume from) owes nothing to earlier attempts
    fresh = tmp_path / "K4-s0"
    fresh.mkdir()
    (fresh / "fit_attempts.json").write_text(json.dumps(
        [{"git": "aaa1111", "cpu": "Old CPU x2", "utc": "2026-12-02 00:00"}]))

    def fit(argv):
        ckpt = fresh / "tb" / "version_0" / "checkpoints" / "last.ckpt"
        ckpt.parent.mkdir(parents=True)
        ckpt.write_bytes(b"a finished fit's checkpoint")
        return 0

    monkeypatch.setattr("mtp.cli.main", fit)
    assert k_sweep.train(preset, 4, 0, fresh)["fit_git"] == "bbb2222"


def _recorded_settings(vocab: int, batch: int, seq: int, val_windows: int) -> str:
    return json.dumps({"preset": "experiments/presets/mine.yaml", "fit_config": "configs/x.yaml",
                       "fit": {"model": {"vocab_size": vocab}},
                       "resolved": {"model": {"vocab_size": vocab, "n_layers": 8},
                                    "data": {"batch_size": batch, "seq_len": seq},
                                    "trainer": {"max_steps": 10}},
                       "eval": {"val_windows": val_windows}})


def test_a_page_describes_the_settings_its_rows_recorded_not_todays_preset(tmp_path):
    """Rows that recorded their settings are described by them (the preset file passed says
    otherwise); rows that recorded none read `not recorded`, and the numbers the verdicts need
    come from the preset file with a sentence that says so."""
    losses = {1: [2.0 + 0.01 * s for s in range(5)], 4: [1.7 + 0.01 * s for s in range(5)]}
    preset = common.load_preset("k_sweep", "cpu")  # vocabulary 512, 256 validation windows
    old = tmp_path / "old"
    synthetic_rows(old, losses)
    page = k_report.report(old, preset, "cmd", k_sweep.results(old).rows(),
                           k_sweep.base_layers(preset))
    assert "Settings, as the rows recorded them: not recorded (the rows of all 10 runs" in page
    assert "they are read from `experiments/presets/k_sweep_cpu.yaml` as it is today " \
        "(vocabulary 512, 1536 training tokens a step)" in page
    assert "uniform guess's loss (ln 512" in page and "0.001M parameters trained on 0.015M " \
        "tokens" in page  # 10 steps of 1536 tokens
    new = tmp_path / "new"
    synthetic_rows(new, losses)
    rows = k_sweep.results(new).rows()
    with open(new / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=k_sweep.COLUMNS)
        writer.writeheader()
        writer.writerows(r | {"settings": _recorded_settings(300, 4, 25, 123)} for r in rows)
    page = k_report.report(new, preset, "cmd", k_sweep.results(new).rows(),
                           k_sweep.base_layers(preset))
    assert "`preset` experiments/presets/mine.yaml; `fit_config` configs/x.yaml; " \
        "`fit` `{\"model\": {\"vocab_size\": 300}}`;" in page
    assert "`eval.val_windows` 123;" in page and "`eval.spec_prompts` not recorded;" in page
    assert "as it is today" not in page and "ln 512" not in page
    assert "uniform guess's loss (ln 300" in page and "trained on 0.001M tokens" in page
    # half the rows recorded settings: the page says so, and what they disagree on
    mixed = tmp_path / "mixed"
    synthetic_rows(mixed, losses)
    rows = k_sweep.results(mixed).rows()
    with open(mixed / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=k_sweep.COLUMNS)
        writer.writeheader()
        writer.writerows(r | ({"settings": _recorded_settings(300, 4, 25, 100 + i % 2)}
                              if i % 2 else {}) for i, r in enumerate(rows))
    page = k_report.report(mixed, preset, "cmd", k_sweep.results(mixed).rows(),
                           k_sweep.base_layers(preset))
    assert "(5 of 10 runs recorded no settings (their rows predate the `settings` column))" \
        in page and "`eval.val_windows` 101;" in page


def test_recorded_settings_keep_what_every_row_agrees_on():
    rows = [{"settings": json.dumps({"a": 1, "b": {"c": 2, "d": 3}, "e": [1, 2]})},
            {"settings": json.dumps({"a": 1, "b": {"c": 2, "d": 4}})}, {"settings": ""}]
    rec = common.Recorded(rows)
    assert rec.get("b", "c") == 2 and rec.get("b", "d") is None and rec.get("e") is None
    assert (rec.text("a"), rec.text("b", "d"), rec.text("x")) == ("1", "not recorded",
                                                                  "not recorded")
    assert rec.note() == ("1 of 3 runs recorded no settings (their rows predate the `settings` "
                          "column); not every run recorded the same `b.d`, `e`")
    assert rec.note(ignore=("b.", "e")) == ("1 of 3 runs recorded no settings (their rows "
                                            "predate the `settings` column)")
    with pytest.raises(InputError, match="a `settings` cell of the results is not JSON"):
        common.Recorded([{"settings": '{"a": 1'}])
