"""`scripts/gpu_check.sh` in its dry run (`GPU_CHECK_DRY=1`): every step's command on the CPU at
tiny sizes, so that no flag or config the GPU check uses disappears before the next GPU window;
and a misspelled flag in it fails the dry run, naming the flag."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
USER_STEPS = ["fit", "resume", "generate", "decode", "fit-k1", "fsdp", "compiled"]
KERNEL_STEPS = ["kernel-tests", "kernel-bf16", "kernel-fp32", "kernel-sweep", "registers",
                "train-1B", "loss-path"]


def _dry_run(script: Path, tmp_path: Path, steps: str | None = None
             ) -> subprocess.CompletedProcess:
    """The script run as `GPU_CHECK_DRY=1 bash SCRIPT` on this repository, its output and work
    folders under `tmp_path`, no wheels installed (this interpreter has its packages)."""
    env = {**os.environ, "GPU_CHECK_DRY": "1", "GPU_CHECK_ROOT": str(REPO),
           "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"),
           "GPU_WHEELS": str(tmp_path / "no-wheels"), "PYTHON": sys.executable}
    env.pop("GPU_CHECK_STEPS", None)
    if steps is not None:
        env["GPU_CHECK_STEPS"] = steps
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=900)


def _logged(out: Path, name: str) -> str:
    """The text of `logs/NAME` inside the run's logs.tar.gz."""
    with tarfile.open(out / "logs.tar.gz") as tar:
        return tar.extractfile(f"logs/{name}").read().decode()


def _step_rows(out: Path) -> dict[str, list[str]]:
    """The rows of logs/steps.tsv: step name -> [status, exit status, seconds, timeout]."""
    tsv = io.StringIO(_logged(out, "steps.tsv"))
    return {row[0]: row[1:] for row in csv.reader(tsv, delimiter="\t")}


def test_dry_run_runs_every_step_and_writes_the_tables(tmp_path):
    run = _dry_run(SCRIPT, tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    out = tmp_path / "out"
    # three files, so that the results come back whole from a machine that returns only a few
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "steps.log", "summary.md"]
    rows = _step_rows(out)
    assert list(rows) == USER_STEPS + KERNEL_STEPS
    assert all(r[0] == "ok" and r[1] == "0" for r in rows.values()), rows
    summary = (out / "summary.md").read_text()
    # each Lightning run says which linear cross-entropy ran: on the CPU the chunked torch path
    lightning = [line for line in summary.splitlines() if "| bf16-mixed |" in line]
    assert [line.split(" | ")[0] for line in lightning] == ["| fit", "| resume", "| fit-k1",
                                                            "| fsdp"]
    assert all("torch implementation on cpu bfloat16 tensors" in line for line in lightning)
    assert "| fsdp | 4 | fsdp | False | bf16-mixed |" in summary
    assert "| fit-k1 | 1 | ddp | False |" in summary
    # the compiled run is parsed only: its flags resolved into the printed config
    assert "compile:\n  enabled: true\n" in _logged(out, "compiled.txt")
    assert "| resume | 4 | ddp | False | bf16-mixed | 6 |" in summary  # 4 steps, then 2 more
    assert "| process RSS (no CUDA) |" in summary  # K = 1 against K = 4, without CUDA
    assert "outputs equal: yes" in summary
    assert "| self-spec h=4 |" in summary
    assert "CHECK FAILED" not in summary
    assert summary.rstrip().endswith("result: all steps that ran passed")


@pytest.mark.parametrize(("flag", "misspelled", "steps"), [
    ("--model.n_future 4", "--model.n_futur 4", "fit"),  # LightningCLI (jsonargparse)
    ("--max-naive-gib 100", "--max-naive-gb 100", "loss-path"),  # argparse, parsed only
], ids=["fit", "bench-loss"])
def test_a_misspelled_flag_fails_the_dry_run(flag, misspelled, steps, tmp_path):
    text = SCRIPT.read_text()
    assert flag in text
    script = tmp_path / "gpu_check.sh"
    script.write_text(text.replace(flag, misspelled, 1))
    run = _dry_run(script, tmp_path, steps=steps)
    assert run.returncode != 0
    assert f"{steps}: failed" in run.stdout
    # the error names the flag (argparse's words, and jsonargparse's after it)
    assert f"unrecognized arguments: {misspelled}" in run.stdout
    assert _step_rows(tmp_path / "out")[steps][0] == "failed"


def test_the_dry_run_fails_when_the_loss_logs_another_implementation(tmp_path):
    """The check that a GPU run's loss took the Triton kernels: here the CPU run is expected to
    have taken them, and the summary says which one it took instead."""
    text = SCRIPT.read_text()
    expected = 'LOSS_IMPL="torch implementation on cpu"'
    assert expected in text
    script = tmp_path / "gpu_check.sh"
    script.write_text(text.replace(expected, 'LOSS_IMPL="triton implementation on cpu"'))
    run = _dry_run(script, tmp_path, steps="fit")
    assert run.returncode == 1
    assert _step_rows(tmp_path / "out")["fit"][0] == "ok"  # the run itself passed
    assert ("CHECK FAILED: fit: the loss did not log `triton implementation on cpu` (got: linear "
            "cross-entropy: torch implementation on cpu bfloat16 tensors)") in run.stdout
