"""The project's layout against its map, docs/architecture.md: every import of mtp, kernels and
eval within what the page's stage table allows, no import cycle anywhere in the tree
(experiments and scripts included), every hop of the page's training step and decode round a
real `file:function`, modules of a readable size. The import graph is read from the source,
every import counted (those inside functions too), so a cycle hidden behind a lazy import is
still one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: Where each installed package's source lies (`[tool.setuptools] package-dir`).
PACKAGES = {"mtp": ROOT / "mtp", "mtp.kernels": ROOT / "kernels", "mtp.eval": ROOT / "eval"}
#: The rest of the tree: the studies (a package) and the scripts (which import one another by
#: their bare names, run from their folder).
TREE = {**PACKAGES, "experiments": ROOT / "experiments", "": ROOT / "scripts"}
MAX_LINES = 600


def _modules(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    mods = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            if "reports" in path.relative_to(folder).parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([p for p in (package, *parts) if p])] = path
    return mods


def _from_base(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module of `from ... import` in module `name`, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    up = package[: len(package) - (node.level - 1)]
    return ".".join([*up, *([node.module] if node.module else [])])


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules `name` imports: `import a.b`, `from a import b` (module b, or else
    the package a), relative imports resolved."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(name, path, node)
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


def _private(attr: str) -> bool:
    """A name private to its module: a leading underscore, not a dunder."""
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _private_uses(name: str, path: Path, mods: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Where module `name` reaches into another project module's private names, as
    'file:line: module._name': `from m import _x` (relative too), `import m._x`, and `m._x` or
    `getattr(m, "_x")` on a name bound to a project module by an import."""
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}  # local name -> the project module it is bound to
    found = []

    def hit(node: ast.AST, module: str, attr: str) -> None:
        if module != name:
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno}: {module}.{attr}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                for i in range(1, len(parts)):
                    if ".".join(parts[:i]) in mods and _private(parts[i]):
                        hit(node, ".".join(parts[:i]), parts[i])
                if alias.asname and alias.name in mods:
                    bound[alias.asname] = alias.name
                elif not alias.asname and parts[0] in mods:
                    bound[parts[0]] = parts[0]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(name, path, node)
            if base not in mods:
                continue
            for alias in node.names:
                if _private(alias.name):
                    hit(node, base, alias.name)
                elif f"{base}.{alias.name}" in mods:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"

    def module_of(expr: ast.expr) -> str | None:
        """The project module an expression such as `mtp.eval.sandbox` names, if any."""
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            outer = module_of(expr.value)
            if outer and f"{outer}.{expr.attr}" in mods:
                return f"{outer}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if (module := module_of(node.value)) is not None:
                hit(node, module, node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            if (module := module_of(node.args[0])) is not None:
                hit(node, module, node.args[1].value)
    return [h for _, h in sorted(found)]


def test_the_cycle_finder_finds_a_cycle_behind_a_lazy_import(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    mods = {m: tmp_path / f"{m}.py" for m in "abc"}
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_anywhere_in_the_tree():
    mods = _modules(TREE)
    assert {"experiments.budget", "experiments.host_costs", "hostile_sweep"} <= mods.keys()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert len(graph) > 40
    assert graph["mtp.bench.decode"] >= {"mtp.decoding.cli", "mtp.decoding.generation"}
    assert _cycles(graph) == []


def test_the_private_name_finder_finds_each_form(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("from .a import _y\n")
    (tmp_path / "p" / "a.py").write_text("_x = _y = 1\n__version__ = 1\n")
    (tmp_path / "p" / "b.py").write_text(
        "from . import a\n"
        "from .a import __version__, _x\n"                  # line 2: _x, not the dunder
        "from p.a import _x as y\n"                         # line 3
        "import p.a as pa\n"
        "import p\n"
        "import os\n"
        "def f():\n"
        "    return a._x, pa._x, p.a._x, getattr(a, '_x'), os._exit, a.public, _x\n"  # line 8
        "class C:\n"
        "    _z = 1\n"
        "    def g(self):\n"
        "        return self._z\n")
    mods = {"p": tmp_path / "p" / "__init__.py", "p.a": tmp_path / "p" / "a.py",
            "p.b": tmp_path / "p" / "b.py"}
    assert _private_uses("p.b", mods["p.b"], mods, tmp_path) == [
        "p/b.py:2: p.a._x", "p/b.py:3: p.a._x", *["p/b.py:8: p.a._x"] * 4]
    assert _private_uses("p", mods["p"], mods, tmp_path) == ["p/__init__.py:1: p.a._y"]
    assert _private_uses("p.a", mods["p.a"], mods, tmp_path) == []


def test_no_module_imports_another_modules_private_name():
    """STYLE 17: a module's `_private` names are its own; another module of mtp, kernels or
    eval reaches them neither by `from m import _x` nor by `m._x`."""
    mods = _modules()
    found = [h for m, p in mods.items() for h in _private_uses(m, p, mods)]
    assert not found, "private names used outside their module:\n  " + "\n  ".join(found)


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


#: Modules that worker processes import (ranks, tokenisers, benchmarks) or that run without a
#: Trainer: importing them must not load Lightning, whose import takes seconds per process.
WITHOUT_LIGHTNING = ["mtp.data", "mtp.data.corpus", "mtp.data.bpe", "mtp.data.shards",
                     "mtp.data.encoder_pool", "mtp.train.parallel", "mtp.train.loss",
                     "mtp.train.targets", "mtp.train.frozen_trunk", "mtp.model.checkpoint",
                     "mtp.bench.loss", "mtp.bench.tokenize", "mtp.decoding.generation",
                     "mtp.interop.distill", "mtp.eval.harness"]


def test_only_the_trainer_side_loads_lightning():
    """Each module of WITHOUT_LIGHTNING imports without Lightning; `mtp.data`'s DataModule, asked
    for by name, loads it (so the check itself can see Lightning arrive)."""
    import subprocess
    import sys

    code = ("import importlib, sys\n"
            f"for name in {WITHOUT_LIGHTNING!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert 'lightning' not in sys.modules, name\n"
            "import mtp.data\n"
            "mtp.data.MTPDataModule\n"
            "assert 'lightning' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_no_module_over_600_lines():
    files = [*_modules().values(), *sorted((ROOT / "experiments").glob("*.py")),
             *sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert len(files) > 60 and long == {}


def test_the_package_exports_its_public_contract_lazily():
    """`import mtp` names the contract of DESIGN.md and loads none of it until used."""
    import subprocess
    import sys

    code = ("import sys, mtp\n"
            "assert 'torch' not in sys.modules\n"
            "assert set(dir(mtp)) >= set(mtp.__all__)  # listed before first use\n"
            "assert mtp.MTPTransformer.__module__ == 'mtp.model.transformer'\n"
            "assert mtp.generate.__module__ == 'mtp.decoding.generation'\n"
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
    with pytest.raises(AttributeError, match="'not_exported'"):
        mtp.not_exported


def test_the_repositorys_kernels_folder_does_not_shadow_hugging_faces_kernels():
    """transformers imports the Hugging Face `kernels` package where it is installed; the
    repository's `kernels/` folder (installed as `mtp.kernels`) must not stand in its place."""
    kernels = pytest.importorskip("kernels")
    assert Path(kernels.__file__).resolve().parent != ROOT / "kernels", kernels.__file__


def _stage_table() -> dict[str, tuple[list[str], set[str]]]:
    """docs/architecture.md's stage table: stage -> (its modules' name prefixes, the stages it
    may import)."""
    folder_prefix = {"kernels/": "mtp.kernels", "eval/": "mtp.eval"}
    table = {}
    for row in ARCHITECTURE.read_text().split("## Stages and folders")[1].split("\n\n")[1] \
            .splitlines()[2:]:
        stage, folders, _, may = (c.strip() for c in row.strip("|").split("|"))
        prefixes = []
        for folder in re.findall(r"`([^`]+)`", folders):
            if folder.startswith("mtp."):
                continue  # the installed name beside a top-level folder
            name = folder_prefix.get(folder) or folder.removesuffix("/").removesuffix(".py") \
                .removesuffix("/__init__").replace("/", ".")
            prefixes.append(name)
        allowed = set() if may.startswith("nothing") else {a.strip() for a in may.split(",")}
        table[stage] = (prefixes, allowed)
    return table


def _stage_of(module: str, table: dict) -> str:
    """The stage whose prefix matches `module` most closely."""
    best = max(((len(p), stage) for stage, (prefixes, _) in table.items() for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} belongs to no stage of docs/architecture.md"
    return best[1]


def test_every_import_is_one_the_architecture_page_allows():
    table = _stage_table()
    assert {"model", "train", "decoding", "interop", "eval", "kernels"} <= table.keys()
    assert table["kernels"] == (["mtp.kernels"], set())
    mods = _modules()
    bad = []
    for name, path in mods.items():
        stage = _stage_of(name, table)
        allowed = table[stage][1]
        for dep in sorted(_imports(name, path, mods)):
            other = _stage_of(dep, table)
            if other != stage and "every stage" not in allowed and other not in allowed:
                bad.append(f"{path.relative_to(ROOT)} ({stage}) imports {dep} ({other})")
    assert not bad, "imports the stage table does not allow:\n  " + "\n  ".join(bad)


def _defines(path: Path, qualname: str) -> bool:
    """Whether the module at `path` defines `qualname` (a function, class or method)."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return False
        scope = node.body
    return True


def test_every_hop_of_the_architecture_pages_paths_is_real():
    """The training step and the decode round of docs/architecture.md name real functions."""
    page = ARCHITECTURE.read_text()
    for section in ("## A training step, hop by hop", "## A decode round, hop by hop"):
        text = page.split(section)[1].split("\n## ")[0]
        hops = re.findall(r"`([\w/]+\.py):([\w.]+)`", text)
        assert len(hops) >= 8, section
        missing = [f"{f}:{q}" for f, q in hops if not (ROOT / f).is_file()
                   or not _defines(ROOT / f, q)]
        assert not missing, f"{section}: no such function: {missing}"
    assert not _defines(ROOT / "mtp/train/loss.py", "no_such_path")


def test_the_heads_loss_has_one_home():
    """Every way of computing the heads' loss is a path of `mtp.train.loss` (chosen from its
    table); no other module defines a loss function of its own."""
    from mtp.train.loss import PATHS

    assert set(PATHS) == {"naive", "sequential", "frozen_trunk", "frozen_trunk_soft", "metrics"}
    elsewhere = []
    for name, path in _modules().items():
        if name in ("mtp.train.loss", "mtp.loss") or name.startswith("mtp.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and re.fullmatch(r"_?\w*heads?_loss|\w*mtp_loss"
                                                                  r"|compute_loss|_?heads_metrics",
                                                                  node.name):
                elsewhere.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert not elsewhere, elsewhere


def test_every_package_of_the_tree_is_one_a_wheel_installs():
    """A folder with an `__init__.py` missing from `[tool.setuptools] packages` is left out of a
    wheel (an editable install still finds it, so nothing else here would notice)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join([p for p in (package, *init.relative_to(folder).parent.parts) if p])
             for package, folder in PACKAGES.items() for init in folder.rglob("__init__.py")}
    assert found - listed == set(), "add them to pyproject.toml's packages"
    assert listed - found == set()
