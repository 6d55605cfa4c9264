"""Strict YAML reading (`mtp.util.yaml_file`): a key twice in one mapping is refused naming the
file, line and key (`mtp fit --config` exits 2 before anything else); merge keys and the same key
in other mappings are fine."""

import pytest

from mtp.cli import main
from mtp.util.errors import InputError
from mtp.util.yaml_file import read_yaml_mapping


def test_duplicate_yaml_keys_are_refused_naming_file_line_and_key(tmp_path, capsys):
    cfg = tmp_path / "dup.yaml"
    cfg.write_text("trainer:\n  val_check_interval: 3\n"
                   "model:\n  n_future: 2\n  d_model: 64\n  n_future: 4\n"
                   "trainer:\n  val_check_interval: 100\n")
    with pytest.raises(InputError) as err:
        read_yaml_mapping(cfg, f"--config {cfg}")
    assert str(err.value).splitlines() == [
        f"--config {cfg}: duplicate keys (YAML would keep only the last, silently):",
        "  line 6: key 'n_future' again (first on line 4)",
        "  line 7: key 'trainer' again (first on line 1)"]
    # through the CLI: exit 2 before anything else happens
    assert main(["fit", "--config", str(cfg), "--data.cache_dir", "/nonexistent/cache"]) == 2
    assert "line 7: key 'trainer' again (first on line 1)" in capsys.readouterr().err


def test_yaml_merge_keys_and_repeated_keys_in_other_mappings_are_fine(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("base: &b {n_future: 2, d_model: 64}\n"
                   "model:\n  <<: *b\n  n_future: 4\n"
                   "data:\n  n_future: 1\n")
    data = read_yaml_mapping(cfg, "x")
    assert data["model"] == {"n_future": 4, "d_model": 64} and data["data"] == {"n_future": 1}
    flow = tmp_path / "flow.yaml"
    flow.write_text("model: {n_future: 2, n_future: 3}\n")
    with pytest.raises(InputError, match=r"line 1: key 'n_future' again \(first on line 1\)"):
        read_yaml_mapping(flow, "x")
