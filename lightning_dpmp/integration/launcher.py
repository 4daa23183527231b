"""Process launching for DPMPStrategy: Lightning's popen launcher, made safe for Hydra multirun, and what a launched
rank does to end with its job (dies with its launcher, closes its gloo groups at exit).

Lightning's ``_SubprocessScriptLauncher`` starts local ranks 1..N-1 by re-running ``sys.argv``. Under a Hydra
multirun (``python train.py -m a=1,2``) every child then replays the *whole sweep*: a second multirun folder
appears, and a job can train with another job's world size and still exit 0 (hydra#2070, Lightning PR #18175).

``DPMPScriptLauncher`` starts each child as a single Hydra RUN of the current job only:

    <python> <script> [--config-path/--config-name/--config-dir as given]
             <this job's resolved task overrides> <the user's hydra overrides minus sweep/run/launcher ones>
             hydra.mode=RUN hydra.run.dir='<this job's output dir>' hydra.output_subdir=null
             hydra.job.name=<job name>_rank<k>

never ``-m`` and never the sweep arguments. Outside Hydra it behaves like Lightning's launcher.

It also makes a process that runs several jobs in a row (Hydra's basic sweeper) safe:

- ``launch_environment()`` snapshots and restores the variables the launcher exports (``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_PORT``, ...). Lightning reads a leftover ``LOCAL_RANK`` as "processes are created
  externally", so without the restore the next job would not start its own children and would hang.
- The child observer can be stopped: Lightning's observer SIGKILLs the *parent* as soon as a child exits
  non-zero, which ends the whole sweep even when the parent handled the failure. ``shutdown()`` stops it, waits
  for this job's children and kills any that are left.

And what a launched rank does to end with its job (called in the strategy's ``setup_environment``):

* :func:`die_with_parent`: a rank started by a launcher (Lightning's popen launcher, torchrun;
  :func:`is_launched_rank`) is killed by the kernel when its launcher dies, so that a rank stuck outside any
  collective cannot outlive the job as an orphan.
* :func:`close_gloo_groups_at_exit`: the process destroys its gloo groups while it is still whole.

Example:
    >>> is_launched_rank(LightningEnvironment(), 0)
    False
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

from lightning_dpmp.compat import SubprocessScriptLauncher as _SubprocessScriptLauncher
from lightning_dpmp.compat import check_can_spawn_children
from lightning_dpmp.compat import set_num_threads_if_needed as _set_num_threads_if_needed
from lightning_dpmp.integration.validate import check_before_launch

__all__ = [
    "DPMPScriptLauncher",
    "close_gloo_groups_at_exit",
    "die_with_parent",
    "hydra_child_command",
    "is_launched_rank",
    "launch_environment",
]

log = logging.getLogger(__name__)
_HYDRA_AVAILABLE = RequirementCache("hydra-core")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

#: Environment variables the popen launcher (or ``seed_everything`` / thread tuning) exports in the parent.
LAUNCH_ENV_VARS: tuple[str, ...] = (
    "LOCAL_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "OMP_NUM_THREADS",
)

# Hydra overrides a child must not inherit: they describe the sweep, the parent's output location or the launcher.
_DROPPED_HYDRA_KEYS: tuple[str, ...] = (
    "hydra.mode",
    "hydra.sweep",
    "hydra.run",
    "hydra.output_subdir",
    "hydra.job.name",
    "hydra.launcher",
    "hydra.sweeper",
    "hydra/launcher",
    "hydra/sweeper",
)
# Command-line flags that select the primary config; they are not part of the overrides, so copy them from argv.
_CONFIG_FLAGS: tuple[str, ...] = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


class DPMPScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher; each child re-runs the current script as one Hydra RUN of this job."""

    def __init__(self, *args: Any, grace_period_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grace_period_s = grace_period_s
        self._observer: Optional[_ChildObserver] = None

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if trainer is not None:  # the model and ckpt_path are known: check them before any child starts
            check_before_launch(trainer, function, args, kwargs)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self._observer = _ChildObserver(self.procs, main_pid=os.getpid(), grace_period_s=self.grace_period_s)
            self._observer.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        # Stop watching first: children killed on purpose must not make the observer kill this process.
        if self._observer is not None:
            self._observer.stop()
        super().kill(signum)

    def shutdown(self, timeout_s: float = 60.0) -> list[Optional[int]]:
        """Stops the observer, waits up to ``timeout_s`` for this job's children, kills the rest.

        Returns the children's exit codes (a negative code is the signal that ended the child).
        """
        if self._observer is not None:
            self._observer.stop()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(f"Child process {proc.pid} did not exit within {timeout_s:.0f} s; killing it.")
                proc.kill()
                proc.wait()
        return [proc.returncode for proc in self.procs]

    @override
    def _call_children_scripts(self) -> None:
        check_can_spawn_children(self)
        self.procs = []

        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"

        for local_rank in range(1, self.num_processes):
            env_copy = os.environ.copy()
            env_copy["LOCAL_RANK"] = f"{local_rank}"
            if os.environ.get("PL_GLOBAL_SEED") is None:
                env_copy.pop("PL_GLOBAL_SEED", None)
            command, cwd = _child_command(local_rank)
            log.debug(f"Starting local rank {local_rank}: {command} (cwd={cwd})")
            self.procs.append(subprocess.Popen(command, env=env_copy, cwd=cwd))


def _child_command(local_rank: int) -> tuple[list[str], Optional[str]]:
    if _HYDRA_AVAILABLE:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return hydra_child_command(local_rank)
    return [*_script_prefix(absolute_to=None), *sys.argv[1:]], None


def _script_prefix(absolute_to: Optional[str]) -> list[str]:
    import __main__  # local import, see Lightning issue 15218

    spec = getattr(__main__, "__spec__", None)
    if spec is None:
        script = sys.argv[0]
        if not os.path.isabs(script):
            script = os.path.join(absolute_to or os.getcwd(), script)
        return [sys.executable, script]
    return [sys.executable, "-m", spec.name]


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _quote(value: str) -> str:
    """Quotes a value for Hydra's override grammar (paths may hold ``,``, ``=`` or spaces)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _config_flags(argv: Sequence[str]) -> list[str]:
    """Returns the ``--config-name``/``--config-path``/``--config-dir`` flags (both spellings) found in ``argv``."""
    flags: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in _CONFIG_FLAGS:
            if "=" in arg:
                flags.append(arg)
            elif i + 1 < len(argv):
                flags += [arg, argv[i + 1]]
                i += 1
        i += 1
    return flags


def hydra_child_command(local_rank: int) -> tuple[list[str], str]:
    """The command and cwd that start ``local_rank`` as a single Hydra RUN of the current job.

    Must be called inside a Hydra job (``HydraConfig.initialized()``). Works in RUN and MULTIRUN mode alike: the
    job's own task overrides already hold the values the sweeper chose for this job.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    hydra_cfg = HydraConfig.get()
    original_cwd = get_original_cwd()
    task_overrides = [str(o) for o in hydra_cfg.overrides.task]
    hydra_overrides = [
        str(o)
        for o in hydra_cfg.overrides.hydra
        if not any(_override_key(str(o)) == k or _override_key(str(o)).startswith(k + ".") for k in _DROPPED_HYDRA_KEYS)
    ]
    output_dir = hydra_cfg.runtime.output_dir
    command = [
        *_script_prefix(absolute_to=original_cwd),
        *_config_flags(sys.argv[1:]),
        *task_overrides,
        *hydra_overrides,
        "hydra.mode=RUN",
        f"hydra.run.dir={_quote(str(output_dir))}",
        "hydra.output_subdir=null",  # only the launching process writes .hydra/
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",  # one log file per rank
    ]
    return command, original_cwd


@contextlib.contextmanager
def launch_environment() -> Iterator[None]:
    """Restores the launcher's environment variables and torch's thread count on exit.

    Wrap each job of a process that runs several jobs in a row (Hydra multirun with the basic launcher), so that the
    next job's Trainer starts its own children instead of believing they were created externally.
    """
    saved = {key: os.environ.get(key) for key in LAUNCH_ENV_VARS}
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(threads)


class _ChildObserver(threading.Thread):
    """Watches the children; on a failure kills the other children, then (after a grace period) the parent.

    The grace period lets the parent notice the failure itself (gloo raises when a peer disappears) and carry on
    with the next sweep job; a parent still stuck afterwards (e.g. an NCCL collective) is killed like in Lightning.
    """

    def __init__(self, child_processes: list[subprocess.Popen], main_pid: int, grace_period_s: float) -> None:
        super().__init__(daemon=True, name="dpmp-child-observer")
        self._procs = child_processes
        self._main_pid = main_pid
        self._grace_period_s = grace_period_s
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    @override
    def run(self) -> None:
        while not self._stopped.wait(1.0):
            codes = [proc.poll() for proc in self._procs]
            if all(code == 0 for code in codes):
                return
            failed = [(i + 1, proc) for i, proc in enumerate(self._procs) if proc.returncode]
            if not failed:
                continue
            rank, proc = failed[0]
            log.error(
                f"[rank: {rank}] Child process {proc.pid} exited with code {proc.returncode}; terminating the other"
                f" ranks of this job."
            )
            for other in self._procs:
                if other.poll() is None:
                    other.send_signal(signal.SIGKILL)
            if self._stopped.wait(self._grace_period_s):
                return
            log.error(f"The launching process did not finish within {self._grace_period_s:.0f} s; killing it.")
            os.kill(self._main_pid, signal.SIGKILL)
            return


def die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent exits; returns whether that is now in place.

    Call it only in a process whose parent is a launcher (never in the main process: a training started with
    ``nohup`` would die with its shell). Lightning's popen launcher kills its children only on Ctrl-C, so when
    rank 0 fails and exits, a rank that is not waiting on rank 0 (stuck in a dataloader or a long computation)
    would otherwise live on. Elsewhere than Linux this is a no-op, and ``timeout`` bounds the wait instead.

    Example:
        >>> die_with_parent() if False else None   # in a launched rank: True on Linux
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the parent died before the request: it will never fire
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def close_gloo_groups_at_exit() -> None:
    """Have this process destroy its gloo process groups when the interpreter exits, while it is still whole
    (registered once per process, however often it is called).

    Left to the interpreter's teardown, gloo's threads were sometimes destroyed while still joinable: "terminate
    called without an active exception", a SIGABRT after all the work was done (seen in torchrun and two-node launches
    on 2 busy cores). NCCL groups are left alone. A process dying of an uncaught exception (``sys.excepthook`` ran)
    leaves at once with exit code 1, its output and log handlers flushed, past the interpreter's teardown: destroying
    a group that still has work queued for a dead peer can block, and gloo's threads torn down by the interpreter
    turned that exit code 1 into a SIGABRT (-6) now and then.

    Example:
        >>> close_gloo_groups_at_exit()   # in setup_environment, once the process group exists
    """
    if not isinstance(sys.excepthook, _ExitWatch):
        sys.excepthook = _ExitWatch(sys.excepthook)
    atexit.unregister(_close_gloo_groups)  # at most one registration
    atexit.register(_close_gloo_groups)


class _ExitWatch:
    """``sys.excepthook`` wrapper noting that the process dies of an uncaught exception (then the previous hook)."""

    def __init__(self, previous: Any) -> None:
        self.previous, self.dying = previous, False

    def __call__(self, kind: Any, value: Any, tb: Any) -> None:
        self.dying = not issubclass(kind, KeyboardInterrupt)  # (Ctrl-C keeps Python's own exit)
        self.previous(kind, value, tb)


def _close_gloo_groups() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    if isinstance(sys.excepthook, _ExitWatch) and sys.excepthook.dying:  # a peer may be stuck: leave at once
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(1)
    if getattr(sys, "last_value", None) is not None:  # an exception shown elsewhere (a debugger, a test runner)
        return
    try:
        if dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:  # exiting anyway: a group that cannot be closed must not turn a clean exit into an error
        pass


def is_launched_rank(environment: Any, local_rank: int) -> bool:
    """Whether this process was started by a launcher that owns it: a torchrun worker, or a popen child
    (local rank > 0).

    Example:
        >>> is_launched_rank(LightningEnvironment(), 0)
        False
    """
    if isinstance(environment, TorchElasticEnvironment):
        return True
    return type(environment) is LightningEnvironment and environment.creates_processes_externally and local_rank > 0
