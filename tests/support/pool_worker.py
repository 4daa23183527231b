"""One rank of a :class:`tests.support.pool.RankPool`: imports once, then runs cases until told to stop.

Started as ``python -m tests.support.pool_worker`` by the pool, never by hand. A case runs its script with
``runpy`` as ``__main__`` (or ``-m module``), the way Lightning's popen launcher re-runs a script in a child, and
everything it may leave behind is put back before the next case (see ``tests/support/pool.py``).
"""

from __future__ import annotations

import gc
import logging
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
from lightning_dpmp import compat
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


def _torchrun_env(run_id: str) -> dict[str, str]:
    """What ``torchrun --standalone`` sets in a rank besides what the pool sets anyway (``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). ``TORCHELASTIC_USE_AGENT_STORE`` stays unset: there is no
    agent here, so rank 0 hosts the rendezvous store itself."""
    rank, world = os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]
    return {
        "RANK": rank, "GROUP_RANK": "0", "ROLE_RANK": rank, "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": world,
        "ROLE_WORLD_SIZE": world, "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    }  # fmt: skip


def _logging_state() -> list[tuple]:
    """The root logger's handlers and level, and the level and flags of every other logger that exists now."""
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    root = logging.getLogger()
    return [(root, root.level, list(root.handlers), root.propagate, root.disabled)] + [
        (lg, lg.level, None, lg.propagate, lg.disabled) for lg in loggers
    ]


def _restore_logging(saved: list[tuple]) -> None:
    """Hydra's job logging puts a console and a file handler (``train.log``) on the root logger: they are closed
    and removed, so the next case does not log into this case's folder; levels and flags are put back."""
    for lg, level, handlers, propagate, disabled in saved:
        if handlers is not None:
            for h in lg.handlers[:]:
                if h not in handlers:
                    lg.removeHandler(h)
                    h.close()
            for h in handlers:
                if h not in lg.handlers:
                    lg.addHandler(h)
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


def _reset_hydra() -> None:
    """Hydra's singletons (``@hydra.main`` clears ``GlobalHydra`` on its way out but keeps the job's
    ``HydraConfig``) and the examples' launch-time stamp, read once per process: each run of ``examples/train.py``
    starts as in a new process."""
    if "hydra" in sys.modules:
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.hydra_config import HydraConfig

        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # type: ignore[assignment]
    config = sys.modules.get("examples.config")
    if config is not None:
        config._LAUNCH_TIME = None  # type: ignore[attr-defined]


def _reset_state() -> None:
    """What a case may leave in this process that a fresh launch would not have."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group broken by the case: the next init makes a new one anyway
            pass
    # DTensor's caches hold a finished case's mesh, and with it its destroyed groups' gloo threads
    compat.clear_dtensor_sharding_cache()
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:
        pass
    # a TorchFunctionMode a case left entered (Fabric's DTensor bridge stays until the process ends): a new process
    # starts with none
    while torch._C._len_torch_function_stack() > 0:
        torch._C._pop_torch_function_stack()
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    torch.set_grad_enabled(True)
    _reset_hydra()
    gc.collect()


def run_case(case: dict[str, Any]) -> int:
    saved_env, saved_argv, saved_path = dict(os.environ), list(sys.argv), list(sys.path)
    saved_cwd, saved_filters, saved_logging = os.getcwd(), list(warnings.filters), _logging_state()
    os.environ.update(case["env"])
    os.environ["MASTER_PORT"] = case["port"]
    if case.get("torchrun_id"):
        os.environ.update(_torchrun_env(case["torchrun_id"]))
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
        _restore_logging(saved_logging)
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
