"""``benchmarks/gpu_checks.py`` in one process, without starting anything: the peak table, the MFU arithmetic, the
collective counts it expects, its sizes, and how ``all`` reports a failing check, a check that never reported and
the summary. The dry mode itself runs end to end in ``tests/integration/test_gpu_check.py`` (slow)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "benchmarks" / "gpu_checks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_checks"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


G = _load()


def test_importing_the_checks_imports_no_torch_stack():
    """``all`` runs without torch (the Hydra checks and the orchestration): nothing heavy at import."""
    text = (ROOT / "benchmarks" / "gpu_checks.py").read_text()
    top = text[: text.index("ROOT = Path(")]
    assert "import torch" not in top and "import lightning" not in top


@pytest.mark.parametrize("name,peak,key", [
    ("NVIDIA H200", 989.0, "H200"),
    ("NVIDIA H100 80GB HBM3", 989.0, "H100"),
    ("NVIDIA H100 PCIe", 756.0, "H100 PCIe"),
    ("NVIDIA A100-SXM4-80GB", 312.0, "A100"),
    ("NVIDIA L40S", 362.0, "L40S"),
    ("cpu", 1.0, "cpu"),
    ("Some Future GPU", None, ""),
])
def test_peak_is_looked_up_by_device_name(name, peak, key):
    assert G.peak_tflops(name) == (peak, key)


def test_model_flops_per_token_follow_megatron():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters()) - 64 * 32  # all but the input embedding (a lookup)
    assert G.llama_flops_per_token(model, layers=2, hidden=32, seq=16) == 6 * params + 12 * 2 * 32 * 16


def test_expected_collectives_are_the_test_suites():
    Case = G.Case
    assert G.expected_counts(Case("a", "parity_1x2", "gpt", 1, 2), {}) == ({"mp/all_reduce": 13}, [])
    assert G.expected_counts(Case("b", "parity_2x2", "gpt", 2, 2), {}) == ({"mp/all_reduce": 13}, ["dp/all_reduce"])
    assert G.expected_counts(Case("c", "parity_2x2", "gpt", 2, 2, sp=True), {})[0] == {
        "mp/all_reduce": 4, "mp/all_gather": 11, "mp/reduce_scatter": 10}
    assert G.expected_counts(Case("d", "parity_2x2", "gpt", 2, 2, zero=3), {})[0] == {
        "mp/all_reduce": 13, "dp/reduce_scatter": 3, "dp/all_gather": 5, "dp/all_reduce": 1}
    assert G.expected_counts(Case("e", "parity_2x1", "gpt", 2, 1), {}) == ({}, [])  # mp=1: no MP collective
    pp = Case("f", "parity_pp", "gpt", 1, 2, pp=2)
    first, last = (G.expected_counts(pp, {"grid": [0, s, 0]})[0] for s in (0, 1))
    assert first["pp/send"] == last["pp/send"] == 4 and first["pp/all_reduce"] == 2  # 4 micro-batches, one cut
    comm = {"forward": {"all_reduce": 7}, "backward": {"all_reduce": 5}}
    assert G.expected_counts(Case("g", "pretrained", "pretrained", 1, 2), {"comm": comm})[0] == {"mp/all_reduce": 13}


def test_cases_cover_every_requested_layout():
    layouts = {(c.dp, c.pp, c.mp, c.zero, c.sp) for c in G.CASES}
    assert {(1, 1, 2, 0, False), (2, 1, 1, 0, False), (2, 1, 2, 0, False), (2, 1, 2, 3, False), (2, 1, 2, 0, True),
            (1, 2, 2, 0, False)} <= layouts
    for world, cases in G.PHASES.items():
        assert all(c.world == world for c in cases), world
    assert len({c.name for c in G.CASES}) == len(G.CASES)


def test_sizes_differ_only_in_numbers():
    cpu, cuda = G.SIZES["cpu"], G.SIZES["cuda"]
    assert cuda.budget_s <= 8 * 60  # one command of the device tool, with room for the start and the summary
    for s in (cpu, cuda):
        assert s.parity_steps >= 4  # the collectives of step 3 are counted
        assert s.hydra_steps >= 2 and s.compile_steps > s.warmup_steps and s.mfu_steps >= 1
    assert [o.split("=")[0] for o in cpu.hydra_overrides] == [o.split("=")[0] for o in cuda.hydra_overrides]
    assert cpu.compile_gpt.keys() == cuda.compile_gpt.keys() and cpu.llama.keys() == cuda.llama.keys()


def test_every_check_is_documented():
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    for name in G.CHECKS:
        assert name in script and name in readme, name


def test_all_reports_failures_and_missing_checks_and_still_writes_the_summary(tmp_path, monkeypatch, capsys):
    """One check fails (its name, error and log tail on stderr), one group's process dies before reporting (its
    checks fail naming that), the rest pass; the summary marks each, and ``all`` returns 1."""
    out = tmp_path / "out"
    (out / "work").mkdir(parents=True)

    def fake_group(name, device, out_, timeout):
        if name == "single":  # killed at its limit: reports nothing
            return None, timeout
        for check in G.GROUPS[name]:
            res = G.Result(check, status="pass", summary=f"{check} fine", seconds=1.0)
            if check == "parity_pp":
                res.status, res.error, res.log = "fail", "CheckFailed: 3 sends, want 4", "logs/rank1.log"
                (out_ / "logs" / "rank1.log").write_text("line one\nthe last line of rank 1\n")
            res.write(out_)
        return 1, 2.0

    def fake_hydra(device, out_, deadline):
        for check in G.GROUPS["hydra"]:
            G.Result(check, status="pass", summary="ok").write(out_)

    monkeypatch.setattr(G, "_run_group", fake_group)
    monkeypatch.setattr(G, "group_hydra", fake_hydra)
    assert G.run_all("cpu", out) == 1
    err = capsys.readouterr().err
    assert "!! check 'parity_pp' FAIL: CheckFailed: 3 sends, want 4" in err and "the last line of rank 1" in err
    assert "!! check 'compile' FAIL: did not run: group 'single' its process was killed" in err
    summary = (out / "summary.md").read_text()
    assert "| check | status | result | s |" in summary
    assert f"**{len(G.CHECKS) - 3} of {len(G.CHECKS)} checks passed**" in summary
    for check in G.CHECKS:
        mark = "**FAIL**" if check in ("parity_pp", "mfu", "compile") else "PASS"
        assert f"| {check} | {mark} |" in summary, check
    assert "**FAILED: parity_pp, mfu, compile**" in summary
    assert json.loads((out / "results" / "mfu.json").read_text())["status"] == "fail"
    assert not (out / "work").exists()  # bulky files go; results, logs and the summary stay
