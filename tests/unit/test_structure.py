"""The package's import direction: lower subpackages never import higher ones; parallel/ and planner/ import no
Lightning or torchmetrics (checked on the source, so a lazy import inside a function counts too)."""

from __future__ import annotations

import ast
import pathlib

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
    """The flat folder is gone: only the package entry and the two ``python -m`` names remain at the top."""
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py", "compat.py", "convert.py", "costmodel.py"]
