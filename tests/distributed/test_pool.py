"""The rank pool's own tests (tests/support/pool.py): a failing or hanging case stays with its case, and a case that
leaves state behind does not leak it into the next one."""

from __future__ import annotations

import json

import pytest

from tests.support.pool import RankPool

CASES = "tests/support/pool_cases.py"
pytestmark = pytest.mark.slow  # starts 2-rank pools


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, failure_grace_s=2.0)  # the cases' ranks answer in milliseconds
    yield p
    p.close()


def _check(pool: RankPool, out) -> list[dict]:
    result = pool.run([CASES, "check", str(out)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_case_raising_on_one_rank_fails_with_its_traceback_and_the_next_case_passes(pool, tmp_path):
    result = pool.run([CASES, "raise", str(tmp_path)], timeout=120)
    assert result.returncode == 1 and result.rank_codes[1] == 1, result.rank_codes
    assert result.stderr.count("RuntimeError: boom on rank 1") == 1, result.stderr[-3000:]
    assert result.stderr.count("Traceback (most recent call last)") == 1, result.stderr[-3000:]
    assert not result.timed_out
    starts = pool.starts
    assert all(r["sum"] == 2.0 for r in _check(pool, tmp_path))
    assert pool.starts == starts + 1  # rank 0 was left waiting in a collective: the pool was restarted


def test_a_case_failing_on_every_rank_keeps_the_pool_and_leaves_nothing_behind(pool, tmp_path):
    _check(pool, tmp_path)  # a pool that is up
    starts = pool.starts
    result = pool.run([CASES, "fail_all", str(tmp_path)], timeout=120)
    assert result.returncode == 1 and result.rank_codes == [1, 1], result.rank_codes
    assert result.stderr == "failed on rank 0\nfailed on rank 1\n", result.stderr[-3000:]
    assert not result.timed_out
    for report in _check(pool, tmp_path):
        assert report == {"initialized": False, "leftover": None, "dtype": "torch.float32", "argv": ["check",
                          str(tmp_path)], "sum": 2.0}
    assert pool.starts == starts  # every rank came back: the same processes ran the next case


def test_a_hanging_case_is_killed_at_its_timeout_and_the_pool_restarts(pool, tmp_path):
    result = pool.run([CASES, "hang", str(tmp_path)], timeout=3)
    assert result.timed_out and result.returncode != 0
    assert "did not finish in 3 s" in result.stderr
    assert not pool.alive
    assert all(r["sum"] == 2.0 for r in _check(pool, tmp_path))


def test_state_a_case_leaves_behind_does_not_reach_the_next(pool, tmp_path):
    _check(pool, tmp_path)  # a pool that is up
    starts = pool.starts
    result = pool.run([CASES, "leave", str(tmp_path)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "left state on rank 0\nleft state on rank 1\n"  # captured per rank, in rank order
    for report in _check(pool, tmp_path):
        assert report == {"initialized": False, "leftover": None, "dtype": "torch.float32", "argv": ["check",
                          str(tmp_path)], "sum": 2.0}
    assert pool.starts == starts  # the same processes ran both cases


def test_a_case_leaving_threads_running_gets_a_fresh_pool(pool, tmp_path):
    _check(pool, tmp_path)  # a pool that is up
    starts, restarts = pool.starts, pool.thread_restarts
    assert max(pool.thread_counts()) < 20  # the last case's process group's loops at most
    result = pool.run([CASES, "threads", str(tmp_path)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert pool.thread_restarts == restarts + 1 and not pool.alive and pool.most_threads > 60
    assert all(r["sum"] == 2.0 for r in _check(pool, tmp_path))
    assert pool.starts == starts + 1
