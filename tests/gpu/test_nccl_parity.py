"""The parity oracle on CUDA with NCCL (marked ``gpu``; skipped without at least two GPUs).

NCCL cannot put two ranks of one communicator on the same GPU, so a one-GPU machine cannot run it either.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_script
from tests.support.reference import max_weight_diff, reference_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA devices for NCCL ranks"),
]


@pytest.mark.parametrize("model", ["resmlp", "gpt", "gpt+sp"])
def test_nccl_training_matches_single_process(tmp_path, model):
    proc = run_script(["tests/distributed/parity_worker.py", "1", "2", str(tmp_path), model], timeout=600,
                      env={"DPMP_TEST_ACCELERATOR": "gpu", "PRECISIONS": "64-true"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = torch.load(tmp_path / f"{model}_64.ckpt", weights_only=True)
    ref = reference_run(model.split("+")[0], "64-true", tmp_path / "ref.ckpt")
    assert max_weight_diff(ckpt, ref) <= 1e-8
    rank0 = json.loads((tmp_path / "rank0.json").read_text())[f"{model}_64"]
    assert rank0["verified"] is True and rank0["consistent"]["mp_replicated_bitwise_equal"]
