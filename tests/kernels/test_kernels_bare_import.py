"""Run from the repository root, where `import kernels` finds the repository's `kernels/` folder
(installed as `mtp.kernels`) before Hugging Face's `kernels` package that transformers imports."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO as ROOT

from mtp.config import ModelConfig
from mtp.data.bpe import train_tokenizer
from mtp.interop.hf_export import export
from mtp.model.transformer import MTPTransformer


def _run_at_root(code: str, *flags: str) -> str:
    """Run `code` as `python -c` does from the repository root: its folder first on sys.path."""
    proc = subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_kernels_at_the_root_gives_hugging_faces_package_and_mtp_kernels_still_works():
    pytest.importorskip("kernels")
    _run_at_root("""
        import importlib.util
        from pathlib import Path

        folder = Path.cwd() / "kernels"
        assert Path(importlib.util.find_spec("kernels").origin).parent == folder  # it shadows
        import kernels
        assert folder not in Path(kernels.__file__).resolve().parents, kernels.__file__
        import mtp.kernels
        assert Path(mtp.kernels.__file__).parent == folder
        assert callable(mtp.kernels.linear_cross_entropy)
        """)


def test_without_hugging_faces_package_kernels_is_reported_absent():
    """`-S`: no site-packages, so no other `kernels`; a probe must see it missing."""
    _run_at_root("""
        import sys
        try:
            import kernels
        except ModuleNotFoundError as e:
            assert e.name == "kernels" and "kernels" not in sys.modules, (e.name, sys.modules)
        else:
            raise AssertionError(kernels.__file__)
        """, "-S")


def test_transformers_loads_an_export_from_the_repository_root(tmp_path):
    pytest.importorskip("transformers")
    texts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
    tokenizer = train_tokenizer(texts, 300, 1 << 20)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=320, d_model=48, n_layers=1, n_future=2, max_seq_len=64)
    model = MTPTransformer(cfg).eval()
    export(model, tokenizer, tmp_path / "hf")
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    _run_at_root(f"""
        import sys
        from pathlib import Path

        import torch
        from transformers import AutoModelForCausalLM

        tmp = Path({str(tmp_path)!r})
        m = AutoModelForCausalLM.from_pretrained(tmp / "hf").eval()
        with torch.no_grad():
            torch.save(m(torch.load(tmp / "ids.pt")).logits, tmp / "got.pt")
        hf = sys.modules.get("kernels")
        assert hf is None or Path.cwd() / "kernels" not in Path(hf.__file__).resolve().parents
        """)
    with torch.no_grad():
        want = model(ids, heads=1)[0]
    got = torch.load(tmp_path / "got.pt")
    rel = (got - want).norm() / want.norm()
    assert rel <= 1e-5, f"relative error {rel:.2e}"
