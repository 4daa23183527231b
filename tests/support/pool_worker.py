"""One rank of a :class:`tests.support.pool.RankPool`: imports once, then runs cases until told to stop.

Started as ``python -m tests.support.pool_worker`` by the pool, never by hand. A case runs its script with
``runpy`` as ``__main__`` (or ``-m module``), the way Lightning's popen launcher re-runs a script in a child, and
everything it may leave behind is put back before the next case (see ``tests/support/pool.py``).
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
import traceback
import warnings
from typing import Any

# What every case imports anyway: paid once per pool instead of once per rank and launch.
import lightning  # noqa: F401
import torch
import torch.distributed as dist

import lightning_dpmp  # noqa: F401
import tests.support.models  # noqa: F401
from tests.support.pool import connect_worker

try:  # the real-model and pretrained cases use it; optional like in the package
    import transformers  # noqa: F401
except ImportError:
    pass


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    return 1


def _redirect(stdout: str, stderr: str) -> tuple[int, int]:
    """Points fds 1 and 2 at the case's files (so C++ output and log handlers are captured); returns the old."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    return saved


def _restore_fds(saved: tuple[int, int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, old in zip((1, 2), saved):
        os.dup2(old, fd)
        os.close(old)


def _reset_state() -> None:
    """What a case may leave in this process that a fresh launch would not have."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group broken by the case: the next init makes a new one anyway
            pass
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:
        pass
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    torch.set_grad_enabled(True)
    gc.collect()


def run_case(case: dict[str, Any]) -> int:
    saved_env, saved_argv, saved_path = dict(os.environ), list(sys.argv), list(sys.path)
    saved_cwd, saved_filters = os.getcwd(), list(warnings.filters)
    os.environ.update(case["env"])
    os.environ["MASTER_PORT"] = case["port"]
    os.chdir(case["cwd"])
    fds = _redirect(case["stdout"], case["stderr"])
    code = 0
    try:
        args = case["args"]
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python script.py` would
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            _reset_state()
        except BaseException:
            traceback.print_exc()
            code = code or 1
        _restore_fds(fds)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv, sys.path[:] = saved_argv, saved_path
        warnings.filters[:] = saved_filters
        warnings._filters_mutated()  # type: ignore[attr-defined]  # forget "shown once" records: a fresh process would
    return code


def main() -> None:
    torch.set_num_threads(1)
    conn, _rank = connect_worker()
    conn.send("ready")
    while True:
        try:
            case = conn.recv()
        except EOFError:  # the pool went away
            return
        if case is None:
            return
        conn.send(run_case(case))


if __name__ == "__main__":
    main()
