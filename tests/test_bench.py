"""`mtp bench` run end to end at tiny sizes and write the columns they promise."""

import csv

from mtp.bench import main


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_bench_train_reports_the_flops_model_ratio(tmp_path, capsys):
    out = tmp_path / "train.csv"
    assert main(["train", "--model", "debug", "--ks", "1,2", "--compile", "off", "--seq-len", "32",
                 "--batch-size", "2", "--reps", "1", "--warmup", "0", "--csv", str(out)]) == 0
    rows = _rows(out)
    assert [(r["K"], r["compiled"]) for r in rows] == [("1", "False"), ("2", "False")]
    for r in rows:
        assert float(r["step_ms"]) > 0 and float(r["gflop_per_token"]) > 0
        ratio = float(r["time_vs_K1"]) / float(r["flops_ratio_vs_K1"])
        assert abs(float(r["time_over_flops_ratio"]) - ratio) < 1e-9
    assert float(rows[1]["flops_ratio_vs_K1"]) > 1  # K = 2 runs its unembedding twice
    # every row says what produced it: the command line, the code and the machine
    assert {r["command"] for r in rows} == {
        f"mtp bench train --model debug --ks 1,2 --compile off --seq-len 32 --batch-size 2 "
        f"--reps 1 --warmup 0 --csv {out}"}
    assert all(r["git_rev"] and r["torch"] and r["hardware"] for r in rows)


def test_bench_loss_under_fsdp_on_two_processes(tmp_path, capsys):
    out = tmp_path / "loss.csv"
    assert main(["loss", "--fsdp", "2", "--n", "128", "--d", "32", "--vocab", "256",
                 "--seq-len", "64", "--ks", "2", "--methods", "sequential+fused",
                 "--reps", "1", "--warmup", "0", "--device", "cpu", "--dtype", "fp32",
                 "--csv", str(out)]) == 0
    rows = _rows(out)
    assert [r["status"] for r in rows] == ["ok"], rows
    assert all(r["fsdp_ranks"] == "2" and float(r["peak_mib"]) > 0 for r in rows)


def test_bench_loss_at_a_shape_too_small_to_move_the_memory(tmp_path, capsys):
    """A K = 1 transient of 0 MiB leaves the ratio empty instead of dividing by zero."""
    out = tmp_path / "loss.csv"
    assert main(["loss", "--n", "64", "--d", "32", "--vocab", "128", "--seq-len", "32",
                 "--ks", "1", "--methods", "naive", "--reps", "1", "--warmup", "0",
                 "--csv", str(out)]) == 0
    (row,) = _rows(out)
    assert row["status"] == "ok"
    assert (row["transient_vs_K1"] == "") == (float(row["transient_mib"]) == 0)


def test_bench_tokenize_small_corpus(tmp_path, capsys):
    out = tmp_path / "tokenize.csv"
    assert main(["tokenize", "--size-mb", "1", "--dir", str(tmp_path), "--workers", "1,2",
                 "--vocab", "300", "--tokenizer-train-mb", "0.2", "--csv", str(out)]) == 0
    assert "bytes_per_s" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    assert [r["workers"] for r in rows] == ["1", "2"]
    assert all(r["identical"] == "1" and int(r["tokens"]) > 0 for r in rows)
    assert abs(int(rows[0]["bytes"]) - 2**20) < 100
    assert not list(tmp_path.glob("shards-*")), "shards are removed after each run"
