"""The speed features keep the numbers: ``compile=True`` trains like eager (float32, 1e-4) with no graph break
inside a block, ``async_grad_allreduce=True`` like the synchronous path (float64, 1e-8, with gradient
accumulation), and the tensor collectives give the list collectives' results bit for bit.

One launch per layout (compile time dominates: tiny models, 4 steps).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_script

LAYOUTS = {(1, 2): "gpt,hf_llama", (2, 2): "gpt"}  # the transformers Llama once: its compile is the slow one


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=lambda layout: f"dp{layout[0]}_mp{layout[1]}")
def run(request, tmp_path_factory):
    dp, mp = request.param
    out = tmp_path_factory.mktemp(f"compile_dp{dp}_mp{mp}")
    proc = run_script(["tests/distributed/compile_worker.py", str(dp), str(mp), str(out), LAYOUTS[dp, mp]],
                      timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return dp, mp, [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp * mp)]


@pytest.mark.slow
def test_compiled_matches_eager_without_graph_breaks(run):
    dp, mp, ranks = run
    for rank, res in enumerate(ranks):
        for name in LAYOUTS[dp, mp].split(","):
            r = res[name]
            print(f"dp={dp} mp={mp} {name}: compiled vs eager {r['compiled_vs_eager']:.2e}, "
                  f"{r['unique_graphs']} graphs for {r['blocks']} blocks")
            assert r["blocks"] == 2, (rank, name)
            assert r["graph_breaks"] == {}, (rank, name, r["graph_breaks"])
            assert r["compiled_vs_eager"] <= 1e-4, (rank, name, r["compiled_vs_eager"])


@pytest.mark.slow
def test_compiled_blocks_under_zero3_keep_the_hooks_out_of_the_graph(run):
    dp, mp, ranks = run
    if dp == 1:
        pytest.skip("ZeRO-3 shards over DP: checked at dp=2")
    for rank, res in enumerate(ranks):
        assert res["zero3_graph_breaks"] == {}, (rank, res["zero3_graph_breaks"])
        assert res["zero3_compiled_vs_eager"] <= 1e-4, (rank, res["zero3_compiled_vs_eager"])


@pytest.mark.slow
def test_async_input_grad_allreduce_matches_sync(run):
    dp, mp, ranks = run
    for rank, res in enumerate(ranks):
        # fc1 of each block and the LM head: layers with their own entry (q/k/v share one, it stays synchronous)
        assert res["overlapped_layers"] == [0, 3], rank
        assert res["async_vs_sync_float64"] <= 1e-8, (rank, res["async_vs_sync_float64"])
        assert res["moved"] > 1e-3  # training moved the weights: the comparison proves something


@pytest.mark.slow
def test_tensor_collectives_equal_list_collectives(run):
    """Gathers: bitwise, always. Reduce-scatters: bitwise on 2 ranks (a + b); on 4, gloo's list and tensor
    versions add in different orders, both within float32 rounding of the exact sum."""
    _, _, ranks = run
    for rank, res in enumerate(ranks):
        for group in ("collectives_mp", "collectives_world"):
            r = res[group]
            assert r["supported_cpu_gloo"] is True
            for d in (0, 1, 2, -1):
                assert r[f"gather_dim{d}"], (rank, group, d)
                assert r[f"reduce_scatter_dim{d}"] or r["size"] > 2, (rank, group, d)
                assert r[f"reduce_scatter_dim{d}_err"] < 1e-5, (rank, group, d, r)
