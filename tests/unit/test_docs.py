"""The documentation against the code (issue 43): argument lists, the strategy config, styles, links, length.

An argument list is a ``python`` block of README.md or docs/*.md that opens with ``DPMPStrategy(`` or
``FabricDPMPStrategy(`` alone on its line and names one argument per line (``name=default,`` or ``**name,``; lines
that start with ``#`` continue a comment). Each must name the constructor's arguments, in order, so that an
argument added without its line fails here.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_dpmp import DPMPStrategy, FabricDPMPStrategy
from lightning_dpmp.planner.styles import STYLES

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLASSES: dict[str, Any] = {"DPMPStrategy": DPMPStrategy, "FabricDPMPStrategy": FabricDPMPStrategy}
BLOCK = re.compile(r"^```python\n(DPMPStrategy|FabricDPMPStrategy)\(\n(.*?)^\)\n```", flags=re.M | re.S)
ARG = re.compile(r"^\s+(\*\*\w+|\w+)\s*[=,]")


def signature_names(cls: Any) -> list[str]:
    """The constructor's parameters as a call writes them: ``name`` or ``**name``."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self
    return [f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name for p in params]


def documented_lists() -> list[tuple[str, str, list[str]]]:
    """(file, class name, argument names) for every argument list in README.md and docs/*.md."""
    out = []
    for path in DOCS:
        for name, body in BLOCK.findall(path.read_text()):
            lines = [line for line in body.splitlines() if not line.strip().startswith("#")]
            out.append((path.name, name, [m.group(1) for line in lines if (m := ARG.match(line))]))
    return out


def test_the_reference_lists_both_strategies_arguments() -> None:
    found = {(doc, name) for doc, name, _ in documented_lists()}
    assert {("reference.md", "DPMPStrategy"), ("reference.md", "FabricDPMPStrategy")} <= found, found


@pytest.mark.parametrize("doc, name, listed", documented_lists(), ids=lambda v: v if isinstance(v, str) else "")
def test_an_argument_list_names_every_argument_in_order(doc: str, name: str, listed: list[str]) -> None:
    expected = signature_names(CLASSES[name])
    assert listed == expected, {
        "file": doc, "class": name, "undocumented": [a for a in expected if a not in listed],
        "not an argument": [a for a in listed if a not in expected], "listed": listed,
    }


def test_the_parser_sees_a_missing_argument() -> None:
    """An argument list that lost a line (or a signature that gained one) fails the comparison above."""
    text = (ROOT / "docs" / "reference.md").read_text()
    body = dict((n, b) for n, b in BLOCK.findall(text))["DPMPStrategy"]
    cut = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("pp_stages_per_rank="))
    listed = [m.group(1) for line in cut.splitlines() if (m := ARG.match(line))]
    assert "pp_stages_per_rank" in signature_names(DPMPStrategy) and "pp_stages_per_rank" not in listed


def strategy_yaml() -> tuple[dict[str, Any], list[str]]:
    path = ROOT / "conf" / "strategy" / "dpmp.yaml"
    return yaml.safe_load(path.read_text()), path.read_text().splitlines()


def test_strategy_config_keys_are_strategy_arguments_each_with_a_comment() -> None:
    """conf/strategy/dpmp.yaml and its schema (``StrategyConfig``) hold only ``DPMPStrategy`` arguments; ``ddp`` is
    ``**ddp_kwargs`` (examples/training.py unpacks it). Every argument key has a comment line above it."""
    from dataclasses import fields

    from examples.config import StrategyConfig

    args = set(signature_names(DPMPStrategy)) | {"ddp"}
    conf, lines = strategy_yaml()
    keys = set(conf) - {"_target_", "defaults"}
    assert keys <= args, sorted(keys - args)
    assert {f.name for f in fields(StrategyConfig)} - {"_target_"} <= args
    for i, line in enumerate(lines):
        key = line.split(":")[0]
        if key in keys:
            above = next(prev for prev in reversed(lines[:i]) if not prev.startswith("  "))
            assert above.startswith("#"), f"conf/strategy/dpmp.yaml: `{key}` has no comment above it"


def test_strategy_config_names_every_style() -> None:
    _, lines = strategy_yaml()
    comment = " ".join(line for line in lines if line.startswith("#"))
    assert [s for s in STYLES if f'"{s}"' not in comment] == [], "conf/strategy/dpmp.yaml's plan_overrides comment"


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_and_anchor_resolves() -> None:
    bad = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", dest.read_text(), flags=re.S), re.M)
                if anchor not in {slug(h) for h in headings}:
                    bad.append(f"{path.name}: {target} (no such heading)")
    assert not bad, bad


def test_readme_quick_start_is_two_commands() -> None:
    """The README's length and its pointers to docs/ are tests/unit/test_structure.py's."""
    quick = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [line for block in re.findall(r"```bash\n(.*?)```", quick, flags=re.S) for line in block.splitlines()]
    assert len(commands) == 2, commands
