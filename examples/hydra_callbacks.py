"""Hydra callback: one table (CSV + markdown) and one plot per sweep, from the jobs' ``summary.json`` files."""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

__all__ = ["SweepSummary", "collect_rows", "SUMMARY_COLUMNS"]

log = logging.getLogger(__name__)

SUMMARY_COLUMNS = [
    "job",
    "dp",
    "mp",
    "world_size",
    "status",
    "tokens_per_s",
    "samples_per_s",
    "step_time_s",
    "params_per_rank",
    "params_total",
    "peak_mem_mb",
    "first_loss",
    "final_loss",
    "final_val_loss",
    "steps",
    "wall_s",
    "overrides",
    "error",
]


def _job_dirs(sweep_dir: Path) -> list[Path]:
    """Folders of the jobs that started: they hold Hydra's ``.hydra/`` or our ``summary.json``."""
    found = {p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml") if p.parent.parent != sweep_dir}
    found |= {p.parent for p in sweep_dir.glob("**/summary.json") if p.parent != sweep_dir}
    return sorted(found)


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job; a job that started but left no ``summary.json`` is ``crashed``."""
    rows = []
    for job_dir in _job_dirs(sweep_dir):
        summary = job_dir / "summary.json"
        if summary.exists():
            row = json.loads(summary.read_text())
        else:
            overrides_file = job_dir / ".hydra" / "overrides.yaml"
            overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.exists() else []
            row = {"status": "crashed", "overrides": overrides, "error": "no summary.json (killed or hard crash)"}
        row.setdefault("job", job_dir.relative_to(sweep_dir).as_posix())
        if isinstance(row.get("overrides"), list):
            row["overrides"] = " ".join(row["overrides"])
        rows.append(row)

    def order(r: dict[str, Any]) -> tuple:
        job = str(r.get("job"))
        return (0, int(job), "") if job.isdigit() else (1, 0, job)

    return sorted(rows, key=order)


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_markdown(rows: list[dict[str, Any]], path: Path) -> None:
    cols = ["dp", "mp", "world_size", "status", "tokens_per_s", "samples_per_s", "params_per_rank", "peak_mem_mb",
            "final_loss", "final_val_loss"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def write_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Throughput and peak memory per layout (bar charts); skipped/failed layouts are labelled, not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"dp{r.get('dp', '?')}×mp{r.get('mp', '?')}" for r in rows]
    rate_key = "tokens_per_s" if any(r.get("tokens_per_s") for r in rows) else "samples_per_s"
    rates = [float(r.get(rate_key) or 0.0) for r in rows]
    mems = [float(r.get("peak_mem_mb") or 0.0) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(rows) + 4), 4))
    for ax, values, title in (
        (axes[0], rates, rate_key.replace("_per_s", "/s") + " (global)"),
        (axes[1], mems, "peak memory per rank (MB)"),
    ):
        bars = ax.bar(range(len(rows)), values, color=["C0" if r.get("status") == "ok" else "C7" for r in rows])
        for bar, r in zip(bars, rows):
            if r.get("status") != "ok":
                ax.annotate(str(r.get("status")), (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom")
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("lightning_dpmp layout sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class SweepSummary(Callback):
    """Writes ``summary.csv``, ``summary.md`` and ``summary.png`` into the sweep folder at the end of a multirun.

    Works with any Hydra launcher: it reads the ``summary.json`` each job wrote into its own folder. Exits the sweep
    process with status 1 when a job failed or crashed (skipped layouts do not count as failures).

    Args:
        filename: stem of the output files.
        plot: also write the PNG (needs matplotlib).
        fail_on_error: exit non-zero when any job failed.
    """

    def __init__(self, filename: str = "summary", plot: bool = True, fail_on_error: bool = True) -> None:
        self.filename = filename
        self.plot = plot
        self.fail_on_error = fail_on_error

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = collect_rows(sweep_dir)
        if not rows:
            log.warning(f"No job folders under {sweep_dir}; nothing to summarise.")
            return
        csv_path = sweep_dir / f"{self.filename}.csv"
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        write_markdown(rows, sweep_dir / f"{self.filename}.md")
        if self.plot:
            try:
                write_plot(rows, sweep_dir / f"{self.filename}.png")
            except ImportError as err:  # matplotlib is an optional dependency
                log.warning(f"Plot skipped: {err}")
        log.info(f"Sweep summary: {csv_path}\n{(sweep_dir / f'{self.filename}.md').read_text()}")
        failed = [r for r in rows if r.get("status") not in ("ok", "skipped")]
        if failed and self.fail_on_error:
            for r in failed:
                log.error(f"job {r.get('job')} ({r.get('overrides')}): {r.get('status')}: {r.get('error')}")
            log.error(f"{len(failed)} of {len(rows)} sweep jobs failed.")
            sys.exit(1)

    @staticmethod
    def configured(callbacks: Optional[Any]) -> bool:
        """Whether ``hydra.callbacks`` holds this callback (then train() may record a job failure and carry on)."""
        if not callbacks:
            return False
        targets = [str(c.get("_target_", "")) for c in callbacks.values() if c is not None]
        return any(t.endswith(".SweepSummary") for t in targets)
