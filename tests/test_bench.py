"""`mtp bench loss --fsdp` and `mtp bench tokenize` end to end at tiny sizes (the README's other
benchmark commands run in `tests/test_readme.py`)."""

import csv

from mtp.bench import main


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_bench_loss_under_fsdp_on_two_processes(tmp_path, capsys):
    out = tmp_path / "loss.csv"
    assert main(["loss", "--fsdp", "2", "--n", "128", "--d", "32", "--vocab", "256",
                 "--seq-len", "64", "--ks", "2", "--methods", "sequential+fused",
                 "--reps", "1", "--warmup", "0", "--device", "cpu", "--dtype", "fp32",
                 "--csv", str(out)]) == 0
    rows = _rows(out)
    assert [r["status"] for r in rows] == ["ok"], rows
    assert all(r["fsdp_ranks"] == "2" and float(r["peak_mib"]) > 0 for r in rows)


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
