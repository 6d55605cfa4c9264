"""Shared pytest setup: GPU auto-skip and the Triton CPU interpreter."""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The repository root on the path for its `experiments` package, but last: its `kernels/` folder
# (installed as `mtp.kernels`) would otherwise shadow the Hugging Face `kernels` package that
# transformers imports (`python -m pytest` puts the working directory first).
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != REPO] + [str(REPO)]

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels can only run in the interpreter, and Triton decides between
    # compiling and interpreting when a kernel is decorated, i.e. when its module is imported. This
    # file is imported before any test module, so the switch is set before mtp.kernels exists.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests when CUDA is unavailable (e.g. ``pytest -m gpu`` on CPU)."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Kill child processes a failed test left behind: the interpreter would wait for them at
    exit, and a hung one would hold the run until CI's time limit."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(5)


# Nothing in the tests may reach the Hugging Face hub (a request here fails only after ~25 s).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# Caches (the evaluation's reference times) of this session only, not the user's.
os.environ.setdefault("MTP_CACHE_DIR", tempfile.mkdtemp(prefix="mtp-test-cache-"))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory):
    """A directory of 60 real Python files from the standard library, plus one that is not
    UTF-8 (to be skipped and counted) and one empty file."""
    import shutil
    import sysconfig
    from pathlib import Path

    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if 2_000 < p.stat().st_size < 40_000)[:60]
    for p in files:
        shutil.copy(p, root / p.name)
    (root / "latin1.py").write_bytes("# caf\xe9\nx = 1\n".encode("latin-1"))
    (root / "empty.py").write_text("")
    return root
