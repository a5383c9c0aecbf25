"""The layering of docs/ARCHITECTURE.md, checked on the source: imports only point down.

    cli  ->  serve  ->  engine  ->  runtime  ->  planning  ->  {model, parallel}  ->  attention  ->  kernels  ->  core

Every module of ringctx/ is parsed (never imported) and every import it makes is checked, those
inside functions too: a module may import its own package and the layers below it, never one
above; `model/` and `parallel/` are siblings that do not import each other; `torch.distributed`
is imported only by the code that runs between ranks (BETWEEN_RANKS: never single-device
attention); no modules import each other round a circle. A failure names the module, the line and
the import (a circle: its modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ringctx"

LAYERS = {"core": 0, "kernels": 1, "attention": 2, "model": 3, "parallel": 3, "planning": 4, "runtime": 5, "engine": 6,
          "serve": 7, "cli": 8}
"""Each part's height; a module imports parts of its height or lower, and at its own height only its own part."""

TOP = {"ringctx", "ringctx.__main__"}
"""The package's public face and `python -m ringctx`: they sit above every layer and may import any."""


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The layer a ringctx module belongs to: its subpackage, or core for ringctx/*.py."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "core"


def imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth; `from X import y`
    is importing X.y where X.y is a module (`from ringctx.kernels import cpu`), else importing X."""
    package_root = package
    module = module_name(path, package)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:  # a submodule by its own name, a name by its module's
                sub = f"{source}.{alias.name}"
                found.append((node.lineno, sub if is_module(sub, package_root) else source))
    return list(dict.fromkeys(found))


def is_module(name: str, package: Path = PACKAGE) -> bool:
    """Whether a dotted ringctx name is a module or package of the tree rooted at `package`."""
    if not name.startswith("ringctx."):
        return False
    path = package.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_imports(package: Path = PACKAGE):
    """(file, module, line, imported module) of every import of every module but TOP's."""
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package)
        if module not in TOP:
            for line, target in imports(path, package):
                yield path.relative_to(package.parent), module, line, target


def layering_problems(package: Path = PACKAGE) -> list[str]:
    """One line per import against the layering, e.g. 'ringctx/parallel/mesh.py:20 imports
    ringctx.model.tensor_parallel (parallel may not import model)'."""
    problems = []
    for where, module, line, target in module_imports(package):
        if target in TOP:
            problems.append(f"{where}:{line} imports {target} (the package's public face; import "
                            "the module that defines the name)")
            continue
        if not target.startswith("ringctx."):
            continue
        here, there = part_of(module), part_of(target)
        if there != here and LAYERS[there] >= LAYERS[here]:
            problems.append(f"{where}:{line} imports {target} ({here} may not import {there})")
    return problems


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside `if TYPE_CHECKING:` blocks: imports for annotations only, never run."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the ringctx modules it imports when run (any depth, not under TYPE_CHECKING)."""
    graph = {}
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package)
        if module in TOP:
            continue
        skip = _type_checking_lines(ast.parse(path.read_text()))
        graph[module] = {target for line, target in imports(path, package)
                         if line not in skip and target.startswith("ringctx.") and target not in TOP
                         and target != module and is_module(target, package)}
    return graph


def import_circles(package: Path = PACKAGE) -> list[list[str]]:
    """Every set of modules that import each other round a circle (Tarjan's strongly connected
    components of more than one module), each sorted, e.g. [['ringctx.a', 'ringctx.b']]."""
    graph = import_graph(package)
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def test_no_import_circles():
    circles = import_circles()
    assert not circles, "modules that import each other (a package's __init__ counts):\n" + "\n".join(
        " <-> ".join(circle) for circle in circles)


def test_the_circle_check_finds_one(tmp_path):
    root = tmp_path / "ringctx"
    (root / "model").mkdir(parents=True)
    for name, text in {"__init__.py": "", "model/__init__.py": "from .config import Config\n",
                       "model/config.py": "def f():\n    from .reader import read\n",
                       "model/reader.py": "from ringctx.model import config\n",
                       "model/hints.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .reader import x\n",
                       "model/leaf.py": "from .hints import y\n"}.items():
        (root / name).write_text(text)
    assert import_circles(root) == [["ringctx.model.config", "ringctx.model.reader"]]


BETWEEN_RANKS = {"parallel", "runtime", "engine", "ringctx.model.tensor_parallel", "ringctx.model.expert_parallel",
                 "ringctx.planning.calibrate"}
"""Where torch.distributed may be imported: the packages that run between ranks (communication,
what every rank runs, the engine that starts and drives the ranks), the tensor-parallel model's
collectives, and calibration's measurement jobs. Anything else asks one of these."""


def distributed_problems(package: Path = PACKAGE) -> list[str]:
    """One line per torch.distributed import outside BETWEEN_RANKS (single-device attention among them)."""
    return [f"{where}:{line} imports {target} (only {', '.join(sorted(BETWEEN_RANKS))} talk between ranks)"
            for where, module, line, target in module_imports(package)
            if (target == "torch.distributed" or target.startswith("torch.distributed."))
            and module not in BETWEEN_RANKS and part_of(module) not in BETWEEN_RANKS]


def test_torch_distributed_only_where_ranks_talk():
    problems = distributed_problems()
    assert not problems, "\n".join(problems)


def test_imports_only_point_down():
    problems = layering_problems()
    assert not problems, "imports against the layering of docs/ARCHITECTURE.md:\n" + "\n".join(problems)


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The walker itself: a lower layer's upward import, relative and inside a function, is found;
    the same import in a higher layer is not a problem."""
    root = tmp_path / "ringctx"
    for part in ("model", "parallel", "engine", "attention"):
        (root / part).mkdir(parents=True)
        (root / part / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "model" / "bad.py").write_text("def f():\n    from ..engine import api\n")
    (root / "model" / "sideways.py").write_text("from ringctx.parallel import comm\n")
    (root / "engine" / "api.py").write_text("from ..model import bad\n")
    (root / "parallel" / "comm.py").write_text("")
    (root / "attention" / "dist.py").write_text("import torch.distributed as dist\n")
    found = layering_problems(root)
    assert any(p.startswith("ringctx/model/bad.py:2 imports ringctx.engine") for p in found), found
    assert any(p.startswith("ringctx/model/sideways.py:1 imports ringctx.parallel") for p in found), found
    assert any("attention/dist.py:1 imports torch.distributed" in p for p in distributed_problems(root)), found
    assert not any(p.startswith("ringctx/engine/") for p in found), found


@pytest.mark.parametrize("part", sorted(LAYERS))
def test_every_part_exists(part):
    """The layers named here are the packages there are (a renamed package must be named here)."""
    assert part == "core" or (PACKAGE / part / "__init__.py").is_file()


def test_the_ranks_half_never_imports_rank_zeros_api(tmp_path):
    """runtime/ (what every rank runs) sits below engine/ (rank 0's API over it): an import of the
    API from the ranks' half is found, the other way round is not a problem."""
    root = tmp_path / "ringctx"
    for part in ("runtime", "engine"):
        (root / part).mkdir(parents=True)
        (root / part / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "runtime" / "commands.py").write_text("from ..engine.api import Engine\n")
    (root / "runtime" / "batch.py").write_text("def f():\n    import ringctx.engine.handles\n")
    (root / "engine" / "handles.py").write_text("")
    (root / "engine" / "api.py").write_text("from ..runtime import commands\nfrom . import handles\n")
    found = layering_problems(root)
    assert any(p.startswith("ringctx/runtime/commands.py:1 imports ringctx.engine.api") for p in found), found
    assert any(p.startswith("ringctx/runtime/batch.py:2 imports ringctx.engine.handles") for p in found), found
    assert not any(p.startswith("ringctx/engine/") for p in found), found
