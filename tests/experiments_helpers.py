"""What the experiments tests share: a tiny K-sweep preset, made-up K-sweep rows and the
provenance columns of a made-up row, and a CSV writer."""

import csv
from pathlib import Path

import yaml

from experiments import k_sweep

PROV = {"git": "abc1234", "environment": "here", "utc": "2026-12-02 00:00"}


def tiny_preset(tiny_corpus, tmp_path, **fields) -> Path:
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


def synthetic_rows(out: Path, losses: dict[int, list[float]]) -> None:
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


def write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    """A results.csv of the given rows under `columns`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
