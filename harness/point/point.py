"""One benchmark point, Hydra's task function: start (or reuse) a backend, plan, measure each pass, record it in
results.json.

``run_point`` is the task function's body (harness/__main__.py): in a
launched job only the lead measures (harness/app/roles.py); a finished point is
skipped on resume; else a ``Point`` runs and its exit code is recorded for the
CLI (harness/app/state.py). The document it writes is harness/point/results.py's, the
config it reads is resolved by harness/app/config.py.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from backends.errors import BackendError, UserError
from backends.model.configs import cost_model_for
from backends.planning import CostModel, plan_batch
from backends.planning.plan import PLAN_FILE
from backends.registry import LOCKSTEP_BACKENDS, is_distributed, is_lockstep
from backends.runtime.job import resolve_world_size
from harness.app.batching import KEYS, without_batching
from harness.app.config import AUTO, HarnessConfig, launcher_sets_world_size, resolve_config, without_auto
from harness.app.roles import follow, leads, tell_launcher
from harness.app.state import EXIT_FAILED, EXIT_OK, EXIT_USER_ERROR, STATE
from harness.data.workload import Workload, load_workload
from harness.metrics.balance import balance_fields
from harness.point.results import (
    OUTPUTS_FILE,
    RESULTS_FILE,
    SNAPSHOT_DIR,
    PointResults,
    base_document,
    model_record,
    workload_record,
    write_json_atomic,
    write_plan_json,
)
from harness.point.tracking import Tracker, run_name, sweep_group

log = logging.getLogger("harness")


@dataclass(frozen=True)
class HydraRun:
    """What Hydra says of the point it is running: its folder, its overrides, and the sweep it belongs to."""

    out_dir: Path
    overrides: list[str]
    folder_key: str  # the config key that names the folder: hydra.run.dir, or hydra.sweep.dir in a multirun
    group: Optional[str]  # the sweep's W&B group (None for a single run)
    sweep_dir: Optional[Path] = None  # a multirun's folder (None for a single run)

    @classmethod
    def current(cls) -> "HydraRun":
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        return cls(
            out_dir=Path(hc.runtime.output_dir),
            overrides=list(hc.overrides.task),
            folder_key="hydra.sweep.dir" if multirun else "hydra.run.dir",
            group=sweep_group(hc.sweep.dir) if multirun else None,
            sweep_dir=Path(hc.sweep.dir) if multirun else None,
        )


@dataclass
class Setup:
    """What a point runs on: the backend's name, ranks, device, batching, and what it built (None in a dry run)."""

    name: str
    world_size: int
    device: Any
    mtpm: Optional[int]
    mbs: int
    layout: str
    planner: str
    cost_model: CostModel  # the planner's cost model, from the model's config (a server's: the one it plans with)
    max_seqs_per_microbatch: Optional[int] = None  # the cap on sequences per micro-batch (a server's: its own)
    built: Optional[dict] = None
    precision: Optional[dict] = None
    load: Optional[dict] = None
    threads_per_rank: Optional[int] = None  # compute threads each rank ran with on CPU (None: a GPU, a dry run)

    @classmethod
    def dry_run(cls, spec: HarnessConfig) -> "Setup":
        """A dry run builds no model: the device and the ranks the backend would run."""
        b = spec.backend
        # torch is imported here, not at start-up, so a config error is reported at once.
        from backends.runtime.devices import device_description, resolve_device

        device = resolve_device(b.device)
        world_size = resolve_world_size(b.name, b.world_size, device.type)
        return cls(b.name, world_size, device_description(device, world_size),
                   b.max_tokens_per_microbatch, b.micro_batch_size, b.layout, b.planner, cost_model_for(spec.model),
                   max_seqs_per_microbatch=b.max_seqs_per_microbatch)

    @classmethod
    def of_backend(cls, spec: HarnessConfig, backend) -> "Setup":
        """What a started backend reports; a server's batching and planning are authoritative (its plan is what
        runs)."""
        b = spec.backend
        mtpm, mbs, layout, planner = b.max_tokens_per_microbatch, b.micro_batch_size, b.layout, b.planner
        cap = b.max_seqs_per_microbatch
        served_cost = None
        if spec.target.url:
            mtpm, mbs = backend.batching
            layout, planner = backend.layout or layout, backend.planner or planner
            # None is a cap of its own ("none"): a server too old to report one plans without it.
            cap = backend.max_seqs_per_microbatch
            if (layout, planner, cap) != (b.layout, b.planner, b.max_seqs_per_microbatch):
                log.warning("the server at %s plans with planner=%s layout=%s max_seqs_per_microbatch=%s (fixed for "
                            "its life): this run records those, not planner=%s layout=%s max_seqs_per_microbatch=%s",
                            spec.target.url, planner, layout, _null(cap), b.planner, b.layout,
                            _null(b.max_seqs_per_microbatch))
            served_cost = backend.cost_model
            served = "calibrated" if (served_cost or {}).get("coefficients") else "flops"
            if served != spec.cost_model:
                log.warning("the server at %s plans with cost_model=%s (fixed for its life): this run records that, "
                            "not cost_model=%s", spec.target.url, served, spec.cost_model)
        cost_model = CostModel.from_dict(served_cost) if served_cost else cost_model_for(spec.model)
        return cls(backend.name, backend.world_size, backend.describe_device(), mtpm, mbs, layout, planner,
                   cost_model, max_seqs_per_microbatch=cap, built=backend.model_info, precision=backend.precision,
                   load=backend.load_info, threads_per_rank=getattr(backend, "threads_per_rank", None))


def plan_for(lengths: Sequence[int], setup: Setup, mtpm: Any = "setup"):
    """The workload planned as ``setup``'s backend runs it (``mtpm``: another budget than the setup's)."""
    budget = setup.mtpm if mtpm == "setup" else mtpm
    return plan_batch(lengths, setup.world_size, budget, setup.mbs, align=setup.name in LOCKSTEP_BACKENDS,
                      layout=setup.layout, planner=setup.planner, cost_model=setup.cost_model,
                      max_seqs_per_microbatch=setup.max_seqs_per_microbatch)


def slow_compile_warning(spec: HarnessConfig) -> Optional[str]:
    """One line when ``backend.compile=true`` will run in float32 on a CPU: of every form of this run the slowest
    (minutes of compiling in the warm-up, for the precision a GPU run does not use); None otherwise."""
    b = spec.backend
    if not b.compile or spec.dry_run or spec.target.url:
        return None
    import torch

    from backends.model.build import resolve_dtype
    from backends.runtime.devices import resolve_device

    device = resolve_device(b.device)
    if device.type != "cpu" or resolve_dtype(spec.model.dtype, device) != torch.float32:
        return None
    return ("backend.compile=true in float32 on CPU: the slowest form of this run (the warm-up compiles for minutes, "
            "in a precision GPU runs do not use); model.dtype=bfloat16 measures the published precision, "
            "backend.compile=false skips compiling")


def _null(value: Optional[int]) -> str:
    """A knob's value as the command line spells it (None is null)."""
    return "null" if value is None else str(value)


def _label(name: str, mtpm: Optional[int], mbs: int) -> str:
    """The prefix of a point's log lines."""
    return f"[{name} mtpm={mtpm} mbs={mbs}] "


class Point:
    """One run of the benchmark: start a backend, plan, measure each pass type; results.json written as it goes."""

    def __init__(self, cfg: DictConfig, hydra_run: HydraRun):
        self.cfg = cfg
        self.hydra_run = hydra_run
        self.out_dir = hydra_run.out_dir
        self.results = PointResults(self.out_dir, base_document(cfg, hydra_run.overrides))
        self.label = ""
        self.backend = None  # closed at the end of the point (not a hot sweep's shared one)
        self.hot = False
        self.vocab_size = 0
        self.workload: Optional[Workload] = None  # the point's lengths and, from a dataset, its real examples
        self.tracker = None
        self.cost_model = None  # the planner's cost model (backends.planning.CostModel), from the model's config
        self.schedules = None  # the plan's micro-batches per rank
        self.measurement_key = None  # what its measurement depends on (a multirun shares identical plans by it)
        self.sharing = False  # whether this point may share (and be shared): a sweep's, not a client's or launched

    # -- the point from start to end ------------------------------------------------------------
    def run(self) -> int:
        """The point's exit code; whatever happens, results.json says how it ended."""
        self.results.save()
        try:
            self._run(resolve_config(self.cfg))
        except UserError as exc:
            return self._user_error(exc)
        except BackendError as exc:
            return self._backend_failed(exc)
        except KeyboardInterrupt:
            self._interrupted()
            raise
        except Exception as exc:  # noqa: BLE001 - any other failure is the point's result (error.txt), not a crash
            return self._internal_error(exc)
        finally:
            self._close()
        return EXIT_OK

    def _run(self, spec: HarnessConfig) -> None:
        b = spec.backend
        self.label = _label(b.name, b.max_tokens_per_microbatch, b.micro_batch_size)
        launcher_sets_world_size(b, self.hydra_run.overrides)
        slow = slow_compile_warning(spec)
        if slow:
            log.warning("%s%s", self.label, slow)
        if not spec.dry_run and not spec.target.url and is_distributed(b.name):
            from backends.runtime.job import launch_env

            if launch_env() is None:  # ranks this process will start: their fork server imports meanwhile
                from backends.runtime.forkserver import start_early

                start_early()
        # A server's vocabulary is checked once it answers (self._examples), not against this config's model.
        self.workload = workload = load_workload(spec.workload, spec.model, check_vocabulary=not spec.target.url)
        lengths = workload.lengths
        if spec.mtpm == AUTO:
            self._run_auto(spec, workload)
            return
        shared = None
        if spec.dry_run:
            backend, setup = None, Setup.dry_run(spec)
            setup.cost_model = self._planner_cost_model(spec, lengths, setup, None)
        else:
            shared = self._shared_measurement(spec, lengths)
            if shared is not None:
                backend, setup = None, shared[2]  # the plan is the one the shared point ran: no backend to ask
            else:
                backend = self._start_backend(spec)
                setup = Setup.of_backend(spec, backend)
                self.label = _label(setup.name, setup.mtpm, setup.mbs)
                setup.cost_model = self._planner_cost_model(spec, lengths, setup, backend)
        plan = self._plan(spec, lengths, setup, planned=shared[3] if shared is not None else None)
        self.results.update(**_setup_fields(spec, workload, setup, plan))
        _log_plan(self.label, plan.stats, len(lengths), setup.max_seqs_per_microbatch)
        if spec.dry_run:
            self.results.mark("planned")
            return
        if self.measurement_key is None and self.sharing:  # a calibration measured just now: its plan is known now
            self.measurement_key = measurement_key(self.cfg, plan)
        self.results.update(measurement_key=self.measurement_key)
        if shared is not None:
            self._share(shared)
            return
        self._measure(spec, lengths, backend)

    # -- mtpm=auto: the fastest budget that fits (harness/auto/model.py) --------------------------------------
    def _run_auto(self, spec: HarnessConfig, workload: Workload) -> None:
        """Search the budgets on one loaded backend; the point's record is then the chosen budget's, with ``auto``."""
        from harness.auto.model import PlanningProgress, candidates_of, memory_limit, power_of_two_budgets, search

        if spec.target.url:
            raise UserError("mtpm: auto searches on a backend it starts itself; against a server (target.url) set "
                            "mtpm to a number, or run the search without target.url")
        self.label = f"[{spec.backend.name} mtpm=auto] "
        lengths = workload.lengths
        setup = Setup.dry_run(spec) if spec.dry_run else None
        # Ranks that cannot start under bench.memory_limit_gb are the search's first result, not its end: every
        # candidate would start the same ranks, so each is recorded out of memory with that start-up's message.
        start_failed: list[BackendError] = []
        if setup is None and spec.hot:
            self._release_hot_backend()
        if setup is None:
            try:
                setup = Setup.of_backend(spec, self._start_own_backend(spec))
            except BackendError as exc:
                if exc.status != "oom":
                    raise
                start_failed.append(exc)
                setup = Setup.dry_run(spec)
        setup.cost_model = self._planner_cost_model(spec, lengths, setup, self.backend)
        self.cost_model = setup.cost_model
        budgets = power_of_two_budgets(lengths, setup.world_size, setup.layout)
        progress = PlanningProgress(self.label, budgets, len(lengths), spec.bench.progress_every_s)
        cands = candidates_of(lengths, budgets, lambda m: plan_for(lengths, setup, m), setup.layout,
                              on_planned=progress)
        limit, source = memory_limit(spec.bench.memory_limit_gb, setup.device or {}, setup.world_size,
                                     spec.bench.memory_headroom)
        headroom = spec.bench.memory_headroom  # applied to the device's memory; limit_source says which limit ruled
        log.info("%smtpm=auto: %d distinct plans (%s) on %s, %s; limit %.2f GiB per rank (%s)", self.label, len(cands),
                 ", ".join(str(c.mtpm) for c in cands), setup.name, f"{setup.planner} {setup.layout}", limit / 2**30,
                 source)
        auto: dict[str, Any] = {"candidates": [c.as_dict() for c in cands], "memory_model": None, "headroom": headroom,
                                "limit_bytes": limit, "limit_source": source, "baseline": None, "chosen": None}
        self.results.update(backend=setup.name, world_size=setup.world_size, device=setup.device,
                            planner=setup.planner, layout=setup.layout,
                            workload=workload_record(spec.workload, lengths, workload.file, workload.dataset),
                            auto=auto)
        if spec.dry_run:
            self.results.mark("planned")
            return
        examples = self._examples(spec)
        runs: dict[Optional[int], tuple] = {}  # what each measured budget gave (None: the mbs=1 baseline)

        def save() -> None:
            auto["candidates"] = [c.as_dict() for c in cands]
            self.results.save()

        def measure(mtpm: Optional[int]):
            from harness.auto.model import Measured
            from harness.measuring.measure import measure_pass

            layout, planner = (setup.layout, setup.planner) if mtpm is not None else ("padded", "greedy")
            if self.backend is None:  # started when there is something to measure, not after the last failure
                if start_failed:
                    return Measured("oom", error=str(start_failed[0]))
                try:
                    self._start_own_backend(spec)
                except BackendError as exc:
                    if exc.status != "oom":
                        raise
                    start_failed.append(exc)
                    return Measured("oom", error=str(exc))
            command_for = self._command_for(spec, examples, mtpm, 1, layout, planner)
            pairing = self._pairing(spec, examples, "forward_backward", mtpm=mtpm)
            if pairing is not None:
                pairing.warm = False  # the baseline ran first, warm: each candidate pays for its own warm-up only
            try:
                record, result = measure_pass(self.backend, examples, "forward_backward", spec.bench.warmup, 1,
                                              command_for, spec.bench.util_sample_s, label=_label(setup.name, mtpm, 1),
                                              pairing=pairing)
            except BackendError as exc:
                if exc.status != "oom":
                    raise
                log.info("%sout of memory: a result; the search goes on below it", _label(setup.name, mtpm, 1))
                if self.backend.failure() is not None:  # its ranks are gone: the next candidate starts fresh ones
                    self.backend.close()
                    self.backend = None
                return Measured("oom", error=str(exc))
            runs[mtpm] = (record, result)
            peaks = [p for p in record.mem_peak_bytes or [] if p is not None]
            speed = record.spread_fields().get("speedup")  # the candidate's pair ratio: what the search ranks by
            return Measured("ok", record.tok_per_s, max(peaks) if peaks else None,
                            speedup=speed["median"] if speed else None)

        base = measure(None)
        auto["baseline"] = {"mbs": 1, "planner": "greedy", "layout": "padded", "status": base.status,
                            "tok_per_s": base.tok_per_s, "peak_bytes": base.peak_bytes, "error": base.error}
        save()
        kernels = runs[None][1].kernels if None in runs else None
        quadratic = "eager" in ((kernels or {}).get("attention") or {})  # scores materialised: memory ~ length^2
        longest = max(lengths)
        found = search(cands, lambda c: measure(c.mtpm), limit, quadratic=quadratic,
                       baseline_point=(longest, longest * longest, base.peak_bytes) if base.peak_bytes else None,
                       on_candidate=lambda c: (save(), _log_candidate(self.label, c, limit)))
        auto.update(found.as_dict(headroom, source), baseline=auto["baseline"])
        chosen = found.chosen
        if chosen is None:
            smallest = cands[0] if cands else None
            save()
            raise BackendError(
                f"mtpm=auto: no budget fits in {limit / 2**30:.2f} GiB per rank ({source})"
                + (f"; the smallest, mtpm={smallest.mtpm}, ended {smallest.status}" if smallest else "")
                + (f": {smallest.reason}" if smallest and smallest.reason else ""), status="oom",
                details=start_failed[0].details if start_failed else None)
        chosen = self._settle_lead(spec, examples, setup, cands, chosen, runs, auto)
        save()
        self._record_auto_choice(spec, workload, setup, chosen, examples, runs)
        _log_answer(self.label, self.results.doc)

    def _settle_lead(self, spec: HarnessConfig, examples, setup: Setup, cands, chosen, runs, auto: dict):
        """The two fastest candidates, measured in pairs, get more pairs while their intervals overlap
        (harness/auto/lead.py); returns the candidate chosen, ``auto.tie`` saying what it tied with and the rule."""
        from harness.auto.lead import Leader, settle
        from harness.measuring.measure import measure_pass, merge_records

        auto["tie"] = None
        fitting = [c for c in cands if c.status == "ok" and c.speedup is not None and c.mtpm in runs]
        if len(fitting) < 2:
            return chosen
        top = sorted(fitting, key=lambda c: (c.speedup, c is chosen), reverse=True)[:2]

        def pairs_of(mtpm: int) -> list[float]:
            return runs[mtpm][0].spread_fields()["speedup"]["pairs"]

        def more(lead: Leader, n: int) -> list[float]:
            record = runs[lead.mtpm][0]
            if self.backend is None:  # a larger candidate ran out of memory and took the ranks with it
                self._start_own_backend(spec)
            extra, result = measure_pass(
                self.backend, examples, "forward_backward", 0, n,
                self._command_for(spec, examples, lead.mtpm, 1, setup.layout, setup.planner), spec.bench.util_sample_s,
                label=_label(setup.name, lead.mtpm, 1), release_first=False,
                pairing=self._pairing(spec, examples, "forward_backward", mtpm=lead.mtpm))
            runs[lead.mtpm] = (merge_records(record, extra), result)
            return pairs_of(lead.mtpm)

        settled = settle([Leader(c.mtpm, c.measured_peak_bytes, pairs_of(c.mtpm)) for c in top], more,
                         spec.bench.repeat, spec.bench.max_repeats)
        for c in top:
            c.speedup = runs[c.mtpm][0].spread_fields()["speedup"]["median"]
        auto.update(candidates=[c.as_dict() for c in cands], chosen=settled.chosen.mtpm, tie=settled.as_dict())
        shown = ", ".join(f"mtpm={lead.mtpm} {lead.option()['median']:.2f}×" + (
            f" ({lead.option()['ci'][0]:.2f}–{lead.option()['ci'][1]:.2f})" if lead.option()["ci"] else "")
            for lead in [settled.chosen, *settled.tied])
        if settled.tied:
            log.info("%smtpm=auto: the leaders cannot be told apart after %d pairs each (%s): they tie; mtpm=%d chosen "
                     "for %s", self.label, settled.pairs, shown, settled.chosen.mtpm, settled.rule)
        elif settled.pairs < 2:
            log.info("%smtpm=auto: mtpm=%d leads on one pair each (%s): bench.repeat=1 gives no interval to tell the "
                     "leaders apart", self.label, settled.chosen.mtpm, shown)
        else:
            log.info("%smtpm=auto: mtpm=%d leads clearly after %d pairs each (%s)", self.label, settled.chosen.mtpm,
                     settled.pairs, ", ".join(f"mtpm={c.mtpm} {c.speedup:.2f}×" for c in top))
        return next(c for c in top if c.mtpm == settled.chosen.mtpm)

    def _record_auto_choice(self, spec: HarnessConfig, workload: Workload, setup: Setup, chosen, examples,
                            runs) -> None:
        """The chosen budget's record, as any point's: its plan, its fwd+bwd topped up to ``bench.repeat`` timed
        runs (after the one the search made), and its forward pass."""
        from harness.measuring.measure import measure_pass, merge_records

        setup.mtpm = spec.backend.max_tokens_per_microbatch = chosen.mtpm
        self.label = _label(setup.name, setup.mtpm, setup.mbs)
        if self.backend is None:  # a larger candidate ran out of memory and took the ranks with it
            self._start_own_backend(spec)
        plan = self._plan(spec, lengths := workload.lengths, setup)
        self.results.update(**_setup_fields(spec, workload, setup, plan))
        command_for = self._command_for(spec, examples, chosen.mtpm, 1, setup.layout, setup.planner)
        record, result = runs[chosen.mtpm]
        if spec.bench.repeat > len(record.elapsed_s):
            pairing = self._pairing(spec, examples, "forward_backward", mtpm=chosen.mtpm)
            more, result = measure_pass(self.backend, examples, "forward_backward", 0,
                                        spec.bench.repeat - len(record.elapsed_s), command_for,
                                        spec.bench.util_sample_s, label=self.label, release_first=False,
                                        target_ci_pct=spec.bench.target_ci_pct, max_repeats=spec.bench.max_repeats,
                                        pairing=pairing)
            record = merge_records(record, more)
        self._measure(spec, lengths, self.backend, examples, command_for,
                      measured={"forward_backward": (record, result)})

    def _release_hot_backend(self) -> None:
        """A hot sweep's loaded backend is closed before mtpm=auto starts its own: the search measures each budget's
        peak against the limit with its ranks alone on the device, not beside idle ranks holding a model (whose
        memory no limit accounts for). The sweep's next point loads the hot backend again; this one records
        ``hot: false``, the backend it ran on being its own."""
        from harness.sweep.hot import HOT

        if HOT.backend is not None:
            log.info("%shot: the sweep's loaded %s is released first, so the search's ranks are alone under the "
                     "memory limit; the next point loads it again", self.label, HOT.backend.name)
        HOT.close()

    def _start_own_backend(self, spec: HarnessConfig):
        """A backend for this point alone (mtpm=auto sets each candidate's budget in its commands, not a control
        file)."""
        from backends.model.build import model_vocab_size
        from backends.start import make_backend

        self.vocab_size = model_vocab_size(spec.model)
        log.info("%sstarting %s", self.label, spec.backend.name)
        self.backend = make_backend(spec.backend, spec.model)
        return self.backend

    # -- a plan measured earlier in the sweep ----------------------------------------------------------
    def _shared_measurement(self, spec: HarnessConfig, lengths: list[int]) -> Optional[tuple[Path, dict, Setup, Any]]:
        """An earlier point of this sweep that measured the same plan in the same setting: (its folder, its results,
        and this point's dry-run setup and plan, so the point does not plan twice).

        The key is the plan's micro-batches and layout with everything else the point runs (model, workload, ranks,
        precision, bench protocol): two budgets that plan identically run the same steps, so the second one shares
        the first's measurement (bench.share_plans=false measures it again). Client runs (a server's plan) and
        launched jobs measure every point.
        """
        self.measurement_key = None
        self.sharing = False
        if self.hydra_run.sweep_dir is None or spec.target.url:
            return None
        from backends.runtime.job import launched_job

        if launched_job() is not None:
            return None
        self.sharing = True
        setup = Setup.dry_run(spec)
        try:
            setup.cost_model = self._planner_cost_model(spec, lengths, setup, None)
        except UserError:
            return None  # cost_model=calibrated with no fit yet: no earlier point can have measured this plan
        plan = plan_for(lengths, setup)
        self.measurement_key = measurement_key(self.cfg, plan)
        if not spec.bench.share_plans:
            return None
        from harness.sweep.points import read_result, result_files

        for path in result_files(self.hydra_run.sweep_dir):
            if path.parent == self.out_dir:
                continue
            doc = read_result(path.parent)
            if doc and doc.get("status") == "ok" and doc.get("measurement_key") == self.measurement_key \
                    and not doc.get("shares"):
                return path.parent, doc, setup, plan
        return None

    def _share(self, shared: tuple[Path, dict, Setup, Any]) -> None:
        """This point's record takes the measurements of ``shared`` (same plan, same setting); ``shares`` says whose."""
        folder, doc = shared[:2]
        for key in ("device", "precision", "load", "threads_per_rank", "peak", "launch", "passes", "speedup"):
            if key in doc:
                self.results.update(**{key: doc[key]})
        for measured in (self.results.doc.get("passes") or {}).values():  # bench.profile: the traces stay in its folder
            if isinstance(measured, dict) and isinstance(measured.get("profile"), dict):
                measured["profile"] = {**measured["profile"], "traces": [
                    os.path.relpath(folder / t, self.out_dir) for t in measured["profile"]["traces"]]}
        self.results.update(model={**self.results.doc["model"], "built": (doc.get("model") or {}).get("built")})
        # whose measurement: its folder and batching (the plan, not the cost model that made it, is what is shared)
        self.results.update(shares={"folder": folder.name, **{k: doc.get(k) for k in KEYS if k != "cost_model"}})
        if (folder / OUTPUTS_FILE).is_file() and self.cfg.bench.save_outputs:  # the same steps: the same outputs
            write_json_atomic(self.out_dir / OUTPUTS_FILE, json.loads((folder / OUTPUTS_FILE).read_text()))
        log.info("%splans exactly as %s (mtpm=%s): shares its measurement (bench.share_plans=false measures it again)",
                 self.label, folder, doc.get("mtpm"))
        self.tracker = _start_tracker(self.cfg, self.out_dir, self.hydra_run.group, self.results.doc)
        self.results.mark("ok")
        _log_ok(self.label, self.results.doc)

    # -- how a point fails: one line on the console, the status and the message in results.json --------
    def _user_error(self, exc: UserError) -> int:
        log.error("%s", exc)
        tell_launcher(str(exc))
        self.results.fail("error", str(exc))
        return EXIT_USER_ERROR

    def _backend_failed(self, exc: BackendError) -> int:
        if self.hot:
            from harness.sweep.hot import HOT

            HOT.close()  # its workers are gone; the next point loads a fresh one
        log.error("%s%s", self.label, exc)
        if exc.status != "oom":
            tell_launcher(f"{self.label}{exc}")
        if exc.details:
            (self.out_dir / "error.txt").write_text(exc.details)
        # bench.memory_snapshot: what held the memory
        snapshots = sorted((self.out_dir / SNAPSHOT_DIR).glob("*.pickle"))
        if snapshots:
            self.results.update(memory_snapshot=[os.path.relpath(p, self.out_dir) for p in snapshots])
        self.results.fail(exc.status, str(exc))
        # Running out of memory is a measurement (this budget does not fit), not a failure.
        return EXIT_OK if exc.status == "oom" else EXIT_FAILED

    def _interrupted(self) -> None:
        log.error("%sinterrupted; finished passes are kept in %s", self.label, self.out_dir / RESULTS_FILE)
        self.results.fail("interrupted", "interrupted (Ctrl-C or SIGTERM) before the point finished")

    def _internal_error(self, exc: Exception) -> int:
        """An internal failure: one line on the console, the traceback in the log and in error.txt."""
        log.error("%s%s: %s", self.label, type(exc).__name__, exc)
        log.debug("%s", traceback.format_exc())
        (self.out_dir / "error.txt").write_text(traceback.format_exc())
        self.results.fail("error", f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED

    def _close(self) -> None:
        """Whatever the point ended with: its own backend closes (not a hot sweep's), its W&B run finishes."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self.tracker is not None:
            self.tracker.finish(self.results.doc)

    # -- the backend, the plan, the measurements ---------------------------------------------------
    def _start_backend(self, spec: HarnessConfig):
        """A running server (client mode), the sweep's loaded backend (hot), or a new one (cold)."""
        b = spec.backend
        if spec.target.url:
            from harness.server.client import RemoteBackend

            self.backend = backend = RemoteBackend(spec.target.url, spec.target.timeout_s)
            backend.configure(b.max_tokens_per_microbatch, b.micro_batch_size)
            self.vocab_size = backend.vocab_size
            return backend
        from backends.model.build import model_vocab_size

        self.vocab_size = model_vocab_size(spec.model)
        if spec.hot:
            from harness.sweep.hot import HOT

            backend = HOT.get(b, spec.model)
            self.hot = True
            return backend
        from backends.start import make_backend

        log.info("%sstarting %s", self.label, b.name)
        self.backend = backend = make_backend(b, spec.model)
        return backend

    def _planner_cost_model(self, spec: HarnessConfig, lengths: Sequence[int], setup: Setup, backend) -> CostModel:
        """The cost model the balanced planner balances: the setup's (FLOPs, or a server's own), or with
        ``cost_model=calibrated`` the fit for this backend, model, precision, device and layout
        (harness/metrics/calibration.py: this process's, the cache's, or measured on ``backend`` now). A dry run with
        no fit cached plans with FLOPs, says so in one warning, and records cost_model flops: it has no backend to
        calibrate on."""
        from harness.metrics.calibration import CALIBRATED, calibrated_cost_model, calibration_identity

        if spec.cost_model != CALIBRATED or spec.target.url:
            return setup.cost_model  # a client plans as its server does (Setup.of_backend warns when that differs)
        if setup.planner == "greedy":  # it fills micro-batches by count and budget: no cost model enters its plan
            log.info("%scost_model=calibrated: the greedy planner plans with no cost model, so nothing is calibrated "
                     "(results.json: cost_model flops, the model its plan statistics use)", self.label)
            return setup.cost_model
        ident = calibration_identity(spec, setup.name, setup.world_size, setup.device, max(lengths))
        try:
            return calibrated_cost_model(spec.calibration, ident, backend, self.vocab_size or None, label=self.label,
                                         progress_every_s=spec.bench.progress_every_s,
                                         timeout_s=spec.bench.pass_timeout_s)
        except UserError as exc:
            if backend is not None or not spec.dry_run:
                raise
            log.warning("%s%s; this dry run plans with the FLOP model instead (results.json: cost_model flops)",
                        self.label, exc)
            return setup.cost_model

    def _plan(self, spec: HarnessConfig, lengths: list[int], setup: Setup, planned=None):
        """The workload planned for the backend's ranks (``planned``: already planned for ``setup``), written to
        plan.json."""
        self.cost_model = setup.cost_model
        plan = planned if planned is not None else plan_for(lengths, setup)
        self.schedules = plan.schedules  # the micro-batches each rank runs: hardware FLOPs are counted from them
        write_plan_json(self.out_dir / PLAN_FILE, plan.to_json(backend=setup.name))
        return plan

    def _examples(self, spec: HarnessConfig) -> list:
        """The point's examples: a dataset's real ids (checked against the vocabulary the backend has), else random
        ids."""
        owner = f"the server at {spec.target.url}" if spec.target.url else f"model {spec.model.name}"
        return self.workload.examples(self.vocab_size, spec.seed, owner)

    def _command_for(self, spec: HarnessConfig, examples, mtpm: Optional[int], mbs: int, layout: str, planner: str):
        """The pass commands of one batching (the point's own, or a candidate's of mtpm=auto)."""
        from harness.measuring.measure import default_command_for

        b = spec.backend
        return default_command_for(
            examples, mtpm, mbs, layout=layout, planner=planner,
            cost_model=self.cost_model.as_dict(), max_seqs_per_microbatch=b.max_seqs_per_microbatch,
            progress_every_s=spec.bench.progress_every_s,
            timeout_s=spec.bench.pass_timeout_s,
        )

    def _measure(self, spec: HarnessConfig, lengths: list[int], backend, examples=None, command_for=None,
                 measured: Optional[dict] = None) -> None:
        """Every pass type, warm-up and timed repeats (harness/measuring/measure.py), each recorded as it finishes.

        ``measured`` maps a pass type to a (record, result) already measured with these commands (mtpm=auto's
        chosen fwd+bwd, with its ``bench.repeat`` timed runs): recorded, not measured again.
        """
        from harness.measuring.measure import PASS_TYPES, measure_pass, profile_pass
        from harness.metrics.flops import device_peak, training_flops_for

        b = spec.backend
        if examples is None:
            examples = self._examples(spec)
        self.results.save()
        if self.tracker is None:
            self.tracker = _start_tracker(self.cfg, self.out_dir, self.hydra_run.group, self.results.doc)
        outputs: dict[str, Any] = {}
        if command_for is None:
            command_for = self._command_for(spec, examples, b.max_tokens_per_microbatch, b.micro_batch_size,
                                            b.layout, b.planner)
        doc = self.results.doc
        # The device's peak for MFU: a data-sheet figure on GPUs, measured once per process on CPUs.
        doc["peak"] = device_peak(doc["device"] or {}, backend.world_size,
                                  (doc.get("precision") or {}).get("compute") or "float32")
        # FLOPs of a training pass: the config's matmuls, LoRA adapters and what backward computes for them.
        training = training_flops_for(spec.model, chunked_logprobs=b.logprob_chunk_tokens is not None)
        snapshot_dir = str((self.out_dir / SNAPSHOT_DIR).resolve()) if spec.bench.memory_snapshot else None
        for pass_type in PASS_TYPES:
            if pass_type in (measured or {}):
                record, result = measured[pass_type]
            else:
                record, result = measure_pass(backend, examples, pass_type, spec.bench.warmup, spec.bench.repeat,
                                              command_for, spec.bench.util_sample_s, label=self.label,
                                              on_repeat=self.tracker.log_repeat, snapshot_dir=snapshot_dir,
                                              target_ci_pct=spec.bench.target_ci_pct,
                                              max_repeats=spec.bench.max_repeats,
                                              pairing=self._pairing(spec, examples, pass_type))
            self._record_pass(spec, lengths, training, backend.world_size, pass_type, record, result)
            if spec.bench.profile:  # one more run under the profiler, after the timed ones: not in tok/s
                self.results.doc["passes"][pass_type]["profile"] = profile_pass(
                    backend, pass_type, command_for, self.out_dir, timed_s=record.elapsed_s, label=self.label)
                self.results.save()
            if spec.bench.save_outputs:
                outputs[pass_type] = _example_outputs(result)
                write_json_atomic(self.out_dir / OUTPUTS_FILE, outputs)
        self.results.mark("ok")
        _log_ok(self.label, doc)

    def _pairing(self, spec: HarnessConfig, examples, pass_type: str, mtpm: Any = "point"):
        """The mbs=1 baseline a fwd+bwd pass is measured beside (bench.paired), or None: another pass type, the
        baseline itself, a client run (its server plans every pass with the budget the server holds)."""
        from harness.measuring.measure import Pairing

        doc = self.results.doc
        mtpm, mbs = (doc.get("mtpm"), doc.get("mbs")) if mtpm == "point" else (mtpm, 1)
        if pass_type != "forward_backward" or not spec.bench.paired or spec.target.url:
            return None
        if mtpm is None and mbs == 1:
            return None
        return Pairing(self._command_for(spec, examples, None, 1, "padded", "greedy"), point=(mtpm, mbs))

    def _record_pass(self, spec: HarnessConfig, lengths: list[int], training, world_size: int, pass_type: str,
                     record, result) -> None:
        """One pass type's measurements and FLOPs into results.json."""
        from backends.model.kernels import summary as kernel_summary
        from harness.metrics.flops import flops_record

        # what the backend ran (same as planned; FSDP2 agrees on it by collective)
        self.results.update(plan=result.plan)
        log.info("%s%s kernels: %s", self.label, pass_type, kernel_summary(result.kernels))
        flops = flops_record(pass_type, lengths, training, result.plan, spec.backend.gradient_checkpointing,
                             record.elapsed_s, world_size, self.results.doc["peak"], cost_model=self.cost_model,
                             schedules=self.schedules)
        balance = balance_fields(record.timeline, self.schedules, lengths, result.plan.get("layout", "padded"),
                                 is_lockstep(self.results.doc["backend"]), self._prediction_models(spec))
        if pass_type == "forward_backward":  # the point's speedup over mbs=1, measured in pairs (None: unpaired)
            speed = record.spread_fields().get("speedup")
            self.results.update(speedup={"pass_type": pass_type, **speed} if speed else None)
        self.results.record_pass(pass_type, {**record.as_dict(), **flops, **balance})
        if balance:
            log.info("%s%s balance: critical path %.3f measured (%.3f modeled), idle per rank %s measured",
                     self.label, pass_type, balance["measured_critical_path"], result.plan.get("critical_path", 1.0),
                     ", ".join(f"{100 * x:.1f}%" for x in balance["idle_fraction"]))

    def _prediction_models(self, spec: HarnessConfig) -> dict:
        """The cost models whose predictions of the measured micro-batch times a pass records: the FLOP model, and
        the calibrated one the plan used (if it did)."""
        planned = self.cost_model
        if planned is not None and planned.fit is not None:
            return {"flops": cost_model_for(spec.model), "calibrated": planned}
        return {"flops": planned or cost_model_for(spec.model)}


# What a point's config says of how it is run and logged (its batching aside): not part of what it measures.
_NOT_MEASURED = ("hydra", "logger", "resume", "dry_run", "hot")


def measurement_key(cfg: DictConfig, plan) -> str:
    """What a measurement depends on: the config less its batching knobs, and the plan's micro-batches and layout."""
    import hashlib

    conf = OmegaConf.to_container(without_auto(cfg), resolve=True, throw_on_missing=False)
    conf = {k: v for k, v in without_batching(conf).items() if k not in _NOT_MEASURED}
    conf["backend"] = conf.get("backend") or {}
    conf["bench"] = {k: v for k, v in (conf.get("bench") or {}).items() if k not in ("baseline", "share_plans")}
    what = {"config": conf, "layout": plan.stats.layout, "schedules": plan.schedules}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _setup_fields(spec: HarnessConfig, workload: Workload, setup: Setup, plan) -> dict[str, Any]:
    """results.json's record of what the point runs: the backend, its ranks and device, the model, workload and plan."""
    from backends.runtime.job import launch_record

    return dict(
        backend=setup.name,
        world_size=setup.world_size,
        launch=launch_record(setup.world_size),  # who started the ranks: spawn (the harness), torchrun, slurm
        # how the batch was cut (a client's: the server's, what ran); cost_model: the plan's, whose numbers are in
        # plan.cost_model
        **{key: getattr(setup, key) for key in KEYS if key != "cost_model"},
        cost_model="calibrated" if setup.cost_model.fit is not None else "flops",
        device=setup.device,
        model=model_record(spec.model, setup.built),
        workload=workload_record(spec.workload, workload.lengths, workload.file, workload.dataset),
        plan=plan.stats.as_dict(),
        # what the backend built runs in (params, adapters, compute, reduce); a dry run builds nothing
        precision=setup.precision,
        load=setup.load,  # how the backend loaded the weights: time and host/device peaks per rank
        threads_per_rank=setup.threads_per_rank,  # what ran (backends.runtime.devices.threads_per_rank's rule)
        hot=spec.hot and not spec.target.url and spec.mtpm != AUTO,  # mtpm=auto runs on a backend of its own
        target={"url": spec.target.url} if spec.target.url else None,
    )


def _start_tracker(cfg: DictConfig, out_dir: Path, group: Optional[str], doc: dict[str, Any]) -> Tracker:
    """The point's W&B run (or none: the logger off, or W&B failing to start)."""
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


def _example_outputs(result) -> dict[str, Any]:
    """example_outputs.json's entry for one pass type: per-example losses, and the gradient norm if there is one."""
    out: dict[str, Any] = {"loss": [o.loss for o in result.outputs]}
    if result.grad_norm is not None:
        out["grad_norm"] = result.grad_norm
    return out


def _log_ok(label: str, doc: dict[str, Any]) -> None:
    """The point's last line: throughput of both pass types, pad efficiency and MFU."""
    fwd, fb = doc["passes"]["forward"], doc["passes"]["forward_backward"]
    log.info(
        "%sok: forward %s tok/s, forward_backward %s tok/s, pad efficiency %.3f, MFU (fwd+bwd) %s",
        label,
        f"{fwd['tok_per_s']:,.0f}",
        f"{fb['tok_per_s']:,.0f}",
        doc["plan"]["pad_efficiency"],
        "—" if fb["mfu_pct"] is None else f"{fb['mfu_pct']:.2f}%",
    )


def _log_candidate(label: str, c, limit: int) -> None:
    """mtpm=auto's progress: one line per candidate as the search settles it."""
    gib = lambda n: "—" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
    speed = f", {c.tok_per_s:,.0f} tok/s fwd+bwd" if c.tok_per_s else ""
    predicted = f" (predicted {gib(c.predicted_peak_bytes)}, {c.prediction})" if c.predicted_peak_bytes else ""
    peak = f", peak {gib(c.measured_peak_bytes)}{predicted}" if c.measured_peak_bytes else predicted
    shown = c.status == "ok" or (c.status == "over_limit" and c.reason and c.reason.startswith("predicted"))
    why = f" ({c.reason})" if c.reason and not shown else ""
    log.info("%smtpm=auto: mtpm=%d %s%s%s, limit %s%s", label, c.mtpm, c.status, speed, peak, gib(limit), why)


def _log_answer(label: str, doc: dict[str, Any]) -> None:
    """mtpm=auto's last line: the answer, as the report's first line says it (the paired speedup results.json holds,
    with its interval; the ratio to the search's own mbs=1 run only where nothing was paired, and called unpaired)."""
    auto = doc["auto"]
    fb = doc["passes"]["forward_backward"]
    base = (auto.get("baseline") or {}).get("tok_per_s")
    paired = doc.get("speedup") if isinstance(doc.get("speedup"), dict) else None
    ci = (paired or {}).get("ci")
    if paired is not None and paired.get("median") is not None:
        speed = paired["median"]
        interval = f", 95% interval {ci[0]:.2f}–{ci[1]:.2f}" if ci else ""
        versus = f"{speed:.2f}× mbs=1 ({len(paired.get('pairs') or [])} pairs{interval})"
    elif base:
        speed = fb["tok_per_s"] / base
        versus = f"{speed:.2f}× mbs=1 (unpaired)"
    else:
        speed, versus = None, "no mbs=1 run"
    peaks = [p for p in fb.get("mem_peak_bytes") or [] if p is not None]
    if ci and ci[0] <= 1.0 <= ci[1]:
        verdict = "; not told apart from mbs=1 here (its interval holds 1.0)"
    elif speed is not None and speed < 1:
        verdict = "; mbs=1 ran faster: no budget pays here"
    else:
        verdict = ""
    log.info("%s%s: set mtpm=%d (%s, %s): %s tok/s fwd+bwd, %s, peak %s of %.1f GiB%s%s", label, doc["backend"],
             doc["mtpm"], doc["planner"], doc["layout"], f"{fb['tok_per_s']:,.0f}", versus,
             f"{max(peaks) / 2**30:.1f} GiB" if peaks else "unknown", auto["limit_bytes"] / 2**30, verdict,
             _tie_phrase(auto.get("tie")))


def _tie_phrase(tie: Optional[dict]) -> str:
    """"; ties with mtpm=32768 (...): chosen by ..." when the leading budgets could not be told apart, else ""."""
    from harness.metrics.spread import tie_text

    if not tie:
        return ""
    return "; " + tie_text([f"mtpm={m}" for m in tie["with"]], tie["rule"], tie.get("pairs"))


def _log_plan(label: str, st, n_examples: int, max_seqs: Optional[int] = None) -> None:
    """Two lines on what the plan is: tokens and padding, then steps and the modeled cost."""
    log.info(
        "%splan (%s, %s%s): %d examples, %s real / %s padded tokens, pad efficiency %.3f, "
        "micro-batches per rank %s, dummies %s",
        label,
        st.planner,
        st.layout,
        "" if max_seqs is None else f", at most {max_seqs} sequences per micro-batch",
        n_examples,
        f"{st.real_tokens:,}",
        f"{st.padded_tokens:,}",
        st.pad_efficiency,
        st.n_microbatches,
        st.n_dummy,
    )
    log.info(
        "%s%d steps (fewest possible %d), %d micro-batches over budget, "
        "modeled cost per rank max/mean %.4f, critical path %.4f",
        label,
        st.steps,
        st.lower_bound_steps,
        st.over_budget,
        st.cost_imbalance,
        st.critical_path,
    )


def skip_reason(cfg: DictConfig, hydra_run: HydraRun) -> str | None:
    """Why this point is not run (a finished result is kept); raises UserError for a folder it must not write."""
    from harness.sweep.points import check_run_folder, identity, read_result

    out_dir = hydra_run.out_dir
    previous = read_result(out_dir)
    if previous is None:
        return None
    # The sweeper and the run-folder callback check this before anything is written; this
    # also covers other sweepers and launchers: never overwrite another point's result.
    check_run_folder(hydra_run.folder_key, out_dir, hydra_run.overrides, bool(cfg.get("resume")))
    point = " ".join(identity(hydra_run.overrides)) or "this point"
    if previous.get("status") == "ok":
        return f"resume: {point} already ok in {out_dir}; skipped"
    if cfg.get("dry_run") and previous.get("status") != "planned":
        return f"resume: dry run; {point} keeps its {previous.get('status')} result in {out_dir}"
    return None


def run_point(cfg: DictConfig, job_spans_run: bool = False) -> int:
    """Hydra task function body: never raises for a failed point, records its exit code.

    In a launched job only the lead (global rank 0, harness/app/roles.py) measures and writes; it ends the
    job after this point unless ``job_spans_run`` (``python -m harness`` itself is the job's rank 0 and
    ends it after the last point; under submitit each point's Hydra job is the whole job).
    """
    if not leads():
        # Under submitit every task runs this Hydra job; only global rank 0 measures and writes.
        return follow()
    from backends.runtime.job import end_after_failure, launched_job

    job = launched_job()
    if job is None:
        return _run_point(cfg)
    try:
        code = _run_point(cfg)
        end_after_failure(code)  # a failed launched job runs no more points: every rank ends now
        return code
    finally:
        if not job_spans_run:
            job.finish()


def _run_point(cfg: DictConfig) -> int:
    hydra_run = HydraRun.current()
    STATE.last_dir = hydra_run.out_dir
    try:
        skip = skip_reason(cfg, hydra_run)
    except UserError as exc:
        log.error("%s", exc)
        STATE.record(EXIT_USER_ERROR)
        return EXIT_USER_ERROR
    if skip is not None:
        log.info("%s", skip)
        return EXIT_OK
    code = Point(cfg, hydra_run).run()
    STATE.record(code)
    return code


__all__ = ["run_point"]
