"""One pooled launch per (dp, pp, mp) layout, and the one-process references of the specs those launches train.

The fixtures of the pipeline tests (tests/distributed/test_pipeline.py, test_pipeline_eval.py, test_zero_reshard.py)
are built from these: a layout is launched the first time a test asks for it, and every later test of the module
reads the same results.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from tests.conftest import failure_text, run_ranks
from tests.support.reference import LOGGED, reference_run

#: (dp, pp, mp)
Layout = tuple[int, int, int]


def layout_launches(
    tmp_path_factory: pytest.TempPathFactory,
    worker: str,
    prefix: str,
    timeout: float,
    specs: Mapping[Layout, Sequence[str]] | None = None,
    mode: Sequence[str] = (),
    results: str = "rank{rank}.json",
) -> Callable[[Layout], tuple[Path, list[dict]]]:
    """A getter ``layout -> (out dir, [each rank's results])`` that runs ``worker [*mode] DP PP MP OUT [SPECS]``
    once per layout on ``dp * pp * mp`` pool ranks (:func:`tests.conftest.run_ranks`), the first time that layout
    is asked for.

    ``OUT`` is a new folder ``<prefix>_<dp><pp><mp>``; ``SPECS`` (only with ``specs``) is ``specs[layout]`` joined
    by commas. A non-zero exit fails the test with the ranks' stderr; otherwise each rank's results are read from
    ``OUT/results`` (``{rank}`` filled in) in rank order.
    """
    done: dict[Layout, tuple[Path, list[dict]]] = {}

    def get(layout: Layout) -> tuple[Path, list[dict]]:
        if layout not in done:
            dp, pp, mp = layout
            world = dp * pp * mp
            out = tmp_path_factory.mktemp(f"{prefix}_{dp}{pp}{mp}")
            args = [worker, *mode, str(dp), str(pp), str(mp), str(out)]
            if specs is not None:
                args.append(",".join(specs[layout]))
            proc = run_ranks(world, args, timeout=timeout)
            assert proc.returncode == 0, failure_text(proc.stderr)
            done[layout] = out, [json.loads((out / results.format(rank=r)).read_text()) for r in range(world)]
        return done[layout]

    return get


def spec_tag(spec: str) -> str:
    """What ``pipeline_worker.py`` names a float64 run of ``spec``: the stem of its checkpoint and its key in each
    rank's results."""
    return f"{spec.replace(':', '_')}_64"


def spec_references(tmp_path_factory: pytest.TempPathFactory,
                    prefix: str) -> Callable[[str], tuple[dict, dict[int, float]]]:
    """A getter ``spec -> (checkpoint, {global step: logged train_loss})`` of one float64 process training the
    spec's model (its first field) on the same global batches (:func:`tests.support.reference.reference_run`),
    with ``accumulate_grad_batches=2`` for a spec ending in ``:acc2``. The checkpoints are written under a new folder
    ``<prefix>_reference``."""
    tmp = tmp_path_factory.mktemp(f"{prefix}_reference")

    def get(spec: str) -> tuple[dict, dict[int, float]]:
        name = spec.split(":")[0]
        kwargs = {"accumulate_grad_batches": 2} if spec.endswith(":acc2") else {}
        ckpt = reference_run(name, "64-true", tmp / f"{spec_tag(spec)}.ckpt", **kwargs)
        return ckpt, LOGGED[(name, "64-true", tuple(sorted(kwargs.items())))]

    return get
