"""W&B runs: one per benchmark point, its files in the point's output folder, grouped by sweep.

Everything logged here is also in results.json (the source of truth), so a W&B
failure is a warning, never a lost measurement.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("harness.tracking")  # the log channel's name, kept when the module moved


def _flatten(prefix: str, value: Any, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    elif isinstance(value, (int, float, str, bool)) or value is None:
        out[prefix] = value
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        out[prefix] = list(value)


def summary_metrics(doc: dict) -> dict:
    """results.json's measurements under the same names, '/'-separated (W&B groups panels by prefix)."""
    out: dict = {"status": doc.get("status"), "error": doc.get("error")}
    _flatten("passes", doc.get("passes") or {}, out)
    _flatten("plan", doc.get("plan") or {}, out)
    _flatten("workload", doc.get("workload") or {}, out)
    _flatten("precision", doc.get("precision") or {}, out)  # params, adapters, compute, reduce, grads
    auto = doc.get("auto")
    if isinstance(auto, dict):  # mtpm=auto: the answer, the limit, the model and each candidate by its budget
        _flatten("auto", {k: v for k, v in auto.items() if k != "candidates"}, out)
        _flatten("auto/candidates", {str(c.get("mtpm")): c for c in auto.get("candidates") or []}, out)
    if isinstance(doc.get("speedup"), dict):  # fwd+bwd over mbs=1, measured in pairs: median, interval, each pair
        _flatten("speedup", doc["speedup"], out)
    if isinstance(doc.get("shares"), dict):  # this point's plan was measured by another point of the sweep
        _flatten("shares", doc["shares"], out)
    out["wall_s"] = doc.get("wall_s")
    return out


def run_name(
    backend: Optional[str], mtpm: Optional[int], mbs: Optional[int], planner: str = "greedy", layout: str = "padded",
    max_seqs: Optional[int] = None, cost_model: Optional[str] = None,
) -> str:
    name = f"{backend}-mtpm{mtpm}" if mtpm is not None else f"{backend}-mbs{mbs}"
    # the original greedy padded defaults, with no cap on sequences and the FLOP model, keep the names runs always had
    name += "".join(f"-{v}" for v, default in ((planner, "greedy"), (layout, "padded")) if v != default)
    name += f"-seqs{max_seqs}" if max_seqs is not None else ""
    return name + ("-calibrated" if cost_model == "calibrated" else "")


def sweep_group(sweep_dir: Optional[str]) -> Optional[str]:
    """A multirun's group name from its folder (multirun/2026-11-29/08-12-00 -> 2026-11-29_08-12-00)."""
    if not sweep_dir:
        return None
    parts = Path(sweep_dir).parts[-2:]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "_".join(parts)) or None


class Tracker:
    """A W&B run for one point, or nothing when the logger is off or W&B fails to start."""

    def __init__(self, logger_cfg: Optional[dict], out_dir: Path, config: dict, name: str, group: Optional[str]):
        self.run = None
        self.out_dir = Path(out_dir)
        cfg = dict(logger_cfg or {})
        mode = cfg.get("mode") or "disabled"
        if cfg.get("name") in (None, "none") or mode == "disabled":
            return
        from backends.runtime.memory import outside_the_data_limit

        try:
            # The pytorch backend's limit holds this process: W&B is imported (its shared objects mapped) and
            # started beside it
            with outside_the_data_limit():
                import wandb

                self.run = wandb.init(
                    project=cfg.get("project") or "balance-batch",
                    entity=cfg.get("entity"),
                    mode=mode,
                    dir=str(out_dir),
                    group=cfg.get("group") or group,
                    name=name,
                    job_type=cfg.get("job_type") or "benchmark",
                    tags=list(cfg.get("tags") or []),
                    config=config,
                    reinit="finish_previous",
                    settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
                )
        except Exception as exc:  # noqa: BLE001 - results.json still holds everything
            log.warning("W&B run not started (%s: %s); results.json is unaffected", type(exc).__name__, exc)
            self.run = None

    def log_repeat(
        self, pass_type: str, repeat: int, elapsed_s: float, tok_per_s: float, util_pct: Optional[float]
    ) -> None:
        if self.run is None:
            return
        self._safe(
            self.run.log,
            {
                f"repeats/{pass_type}/elapsed_s": elapsed_s,
                f"repeats/{pass_type}/tok_per_s": tok_per_s,
                f"repeats/{pass_type}/util_pct": util_pct,
                f"repeats/{pass_type}/index": repeat,
            },
        )

    def finish(self, doc: dict) -> None:
        """Write the summary and close the run, whatever the point's status."""
        if self.run is None:
            return
        run, self.run = self.run, None
        self._safe(self._log_plan, run)
        self._safe(self._log_timeline, run, doc)
        self._safe(self._log_profile, run)
        self._safe(run.summary.update, summary_metrics(doc))
        self._safe(run.finish, exit_code=0 if doc.get("status") in ("ok", "planned") else 1)

    def _log_plan(self, run) -> None:
        """The plan figure (plan.png beside plan.json in the point's folder) as the run's "plan/figure" image."""
        plan = self.out_dir / "plan.json"
        if not plan.is_file():
            return
        import wandb

        from reports.plan_figure import draw_plan_file

        png = draw_plan_file(plan, self.out_dir / "plan.png")
        run.log({"plan/figure": wandb.Image(str(png))})  # beside the plan/* numbers in W&B's plan section

    @staticmethod
    def _log_timeline(run, doc: dict) -> None:
        """Each pass's step times (passes.<type>.timeline) as a table "timeline/<type>": a row per repeat, rank and
        step with its wall and busy seconds, for W&B's own charts."""
        import wandb

        for pass_type, rec in (doc.get("passes") or {}).items():
            tl = rec.get("timeline") if isinstance(rec, dict) else None
            if not isinstance(tl, dict):
                continue
            rows = [[rep, rank, step, t, b]
                    for rep, (steps, busy) in enumerate(zip(tl["step_s"], tl["busy_s"]))
                    for rank, (rank_steps, rank_busy) in enumerate(zip(steps, busy))
                    for step, (t, b) in enumerate(zip(rank_steps, rank_busy))]
            run.log({f"timeline/{pass_type}": wandb.Table(columns=["repeat", "rank", "step", "step_s", "busy_s"],
                                                          data=rows)})

    def _log_profile(self, run) -> None:
        """bench.profile's traces (profile/<pass>-rank<r>.json.gz) as the run's artifact of type "profile"."""
        folder = self.out_dir / "profile"
        traces = sorted(folder.glob("*.json.gz")) if folder.is_dir() else []
        if not traces:
            return
        import wandb

        artifact = wandb.Artifact(f"profile-{run.id}", type="profile",
                                  description="torch.profiler traces, one per pass type and rank (ui.perfetto.dev)")
        for trace in traces:
            artifact.add_file(str(trace), name=trace.name)
        run.log_artifact(artifact)

    @staticmethod
    def _safe(fn, *args, **kwargs) -> None:
        from backends.runtime.memory import outside_the_data_limit

        try:
            with outside_the_data_limit():  # as wandb.init: finishing may start threads, never to hang on one
                fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - W&B is a copy: results.json holds everything
            log.warning("W&B: %s failed (%s: %s)", getattr(fn, "__name__", "call"), type(exc).__name__, exc)


def start_tracker(cfg, out_dir: Path, group: Optional[str], doc: dict[str, Any]) -> Tracker:
    """The point's W&B run (or none: the logger off, or W&B failing to start)."""
    from omegaconf import OmegaConf

    from harness.app.config import without_auto

    return Tracker(
        OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else None,
        out_dir,
        OmegaConf.to_container(without_auto(cfg), resolve=True),
        # what runs (a server's)
        run_name(doc["backend"], doc["mtpm"], doc["mbs"], doc["planner"], doc["layout"],
                 doc.get("max_seqs_per_microbatch"), doc.get("cost_model"))
        + ("-auto" if doc.get("auto") else ""),
        group,
    )
