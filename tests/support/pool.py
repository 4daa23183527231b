"""Persistent rank pools: the multi-process tests run their worker scripts in ranks started once per session.

Starting a 4-rank Lightning job costs 10-15 s on 2 cores before it checks anything: every rank imports torch,
Lightning and transformers. A :class:`RankPool` starts ``world_size`` processes once, as an external launcher
(torchrun, SLURM) would: each has ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set, so
Lightning treats it as already launched and starts no children. A *case* is one worker script (or ``-m module``)
with its argv; the pool runs it in every rank with ``runpy`` as ``__main__``, exactly as the popen launcher
would have re-run it in a child, and hands back a :class:`CaseResult` shaped like ``subprocess.CompletedProcess``.

Each case starts from fresh state:

- a new ``MASTER_PORT`` (the previous case's TCP store may still be closing), its own environment overrides, and
  the environment, ``sys.argv``, ``sys.path``, working directory, warning filters and registries, default dtype,
  thread count and Dynamo caches restored afterwards, and any ``TorchFunctionMode`` it left entered popped;
- any process group the case left is destroyed;
- its stdout and stderr are captured at the file-descriptor level (C++ output and Lightning's log handlers
  included), rank by rank, and concatenated in rank order.

Failures stay with their case:

- a rank that raises reports its traceback (in the captured stderr) and a non-zero code; the other ranks get a
  short grace to finish, then the pool is killed and restarted, as Lightning's child observer would kill a job.
  When every rank came back in time (a failure every rank reports, such as a bad argument or a consistency check),
  each has left the case and reset its state as after a passing case, and the pool keeps running;
- a case that passes its timeout is killed with its whole pool (every process group, so forked DataLoader
  workers too); the next case starts a new pool;
- a rank that dies (a segfault, ``os._exit``) fails the case with its exit code;
- a rank left with more than ``MAX_THREADS`` threads after a case (threads the case left running, such as the gloo
  loops of a process group something still holds) is restarted with its pool before the next case.

Example (from a test)::

    result = rank_pool(4).run(["tests/distributed/parity_worker.py", "2", "2", str(out)], timeout=420)
    assert result.returncode == 0, result.stderr[-5000:]
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import IO, Callable, Optional

ROOT = Path(__file__).resolve().parents[2]

#: After one rank fails, how long the others may take to finish before the pool is killed and restarted.
FAILURE_GRACE_S = 10.0
#: How long a new pool may take to import everything and report ready.
START_TIMEOUT_S = 180.0
#: A rank with more threads than this after a case is restarted before the next one. A fresh rank has 1; a case's
#: process groups leave 10-26 (gloo's loops, measured over the suite) until the next case frees them. Threads that
#: outlive their case (a process group something still holds) accumulate, and gloo's wake on timers: before the
#: DTensor parameters' hook was fixed, 9 per rank per (2, 2) case, and a 4-rank pool idle after 3 cases used 14 CPU
#: ticks per 10 s per rank against 3 after 1 case.
MAX_THREADS = 48


@dataclass
class CaseResult:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would return, for a case run in a pool."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    rank_codes: list[Optional[int]] = field(default_factory=list)
    timed_out: bool = False


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    """``world_size`` ranks started once, running many cases in sequence (see the module docstring)."""

    def __init__(
        self, world_size: int, base_env: Optional[dict[str, str]] = None, failure_grace_s: float = FAILURE_GRACE_S
    ) -> None:
        self.world_size = world_size
        self.failure_grace_s = failure_grace_s  # the pool's own tests shorten it: their cases finish in milliseconds
        self.base_env = dict(base_env or {})
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._log: Optional[IO[bytes]] = None
        self.starts = 0  # how many times the pool was (re)started: the pool's own tests read it
        self.cases = 0  # how many cases it ran
        self.thread_restarts = 0  # restarts because a rank kept more than MAX_THREADS threads after a case
        self.most_threads = 0  # the most threads a rank kept after a case

    # -- lifecycle ------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def start(self) -> None:
        self.close()
        key = secrets.token_bytes(16)
        # backlog: every rank may connect at once (with multiprocessing's default of 1, connects past the first wait
        # in the kernel's SYN retries, which back off to minutes: 8 ranks once took over 180 s)
        listener = Listener(("127.0.0.1", 0), authkey=key, backlog=max(1, self.world_size))
        host, port = listener.address
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            **self.base_env,
            "NODE_RANK": "0",
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "DPMP_POOL_ADDRESS": f"{host}:{port}",
            "DPMP_POOL_KEY": key.hex(),
        }
        self._log = tempfile.TemporaryFile(prefix=f"dpmp_pool{self.world_size}_")
        for var in ("MASTER_PORT", "RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED"):
            env.pop(var, None)
        for rank in range(self.world_size):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.support.pool_worker"],
                    cwd=ROOT,
                    env={**env, "LOCAL_RANK": str(rank)},
                    stdin=subprocess.DEVNULL,
                    stdout=self._log,  # outside cases (a case's own output goes to its files)
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: a kill reaches forked loader workers too
                )
            )
        self.starts += 1
        try:
            conns: dict[int, Connection] = {}

            def accept_all() -> None:
                while len(conns) < self.world_size:
                    conn = listener.accept()
                    conns[conn.recv()] = conn

            # accept() cannot time out: run it aside, so that a rank that dies while importing fails the start
            acceptor = threading.Thread(target=accept_all, daemon=True)
            acceptor.start()
            deadline = time.monotonic() + START_TIMEOUT_S
            while acceptor.is_alive() and time.monotonic() < deadline:
                acceptor.join(0.5)
                dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"pool rank {dead[0]} exited with {self.procs[dead[0]].returncode} at start")
            if acceptor.is_alive():
                raise TimeoutError(f"pool ranks did not connect in {START_TIMEOUT_S:.0f} s")
            self.conns = [conns[r] for r in range(self.world_size)]
            for conn in self.conns:  # "ready": every import done
                if not conn.poll(max(0.0, deadline - time.monotonic())) or conn.recv() != "ready":
                    raise TimeoutError("pool ranks did not get ready")
        except BaseException as exc:
            self._log.seek(0)
            tail = self._log.read()[-3000:].decode(errors="replace")
            self.close()
            raise RuntimeError(f"the {self.world_size}-rank pool did not start: {exc}\n{tail}") from exc
        finally:
            listener.close()

    def close(self) -> None:
        """Ends every rank now (and anything it forked)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.wait()
        for conn in self.conns:
            conn.close()
        if self._log is not None:
            self._log.close()
        self.procs, self.conns, self._log = [], [], None

    # -- cases ----------------------------------------------------------------------------------------------------
    def run(
        self,
        args: list[str],
        timeout: float = 300,
        env: Optional[dict[str, str]] = None,
        cwd: Path = ROOT,
        torchrun: bool = False,
    ) -> CaseResult:
        """Runs ``python *args`` in every rank; returns the first failing rank's code (rank 0 first) and the
        ranks' output in rank order. Past ``timeout`` seconds the pool is killed and ``timed_out`` is set.

        ``torchrun=True``: each rank also gets what ``torchrun --standalone`` would set (``RANK``,
        ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, a new ``TORCHELASTIC_RUN_ID``, ...), so Lightning sees a
        ``TorchElasticEnvironment`` and scripts that look for torchrun (``examples/train.py``) take that path."""
        if not self.alive:
            try:
                self.start()
            except RuntimeError as exc:
                if "did not connect" not in str(exc):
                    raise
                # a start whose ranks never connected (seen with 8 ranks on 2 cores, before the backlog above)
                self.start()
        self.cases += 1
        with tempfile.TemporaryDirectory(prefix="dpmp_case_") as tmp:
            outs = [(Path(tmp) / f"rank{r}.out", Path(tmp) / f"rank{r}.err") for r in range(self.world_size)]
            case = {"args": list(args), "env": dict(env or {}), "cwd": str(cwd), "port": str(free_port()),
                    "torchrun_id": secrets.token_hex(8) if torchrun else ""}
            for conn, (out, err) in zip(self.conns, outs):
                conn.send({**case, "stdout": str(out), "stderr": str(err)})
            codes, timed_out = self._collect(timeout)
            if timed_out or any(c is None for c in codes) or not self.alive:
                # a rank still inside the case (maybe inside a collective) or dead: the next case gets a new pool.
                # A case that failed on ranks that all came back keeps it: each left the case and reset its state.
                self.close()
            else:
                threads = max(self.thread_counts(), default=0)
                self.most_threads = max(self.most_threads, threads)
                if threads > MAX_THREADS:  # threads the case left running: a fresh pool for the next case
                    self.thread_restarts += 1
                    self.close()
            stdout = "".join(_read(out) for out, _ in outs)
            stderr = "".join(_read(err) for _, err in outs)
        # The first failing rank's code (rank 0 first); 1 when the only failures are ranks that never answered.
        failed = any(c != 0 for c in codes)  # None: a rank that never answered (killed with the pool)
        code = next((c for c in codes if c not in (0, None)), 1 if failed else 0)
        if timed_out:
            stderr += f"\n[pool] case {args} did not finish in {timeout} s; the pool was killed\n"
        return CaseResult(list(args), code, stdout, stderr, codes, timed_out)

    def thread_counts(self) -> list[int]:
        """How many threads each rank has now (Linux's ``/proc``; empty where there is none)."""
        counts = []
        for proc in self.procs:
            try:
                counts.append(len(os.listdir(f"/proc/{proc.pid}/task")))
            except OSError:
                return []
        return counts

    def _collect(self, timeout: float) -> tuple[list[Optional[int]], bool]:
        codes: list[Optional[int]] = [None] * self.world_size
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.conns))
        failed = False  # from the first failure on, the others get failure_grace_s, not the whole timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return codes, not failed
            ready = wait(list(pending.values()), timeout=min(remaining, 1.0))
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        codes[rank] = conn.recv()
                    except (EOFError, OSError):  # the rank died mid-case
                        codes[rank] = self.procs[rank].wait()
                    del pending[rank]
                elif self.procs[rank].poll() is not None:
                    codes[rank] = self.procs[rank].returncode
                    del pending[rank]
            if not failed and any(c not in (0, None) for c in codes):
                failed = True
                deadline = min(deadline, time.monotonic() + self.failure_grace_s)
        return codes, False


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


_POOLS: dict[int, RankPool] = {}  # most recently used last
#: Pools kept running at once: an idle rank holds ~0.5-1 GB (torch, Lightning, transformers, the last case's
#: caches), so the least recently used pool is ended when a third size is needed (the 8-rank one is rare).
MAX_LIVE_POOLS = 2


def rank_pool(world_size: int) -> RankPool:
    """The session's pool of ``world_size`` ranks (started on first use, restarted after a failed case)."""
    pool = _POOLS.pop(world_size, None) or RankPool(world_size)
    _POOLS[world_size] = pool
    live = [p for p in _POOLS.values() if p.procs and p is not pool]
    for idle in live[: max(0, len(live) - (MAX_LIVE_POOLS - 1))]:
        idle.close()
    return pool


def pool_summary() -> str:
    """One line for the end of a test session: cases run and (re)starts per pool size."""
    parts = [f"{n} ranks: {p.cases} cases, {p.starts} starts ({p.thread_restarts} for threads left running; at most "
             f"{p.most_threads} threads after a case)" for n, p in sorted(_POOLS.items()) if p.starts]
    return "rank pools: " + ("; ".join(parts) if parts else "none used")


def close_pools() -> None:
    """Ends every pool of this session."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def run_world(worker: Callable[[int, int, int, str], None], path: str, world: int = 4) -> None:
    """A raw torch.distributed worker script's entry: ``worker(rank, world, port, path)`` on this rank when the
    process was launched as one rank (a pool, torchrun: ``LOCAL_RANK`` set), else on ``world`` spawned processes."""
    if "LOCAL_RANK" in os.environ:
        worker(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]), path)
        return
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, free_port(), path), nprocs=world)


def connect_worker() -> tuple[Connection, int]:
    """In a pool rank: the connection to the pool, after telling it this rank's number."""
    host, port = os.environ["DPMP_POOL_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["DPMP_POOL_KEY"]))
    rank = int(os.environ["LOCAL_RANK"])
    conn.send(rank)
    return conn, rank
