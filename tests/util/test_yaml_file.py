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


def _laughs(levels: int = 9) -> str:
    """A 'billion laughs': `levels` levels of ten aliases each, the last at a real setting."""
    names = "abcdefghijklmnop"[:levels]
    lines = [f"{names[0]}: &{names[0]} [" + ", ".join(['"lol"'] * 10) + "]"]
    lines += [f"{n}: &{n} [" + ", ".join([f"*{p}"] * 10) + "]" for p, n in zip(names, names[1:])]
    return "\n".join(lines) + f"\nloss:\n  head_weights: *{names[-1]}\n"


def test_a_document_whose_aliases_expand_past_the_bound_is_refused_at_once(tmp_path, capsys):
    import time

    cfg = tmp_path / "laughs.yaml"
    cfg.write_text(_laughs())
    start = time.monotonic()
    with pytest.raises(InputError, match="its aliases expand it to more than 100,000 values"):
        read_yaml_mapping(cfg, f"--config {cfg}")
    assert main(["fit", "--config", str(cfg), "--data.cache_dir", "/nonexistent/cache"]) == 2
    assert time.monotonic() - start < 10  # counted on the composed graph, never expanded
    assert f"--config {cfg}: its aliases expand it" in capsys.readouterr().err
    # a value of the command line, which LightningCLI reads as YAML too
    names = "abcdefghi"
    value = "[&a [" + ", ".join(["1"] * 10) + "], " + ", ".join(
        f"&{n} [" + ", ".join([f"*{p}"] * 10) + "]" for p, n in zip(names, names[1:])) + "]"
    assert main(["fit", "--loss.head_weights", value, "--data.cache_dir",
                 "/nonexistent/cache"]) == 2
    assert "--loss.head_weights: its aliases expand it" in capsys.readouterr().err


def test_an_alias_inside_its_own_anchor_and_deep_nesting_are_refused(tmp_path):
    cfg = tmp_path / "self.yaml"
    cfg.write_text("a: &a [1, *a]\n")
    with pytest.raises(InputError, match="or into itself"):
        read_yaml_mapping(cfg, "--config self.yaml")
    cfg.write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(InputError, match="nested too deeply"):
        read_yaml_mapping(cfg, "--config deep.yaml")


def test_aliases_within_the_bound_and_a_config_that_is_not_a_file(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(_laughs(levels=4))  # 10**4 values: a large config, but within the bound
    assert len(read_yaml_mapping(cfg, "--config ok.yaml")["loss"]["head_weights"]) == 10
    with pytest.raises(InputError, match="--config /dev/zero: /dev/zero is a character device"):
        read_yaml_mapping("/dev/zero", "--config /dev/zero")
