"""Layers point one way: ``zcompile`` (front end) -> ``passes`` (graph rewrites, vocabulary) -> ``kernels``.

Read from the source (every import statement, function-local ones included), so an import that
runs back up fails here rather than as a circular import later. Also checked in a fresh
interpreter: importing the passes loads no front-end module, no optimizer and no Triton.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parent.parent
# what each installed package may import from zcompile (itself included)
ALLOWED = {
    "passes": ("zcompile.passes", "zcompile.kernels"),
    "kernels": ("zcompile.kernels",),
}
PACKAGE_OF_FOLDER = {"passes": "zcompile.passes", "kernels": "zcompile.kernels"}


def _imported_modules(path: Path, package: str, run_only: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (``run_only``: but those under
    ``if TYPE_CHECKING:``); ``from X import y`` gives ``X.y``, since ``y`` may be a module
    (``from zcompile import optim``)."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_only(tree) if run_only else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package the file is installed in
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _violations(folder: str) -> list[str]:
    allowed = ALLOWED[folder]
    bad = []
    for path in sorted((REPO / folder).glob("*.py")):
        for line, module in _imported_modules(path, PACKAGE_OF_FOLDER[folder]):
            if module.split(".")[0] != "zcompile":
                continue
            if not any(module == a or module.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_down(folder):
    assert _violations(folder) == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check itself can fail: an upward import, absolute or relative, is found."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from zcompile.common.process_group import DataParallelGroup\n"
        "def f():\n    from .. import reports\n    import zcompile.optim\n"
    )
    modules = [m for _, m in _imported_modules(bad, "zcompile.passes")]
    assert modules == ["zcompile.common.process_group.DataParallelGroup", "zcompile.reports", "zcompile.optim"]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:``: those imports never run."""
    return {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }


def _import_graph(root: Path) -> nx.DiGraph:
    """Module -> the zcompile modules it imports (function-local imports included, ``TYPE_CHECKING`` ones
    not), plus the packages whose ``__init__`` such an import runs on the way."""
    files = {_module_name(path, root): path for path in root.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in files.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for line, imported in _imported_modules(path, package, run_only=True):
            while imported and imported not in files:  # ``from m import name``: m
                imported = imported.rpartition(".")[0]
            while imported and imported != "zcompile":  # the module, and every package above it
                if imported != name and not name.startswith(imported + "."):
                    graph.add_edge(name, imported, line=line)
                imported = imported.rpartition(".")[0]
    return graph


def _circles(root: Path) -> list[str]:
    graph = _import_graph(root)
    found = []
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            cycle = nx.find_cycle(graph.subgraph(component))
            found.append(
                " -> ".join(f"{a} (line {graph.edges[a, b]['line']})" for a, b in cycle) + f" -> {cycle[0][0]}"
            )
    return found


def test_no_import_circle_inside_zcompile():
    """Imports inside ``zcompile/`` form no circle, function-local ones included: a circle works only
    for the import order that happens to run first, and hides which module is the lower one."""
    assert _circles(REPO / "zcompile") == []


def test_the_circle_check_sees_a_circle(tmp_path):
    """The check itself can fail: a function-local import that closes a circle through a package's
    ``__init__`` is found; one under ``TYPE_CHECKING`` is not."""
    package = tmp_path / "zcompile"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("from zcompile.a.low import thing\n")
    (package / "a" / "low.py").write_text("def thing():\n    from zcompile.high import other\n")
    (package / "high.py").write_text("from zcompile.a.low import thing\nother = thing\n")
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zcompile.high import other\n"
    )
    circles = _circles(package)
    assert len(circles) == 1 and "zcompile.high" in circles[0] and "zcompile.a.low" in circles[0], circles
    assert "typed" not in circles[0]


def _run_fresh(code: str) -> str:
    """``code`` run in a fresh interpreter (nothing of this process imported); its stdout."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_passes_loads_no_front_end_and_no_triton():
    passes = [
        p.stem for p in (REPO / "passes").glob("*.py") if p.stem != "__init__" and not p.stem.startswith("quantize_")
    ]  # qwZ/qgZ need the kernels
    code = (
        "import sys\n"
        + "".join(f"import zcompile.passes.{name}\n" for name in passes)
        + "loaded = sorted(m for m in sys.modules if m.startswith('zcompile'))\n"
        + "below = ('zcompile.passes', 'zcompile.kernels')\n"
        + "root = ('zcompile', 'zcompile.common', 'zcompile.common.lazy')  # the package and its lazy names\n"
        + "front = [m for m in loaded if m not in root and not m.startswith(below)]\n"
        + "print(front, 'triton' in sys.modules, 'matplotlib' in sys.modules)\n"
    )
    assert _run_fresh(code).strip() == "[] False False"


def test_public_names_load_on_first_use():
    code = (
        "import sys, zcompile\n"
        "before = 'zcompile.optim' in sys.modules or 'triton' in sys.modules\n"
        "names = [zcompile.optim.AdamW, zcompile.ZeroConfig, zcompile.gathered, zcompile.step_report,\n"
        "         zcompile.PassError, zcompile.model_state_bytes, zcompile.zero_formula_bytes]\n"
        "print(before, 'zcompile.optim' in sys.modules, set(zcompile.__all__) <= set(dir(zcompile)))\n"
    )
    assert _run_fresh(code).split() == ["False", "True", "True"]


def test_public_names_survive_importing_every_submodule_first():
    """Importing a submodule binds it on the package under its own name, so a public function whose
    module had its name (``zcompile.gathered`` in ``zcompile/gathered.py``) became that module for
    anyone who imported the module first (``zcompile.gathered(model)``: "'module' object is not
    callable"). Each public name is checked to be its module's object after every submodule loaded."""
    code = (
        "import importlib, pkgutil, zcompile\n"
        "for info in pkgutil.iter_modules(zcompile.__path__):\n"
        "    importlib.import_module('zcompile.' + info.name)\n"
        'def defined(name, module):  # the submodule itself (""), or the name in its module\n'
        "    if not module:\n"
        "        return importlib.import_module('zcompile.' + name)\n"
        "    return getattr(importlib.import_module(module), name)\n"
        "lazy = zcompile._LAZY.items()\n"
        "print([name for name, module in lazy if getattr(zcompile, name) is not defined(name, module)])\n"
    )
    assert _run_fresh(code).strip() == "[]"


def test_zcompile_imports_and_trains_where_triton_is_not_installed():
    """Triton is optional (the ``kernels`` extra; torch's CPU wheels do not bring it): the kernel
    modules fall back to their references. ``fused_optim`` and ``quantize`` imported a Triton-only
    helper outside their ``triton_available()`` block, so ``import zcompile.optim`` (and so
    ``ZeroTrainer``, after ``pip install -e '.[hf]'``) stopped in an ImportError. With triton hidden,
    every kernel module imports and a stage-3 step trains like ``torch.optim.AdamW``."""
    kernels = [p.stem for p in (REPO / "kernels").glob("*.py") if p.stem != "__init__"]
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # import triton raises ImportError, as where it is not installed\n"
        + "".join(f"import zcompile.kernels.{name}\n" for name in kernels if name != "cross_entropy_triton")
        + "import torch, zcompile\n"
        "def run(zero):\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))\n"
        "    optimizer = (zcompile.optim.AdamW if zero else torch.optim.AdamW)(model.parameters(), lr=1e-2)\n"
        "    if zero:\n"
        "        model = torch.compile(model, backend='zero', options={'stage': 3})\n"
        "    x, losses = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), []\n"
        "    for _ in range(3):\n"
        "        loss = model(x).square().mean(); loss.backward(); optimizer.step(); optimizer.zero_grad()\n"
        "        losses.append(loss.item())\n"
        "    return losses\n"
        "zero, plain = run(True), run(False)\n"
        "print(max(abs(a - b) for a, b in zip(zero, plain)) <= 1e-6 * max(map(abs, plain)), zero[-1] < zero[0])\n"
    )
    assert _run_fresh(code).strip() == "True True"
