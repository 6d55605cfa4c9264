"""The package ``mtp.kernels``: its public names, its module names, and its dependencies
(torch, triton optional, nothing else)."""

import ast
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mtp.kernels

PUBLIC = [
    "TritonConfig",
    "linear_cross_entropy",
    "linear_cross_entropy_fwd_bwd",
    "linear_cross_entropy_reference",
    "linear_cross_entropy_triton",
]


def test_all_lists_exactly_the_public_api():
    assert sorted(mtp.kernels.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(mtp.kernels, name).__name__ == name


def test_no_module_is_shadowed_by_a_public_name():
    """A submodule named like an exported function would be hidden behind it
    (``mtp.kernels.<name>`` is the function), reachable only through importlib."""
    modules = {m.name for m in pkgutil.iter_modules(mtp.kernels.__path__)}
    assert "dispatch" in modules  # the scan sees the package's modules
    assert not modules & set(PUBLIC)


def test_imports_only_torch_and_triton():
    """Every module of the package imports the standard library, torch, triton or itself."""
    allowed = set(sys.stdlib_module_names) | {"torch", "triton", "mtp"}
    for path in Path(mtp.kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_importable_and_usable_without_triton():
    """With triton unimportable the package imports, the CPU path runs, and asking for the
    Triton kernels names the way out."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # `import triton` now raises ImportError
        import torch
        import mtp.kernels
        from mtp.kernels import linear_cross_entropy, linear_cross_entropy_reference
        hidden = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(20, 8, dtype=torch.float64)
        targets = torch.randint(0, 20, (10,))
        loss = linear_cross_entropy(hidden, weight, targets)
        loss.backward()
        torch.testing.assert_close(loss, linear_cross_entropy_reference(hidden, weight, targets))
        try:
            linear_cross_entropy(hidden, weight, targets, impl="triton")
        except ImportError as exc:
            assert "pip install triton" in str(exc)
        else:
            raise AssertionError("impl='triton' ran without triton")
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
