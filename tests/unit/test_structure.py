"""The package's import direction: lower subpackages never import higher ones; parallel/ and planner/ import no
Lightning or torchmetrics (checked on the source, so a lazy import inside a function counts too)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "lightning_dpmp"
ORDER = ["parallel", "planner", "checkpoint", "integration", "tools"]
THIRD_PARTY_BANNED = {"parallel": {"lightning", "pytorch_lightning", "torchmetrics", "hydra"},
                      "planner": {"lightning", "pytorch_lightning", "torchmetrics", "hydra"}}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            if node.module == "lightning_dpmp":
                out.update(f"lightning_dpmp.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("sub", ORDER)
def test_import_direction(sub: str) -> None:
    higher = ORDER[ORDER.index(sub) + 1:]
    bad = []
    for path in sorted((PKG / sub).glob("*.py")):
        for mod in _imports(path):
            parts = mod.split(".")
            inside = parts[0] == "lightning_dpmp"
            if inside and (len(parts) < 2 or parts[1] in higher or parts[1] not in ORDER + ["compat"]):
                bad.append(f"{path.name} imports {mod}")
            if parts[0] in THIRD_PARTY_BANNED.get(sub, set()):
                bad.append(f"{path.name} imports {mod}")
    assert not bad, f"lightning_dpmp/{sub} breaks the import direction: {bad}"


def test_top_level_is_only_public_names() -> None:
    """The flat folder is gone: only the package entry and the ``python -m`` names remain at the top."""
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py", "compat.py", "convert.py", "costmodel.py",
                                                        "plan.py"]


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_edges() -> dict[str, list[tuple[str, list[str]]]]:
    """Per module of the package: the package modules it imports (any level, ``TYPE_CHECKING`` included) and the
    names it takes from each."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    edges: dict[str, list[tuple[str, list[str]]]] = {}
    for name, path in modules.items():
        out = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
                out.append((node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                out += [(a.name, []) for a in node.names if a.name in modules]
        edges[name] = out
    return edges


def test_no_import_circles() -> None:
    """No module reaches itself through package imports, ``TYPE_CHECKING`` ones included (the package entry, which
    re-exports everything, is left out)."""
    top = "lightning_dpmp"
    graph = {m: {t for t, _ in e if t != top} for m, e in _package_edges().items() if m != top}
    circles = []

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                circles.append(" -> ".join(path + [nxt]))
            elif nxt not in path and nxt > path[0]:  # each circle once, from its smallest module
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    assert not circles, circles


def test_no_private_name_imported_from_another_module() -> None:
    bad = [f"{m} imports {n} from {t}" for m, edges in _package_edges().items() for t, names in edges
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


def test_the_package_table_names_every_module_and_nothing_else() -> None:
    """docs/design.md's package layout lists every module of every folder, and no module that does not exist."""
    text = (PKG.parent / "docs" / "design.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)` \| `(\w+)` \|", text, flags=re.M))
    folders = [p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    actual = {(f.name, m.stem) for f in folders for m in f.glob("*.py") if m.stem != "__init__"}
    assert listed == actual, {"missing": sorted(actual - listed), "not a module": sorted(listed - actual)}


def test_readme_stays_a_short_user_guide() -> None:
    readme = (PKG.parent / "README.md").read_text().splitlines()
    assert len(readme) <= 150, f"README.md has {len(readme)} lines: move depth to docs/ (issue 43: read in 10 min)"
    for doc in ("reference.md", "design.md", "guide.md", "benchmarks.md", "testing.md"):
        assert f"docs/{doc}" in "\n".join(readme), f"README.md does not point to docs/{doc}"


@pytest.mark.parametrize("sub", ORDER)
def test_the_package_docstring_lists_every_module(sub: str) -> None:
    """Each subpackage's docstring has one ``* ``module``: role`` line per module, and none for a module that is not
    there (issue 43: the docstrings left out 36 of 73 modules)."""
    doc = ast.get_docstring(ast.parse((PKG / sub / "__init__.py").read_text())) or ""
    listed = set(re.findall(r"^\* ``(\w+)``: \S", doc, flags=re.M))
    actual = {m.stem for m in (PKG / sub).glob("*.py") if m.stem != "__init__"}
    assert listed == actual, {"missing": sorted(actual - listed), "not a module": sorted(listed - actual)}


_EXTERNAL = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torchmetrics")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_attributes_of_their_objects() -> set[str]:
    """The private attribute names of the torch and Lightning objects the package handles (a module, a tensor, an
    optimizer, a LightningModule, a DDP strategy, a Trainer): read on any of them, they are a private touch."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    objects = [torch.nn.Linear(1, 1), torch.zeros(1), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
               pl.LightningModule(), DDPStrategy(), pl.Trainer(logger=False, enable_progress_bar=False,
                                                               enable_model_summary=False, enable_checkpointing=False)]
    names = {n for obj in objects for n in dir(obj) if _private(n)}
    return names | {n for obj in objects if hasattr(obj, "__dict__") for n in vars(obj) if _private(n)}


def _private_touches(path: pathlib.Path, known: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    external: set[str] = set()  # local names bound to torch / Lightning modules or objects
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] in _EXTERNAL:
                for alias in node.names:
                    external.add(alias.asname or alias.name)
                    if any(_private(p) for p in parts + [alias.name]):
                        out.append(f"{path.name}:{node.lineno} from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in _EXTERNAL:
                    external.add(alias.asname or parts[0])
                    if any(_private(p) for p in parts):
                        out.append(f"{path.name}:{node.lineno} import {alias.name}")
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def enclosing_function(node: ast.AST) -> str:
        while id(node) in parents:
            node = parents[id(node)]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node.name
        return ""

    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)  # getattr(obj, "_name") and friends
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in known):
            out.append(f"{path.name}:{node.lineno} {ast.unparse(node)[:80]}")
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Call) and isinstance(root.func, ast.Name) and root.func.id == "super":
            # an override calling the method it overrides (``super()._configure_launcher()`` in
            # ``_configure_launcher``): the hook itself is checked in test_compat.py
            if enclosing_function(node) != node.attr:
                out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(root, ast.Name) and root.id in external:
            out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        elif node.attr in known and not (isinstance(root, ast.Name) and root.id in ("self", "cls")):
            out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return sorted(set(out))


def test_private_torch_and_lightning_names_go_through_compat() -> None:
    """Every private name of torch or Lightning the package touches is in ``compat.py`` (one named function each,
    tested against the pinned versions in test_compat.py): an import of a private module or name, a private
    attribute of an imported torch/Lightning name (``torch.ops.aten._x``, ``nn.Module._apply``), or a private
    attribute of a torch/Lightning object read on something other than ``self`` (``module._parameters``)."""
    known = _private_attributes_of_their_objects()
    bad = [t for p in sorted(PKG.rglob("*.py")) if p.name != "compat.py" for t in _private_touches(p, known)]
    assert not bad, f"private torch/Lightning names outside lightning_dpmp/compat.py (add a compat function): {bad}"


def _reach(start: str) -> set[str]:
    """The package modules ``start`` imports, directly or through others."""
    graph = {m: {t for t, _ in e} for m, e in _package_edges().items()}
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_pipeline_and_zero_know_nothing_of_each_other() -> None:
    """Stages are cut first and sharded over DP after: the ZeRO engine reaches no pipeline module, and the
    pipeline reaches no ZeRO module, nor names the engine's buckets; ``integration.staged_zero`` alone holds both
    (the pipeline calls it through its ``DPShards`` protocol)."""
    zero = {"lightning_dpmp.parallel.zero_engine", "lightning_dpmp.parallel.zero_shard",
            "lightning_dpmp.parallel.zero_grads", "lightning_dpmp.integration.zero",
            "lightning_dpmp.integration.staged_zero"}
    stages = {"lightning_dpmp.parallel.stage_runner", "lightning_dpmp.parallel.staged_grads",
              "lightning_dpmp.integration.pipeline", "lightning_dpmp.planner.stages",
              "lightning_dpmp.integration.staged_zero"}
    assert not _reach("lightning_dpmp.parallel.zero_engine") & stages
    assert not _reach("lightning_dpmp.integration.zero") & stages
    assert not _reach("lightning_dpmp.integration.pipeline") & zero
    tree = ast.parse((PKG / "integration" / "pipeline.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
        a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    assert not [n for n in names if "engine" in n.lower() or "bucket" in n.lower()]
