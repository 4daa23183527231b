"""Every ``>>>`` example in the package runs and shows what it says (``doctest`` over every module).

Examples that need a multi-process launch (an MP or DP group of more than one rank, a ``Trainer`` with several
devices) are marked ``# doctest: +SKIP``; everything else runs here, in one process. Examples may use ``grid``,
as the strategy's ``trainer.strategy.grid``: here the one-process grid (dp = mp = 1, groups ``None``, under which
every collective of :mod:`lightning_dpmp.parallel.comm` is the identity).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import lightning_dpmp
from lightning_dpmp.parallel.grid import Grid
from lightning_dpmp.parallel.topology import Topology

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(lightning_dpmp.__path__, prefix=f"{lightning_dpmp.__name__}.")
) + [lightning_dpmp.__name__]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Examples that ran (skipped ones do not count) when this file was written; fewer means examples were lost or
# skipped wholesale, e.g. a module that no longer imports its own names.
MIN_EXAMPLES = 105


def _run(name: str) -> tuple[doctest.TestResults, str]:
    module = importlib.import_module(name)
    out: list[str] = []
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in finder.find(module, name, globs={**vars(module), "grid": Grid(Topology(), rank=0)}):
        runner.run(test, out=out.append)
    return runner.summarize(verbose=False), "".join(out)


@pytest.mark.parametrize("name", MODULES)
def test_module_examples(name: str) -> None:
    results, report = _run(name)
    assert results.failed == 0, f"{name}: {results.failed} of {results.attempted} examples failed\n{report}"


def test_examples_are_counted() -> None:
    """Guards the guard: the walk finds every subpackage and the examples actually run."""
    expected = {"lightning_dpmp.parallel.layers", "lightning_dpmp.planner.flow", "lightning_dpmp.tools.costmodel"}
    assert expected <= set(MODULES)
    ran = sum(_run(name)[0].attempted for name in MODULES)
    assert ran >= MIN_EXAMPLES, f"only {ran} doctest examples ran (expected at least {MIN_EXAMPLES})"
