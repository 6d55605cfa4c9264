"""The project's layout: no import cycle, modules of a readable size, layers that import only
what DESIGN lets them. The import graph is read from the source, every import counted (those
inside functions too), so a cycle hidden behind a lazy import is still one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Where each installed package's source lies (`[tool.setuptools] package-dir`).
PACKAGES = {"mtp": ROOT / "mtp", "mtp.kernels": ROOT / "kernels", "mtp.eval": ROOT / "eval"}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    mods = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([package, *parts])] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules `name` imports: `import a.b`, `from a import b` (module b, or else
    the package a), relative imports resolved."""
    out = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                out |= {sub} if sub in mods else ({base} if base in mods else set())
    return out - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while comp[-1:] != [v]:
                comp.append(stack.pop())
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_behind_a_lazy_import(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    mods = {m: tmp_path / f"{m}.py" for m in "abc"}
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_among_the_projects_modules():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert len(graph) > 40 and graph["mtp.bench.decode"] >= {"mtp.decode_cli", "mtp.decoding"}
    assert _cycles(graph) == []


@pytest.mark.parametrize("package", ["mtp.kernels", "mtp.eval"])
def test_lower_layers_do_not_import_lightning(package):
    """kernels/ needs torch and Triton only; eval/ never Lightning (DESIGN's table)."""
    for name, path in _modules().items():
        if name.startswith(package):
            tree = ast.parse(path.read_text())
            names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            banned = {n for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")}
            assert not banned, (name, banned)


def test_no_module_over_600_lines():
    files = [*_modules().values(), *sorted((ROOT / "experiments").glob("*.py")),
             *sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "tests").glob("*.py"))]
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert len(files) > 60 and long == {}


def test_the_package_exports_its_public_contract_lazily():
    """`import mtp` names the contract of DESIGN.md and loads none of it until used."""
    import subprocess
    import sys

    code = ("import sys, mtp\n"
            "assert 'torch' not in sys.modules\n"
            "assert mtp.MTPTransformer.__module__ == 'mtp.model'\n"
            "assert mtp.generate.__module__ == 'mtp.decoding'\n"
            "print(sorted(mtp.__all__))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    names = ast.literal_eval(proc.stdout.strip())
    for name in ("ModelConfig", "MTPTransformer", "linear_cross_entropy", "generate",
                 "pass_at_k", "naive_mtp_loss", "sequential_mtp_loss", "mtp_inputs_targets"):
        assert name in names
    import mtp

    for name in mtp.__all__:
        assert getattr(mtp, name) is not None
    assert "Multi-token" in mtp.__doc__ or "multi-token" in mtp.__doc__
