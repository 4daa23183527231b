"""Two simulated nodes: two torchrun invocations on this machine (--nnodes=2, 2 processes each) train
DPMPStrategy(dp=2, mp=2) with each MP group inside one node, and reach the weights of the one-node run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_ranks
from tests.support.pool import free_port

WORKER = "tests/integration/multinode_worker.py"


def _node(node_rank: int, port: int, out: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={port}", WORKER, "2", "2", str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_nodes_keep_mp_inside_a_node_and_match_one_node(tmp_path):
    two, one = tmp_path / "two_nodes", tmp_path / "one_node"
    two.mkdir(), one.mkdir()
    # The two torchrun agents sometimes never complete their rendezvous on this machine (seen about 1 run in 8, at
    # the stop's start commit too; the job itself takes 10-20 s): a launch stuck for 120 s is tried once more on a
    # new port, and a second one fails the test.
    for attempt in (1, 2):
        port = free_port()
        nodes = [_node(r, port, two) for r in (0, 1)]
        try:
            logs = [p.communicate(timeout=120) for p in nodes]
            break
        except subprocess.TimeoutExpired:
            for p in nodes:
                p.kill()
                p.communicate()
            if attempt == 2:
                pytest.fail("the two-node job did not finish in 120 s, twice")
    for p, (_, err) in zip(nodes, logs):
        assert p.returncode == 0, err[-4000:]

    layouts = [json.loads((two / f"layout_{r}.json").read_text()) for r in range(4)]
    for info in layouts:
        assert info["node"] == info["rank"] // 2  # torchrun node 0 holds ranks 0-1, node 1 ranks 2-3
        assert info["mp_group"] == [2 * info["node"], 2 * info["node"] + 1]
        assert set(info["mp_group_nodes"]) == {info["node"]}  # the MP all-reduces never leave the node
        assert info["dp_group"] == [info["rank"] % 2, info["rank"] % 2 + 2]  # DP crosses nodes

    proc = run_ranks(4, [WORKER, "1", "4", str(one)], timeout=240)  # the same job on one node (the 4-rank pool)
    assert proc.returncode == 0, proc.stderr[-4000:]
    a = torch.load(two / "last.ckpt", weights_only=True)["state_dict"]
    b = torch.load(one / "last.ckpt", weights_only=True)["state_dict"]
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |two nodes - one node| = {diff:.1e}")
    assert diff <= 1e-12, diff  # float64; measured 0 (same ranks, same reductions)
