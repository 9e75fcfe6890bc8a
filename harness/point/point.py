"""One benchmark point: start (or reuse) a backend, plan, measure each pass, record it in results.json.

``Point`` runs a point from start to end: its backend (a server's, the sweep's loaded one, or its own), the plan,
the passes measured and recorded. Its parts live beside it: what it runs on (harness/point/setup.py), plan sharing
(sharing.py), failures (failures.py), log lines (logs.py), W&B (tracking.py), the document (results.py); Hydra's task
function around it is harness/point/task.py; mtpm=auto's search, which uses a point's backend, plan and passes, is
harness/auto/run.py. The config it reads is resolved by harness/app/config.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig

from backends.errors import BackendError, UserError
from backends.model.configs import cost_model_for
from backends.registry import is_distributed, is_lockstep
from balance_batch import CostModel
from harness.app.config import AUTO, HarnessConfig, launcher_sets_world_size, resolve_config
from harness.app.state import EXIT_OK
from harness.data.workload import Workload, check_one_size, load_workload
from harness.metrics.balance import balance_fields
from harness.point import failures
from harness.point.logs import log_ok, log_plan
from harness.point.results import (
    OUTPUTS_FILE,
    SNAPSHOT_DIR,
    PointResults,
    base_document,
    write_json_atomic,
    write_plan_json,
)
from harness.point.setup import HydraRun, Setup, label, plan_for, setup_fields, slow_compile_warning
from harness.point.sharing import measured_earlier, measurement_key, take_measurement
from harness.point.tracking import start_tracker
from reports.plan_json import PLAN_FILE, plan_json

log = logging.getLogger("harness")


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
        self.cost_model = None  # the planner's cost model (balance_batch.CostModel), from the model's config
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
            return failures.user_error(self.results, exc)
        except BackendError as exc:
            return failures.backend_failed(self.results, self.out_dir, self.label, exc, self.hot)
        except KeyboardInterrupt:
            failures.interrupted(self.results, self.out_dir, self.label)
            raise
        except Exception as exc:  # noqa: BLE001 - any other failure is the point's result (error.txt), not a crash
            oom = failures.in_process_out_of_memory(self.cfg, exc)
            if oom is not None:
                return failures.backend_failed(self.results, self.out_dir, self.label, oom, self.hot)
            return failures.internal_error(self.results, self.out_dir, self.label, exc)
        finally:
            self._close()
        return EXIT_OK

    def _run(self, spec: HarnessConfig) -> None:
        b = spec.backend
        self.label = label(b.name, b.max_tokens_per_microbatch, b.micro_batch_size)
        launcher_sets_world_size(b, self.hydra_run.overrides)
        slow = slow_compile_warning(spec)
        if slow:
            log.warning("%s%s", self.label, slow)
        if not spec.dry_run and not spec.target.url and is_distributed(b.name):
            from backends.runtime.job import launch_env

            if launch_env() is None:  # ranks this process will start: their fork server imports meanwhile
                from backends.runtime.forkserver import start_early

                start_early(b.name)
        check_one_size(spec.workload, self.hydra_run.overrides)
        # A server's vocabulary is checked once it answers (self.examples), not against this config's model.
        self.workload = workload = load_workload(spec.workload, spec.model, check_vocabulary=not spec.target.url)
        lengths = workload.lengths
        if spec.mtpm == AUTO:
            from harness.auto.run import AutoRun

            AutoRun(self, spec, workload).run()
            return
        shared = None
        if spec.dry_run:
            if (spec.logger or {}).get("mode") == "online":  # the run goes on: a dry run is a check before the real one
                log.warning("%slogger.mode=online: a dry run starts no W&B run, so nothing is streamed (the same "
                            "command without dry_run=true streams)", self.label)
            backend, setup = None, Setup.dry_run(spec)
            setup.cost_model = self.planner_cost_model(spec, lengths, setup, None)
        else:
            shared = self._shared_measurement(spec, lengths)
            if shared is not None:
                backend, setup = None, shared[2]  # the plan is the one the shared point ran: no backend to ask
            else:
                backend = self._start_backend(spec)
                setup = Setup.of_backend(spec, backend)
                self.label = label(setup.name, setup.mtpm, setup.mbs)
                setup.cost_model = self.planner_cost_model(spec, lengths, setup, backend)
        plan = self.plan(spec, lengths, setup, planned=shared[3] if shared is not None else None)
        self.results.update(**setup_fields(spec, workload, setup, plan))
        log_plan(self.label, plan.stats, len(lengths), setup.max_seqs_per_microbatch)
        if spec.dry_run:
            self.results.mark("planned")
            return
        if self.measurement_key is None and self.sharing:  # a calibration measured just now: its plan is known now
            self.measurement_key = measurement_key(self.cfg, plan)
        self.results.update(measurement_key=self.measurement_key)
        if shared is not None:
            self._share(shared)
            return
        examples = None
        if spec.target.url:
            # the server's batching changes only once this run is known to run: its plan valid, its ids in vocabulary
            examples = self.examples(spec)
            backend.apply()
        self.measure(spec, lengths, backend, examples)

    # -- a plan measured earlier in the sweep (harness/point/sharing.py) ------------------------------
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
            setup.cost_model = self.planner_cost_model(spec, lengths, setup, None)
        except UserError:
            return None  # cost_model=calibrated with no fit yet: no earlier point can have measured this plan
        plan = plan_for(lengths, setup)
        self.measurement_key = measurement_key(self.cfg, plan)
        if not spec.bench.share_plans:
            return None
        earlier = measured_earlier(self.hydra_run.sweep_dir, self.out_dir, self.measurement_key)
        return (*earlier, setup, plan) if earlier is not None else None

    def _share(self, shared: tuple[Path, dict, Setup, Any]) -> None:
        """This point's record takes the measurements of ``shared`` (same plan, same setting); ``shares`` says whose."""
        folder, doc = shared[:2]
        take_measurement(self.results, self.out_dir, folder, doc, self.cfg.bench.save_outputs)
        log.info("%splans exactly as %s (mtpm=%s): shares its measurement (bench.share_plans=false measures it again)",
                 self.label, folder, doc.get("mtpm"))
        self.tracker = start_tracker(self.cfg, self.out_dir, self.hydra_run.group, self.results.doc)
        self.results.mark("ok")
        log_ok(self.label, self.results.doc)

    def _close(self) -> None:
        """Whatever the point ended with: its own backend closes (not a hot sweep's), its W&B run finishes."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self.tracker is not None:
            self.tracker.finish(self.results.doc)

    # -- the backend, the plan, the measurements (mtpm=auto's search uses them too) -------------------
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

    def planner_cost_model(self, spec: HarnessConfig, lengths: Sequence[int], setup: Setup, backend) -> CostModel:
        """The cost model the balanced planner balances: the setup's (FLOPs, or a server's own), or with
        ``cost_model=calibrated`` the fit for this backend, model, precision, device and layout
        (harness/metrics/calibration.py: this process's, the cache's, or measured on ``backend`` now). A dry run with
        no fit cached plans with FLOPs, says so in one warning, and records cost_model flops: it has no backend to
        calibrate on."""
        from harness.metrics.calibration import CALIBRATED, calibrated_cost_model, calibration_identity

        if spec.cost_model != CALIBRATED or spec.target.url:
            return setup.cost_model  # a client plans as its server does (Setup.of_backend warns when that differs)
        if setup.planner != "balanced":  # greedy and the peers plan by count and budget: no cost model enters
            # greedy: a calibrated sweep's mbs=1 baseline, said quietly; a peer typed beside it: a warning
            say = log.info if setup.planner == "greedy" else log.warning
            say("%scost_model=calibrated: the %s planner plans with no cost model, so nothing is calibrated "
                "(results.json: cost_model flops, the model its plan statistics use)", self.label, setup.planner)
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

    def plan(self, spec: HarnessConfig, lengths: list[int], setup: Setup, planned=None):
        """The workload planned for the backend's ranks (``planned``: already planned for ``setup``), written to
        plan.json."""
        self.cost_model = setup.cost_model
        plan = planned if planned is not None else plan_for(lengths, setup)
        self.schedules = plan.schedules  # the micro-batches each rank runs: hardware FLOPs are counted from them
        write_plan_json(self.out_dir / PLAN_FILE, plan_json(plan, backend=setup.name))
        return plan

    def examples(self, spec: HarnessConfig) -> list:
        """The point's examples: a dataset's real ids (checked against the vocabulary the backend has), else random
        ids."""
        owner = f"the server at {spec.target.url}" if spec.target.url else f"model {spec.model.name}"
        return self.workload.examples(self.vocab_size, spec.token_seed, owner)

    def command_for(self, spec: HarnessConfig, examples, mtpm: Optional[int], mbs: int, layout: str, planner: str):
        """The pass commands of one batching (the point's own, or a candidate's of mtpm=auto)."""
        from harness.measuring.measure import default_command_for

        b = spec.backend
        return default_command_for(
            examples, mtpm, mbs, layout=layout, planner=planner,
            cost_model=self.cost_model.as_dict(), max_seqs_per_microbatch=b.max_seqs_per_microbatch,
            progress_every_s=spec.bench.progress_every_s,
            timeout_s=spec.bench.pass_timeout_s,
        )

    def measure(self, spec: HarnessConfig, lengths: list[int], backend, examples=None, command_for=None,
                 measured: Optional[dict] = None) -> None:
        """Every pass type, warm-up and timed repeats (harness/measuring/measure.py), each recorded as it finishes.

        ``measured`` maps a pass type to a (record, result) already measured with these commands (mtpm=auto's
        chosen fwd+bwd, with its ``bench.repeat`` timed runs): recorded, not measured again.
        """
        from harness.measuring.measure import PASS_TYPES, measure_pass, profile_pass
        from harness.metrics.flops import device_peak, training_flops_for

        b = spec.backend
        if examples is None:
            examples = self.examples(spec)
        self.results.save()
        if self.tracker is None:
            self.tracker = start_tracker(self.cfg, self.out_dir, self.hydra_run.group, self.results.doc)
        outputs: dict[str, Any] = {}
        if command_for is None:
            command_for = self.command_for(spec, examples, b.max_tokens_per_microbatch, b.micro_batch_size,
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
                                              pairing=self.pairing(spec, examples, pass_type))
            self._record_pass(spec, lengths, training, backend.world_size, pass_type, record, result)
            if spec.bench.profile:  # one more run under the profiler, after the timed ones: not in tok/s
                self.results.doc["passes"][pass_type]["profile"] = profile_pass(
                    backend, pass_type, command_for, self.out_dir, timed_s=record.elapsed_s, label=self.label,
                    steps=spec.bench.profile_steps, ranks=spec.bench.profile_ranks, memory=spec.bench.profile_memory)
                self.results.save()
            if spec.bench.save_outputs:
                outputs[pass_type] = _example_outputs(result)
                write_json_atomic(self.out_dir / OUTPUTS_FILE, outputs)
        self.results.mark("ok")
        log_ok(self.label, doc)

    def pairing(self, spec: HarnessConfig, examples, pass_type: str, mtpm: Any = "point"):
        """The mbs=1 baseline a fwd+bwd pass is measured beside (bench.paired), or None: another pass type, the
        baseline itself, a client run (its server plans every pass with the budget the server holds)."""
        from harness.measuring.runner import Pairing

        doc = self.results.doc
        mtpm, mbs = (doc.get("mtpm"), doc.get("mbs")) if mtpm == "point" else (mtpm, 1)
        if pass_type != "forward_backward" or not spec.bench.paired or spec.target.url:
            return None
        if mtpm is None and mbs == 1:
            return None
        return Pairing(self.command_for(spec, examples, None, 1, "padded", "greedy"), point=(mtpm, mbs))

    def _record_pass(self, spec: HarnessConfig, lengths: list[int], training, world_size: int, pass_type: str,
                     record, result) -> None:
        """One pass type's measurements and FLOPs into results.json."""
        from balance_batch.integrations.transformers.kernels import summary as kernel_summary
        from harness.metrics.flops import flops_record

        # what the backend ran (same as planned; FSDP2 agrees on it by collective); a peer planner's record stays
        peer = (self.results.doc.get("plan") or {}).get("peer")
        self.results.update(plan={**result.plan, **({"peer": peer} if peer else {})})
        log.info("%s%s kernels: %s", self.label, pass_type, kernel_summary(result.kernels))
        flops = flops_record(pass_type, lengths, training, result.plan, spec.backend.gradient_checkpointing,
                             record.elapsed_s, world_size, self.results.doc["peak"], cost_model=self.cost_model,
                             schedules=self.schedules)
        flops = self._checked_mfu(flops, pass_type, world_size)
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

    def _checked_mfu(self, flops: dict, pass_type: str, world_size: int) -> dict:
        """An MFU over 100% measures the CPU's peak again (the passes recorded already are recomputed against it), or
        is recorded as null with why (harness/metrics/flops.py's checked_mfu)."""
        from harness.metrics.flops import checked_mfu, device_peak_again

        doc = self.results.doc
        compute = (doc.get("precision") or {}).get("compute") or "float32"
        flops, peak, warning = checked_mfu(flops, doc["peak"],
                                           lambda: device_peak_again(doc["device"] or {}, world_size, compute))
        if warning:
            log.warning("%s%s: %s", self.label, pass_type, warning)
        if peak is not doc["peak"]:
            log.info("%speak measured again: %s", self.label, peak["source"])
            doc["peak"] = peak
            for earlier in doc["passes"].values():
                if earlier.get("mfu_pct") is not None and peak.get("flops_per_device"):
                    earlier["mfu_pct"] = 100.0 * earlier["model_flops_per_s_per_device"] / peak["flops_per_device"]
        return flops

    def _prediction_models(self, spec: HarnessConfig) -> dict:
        """The cost models whose predictions of the measured micro-batch times a pass records: the FLOP model, and
        the calibrated one the plan used (if it did)."""
        planned = self.cost_model
        if planned is not None and planned.fit is not None:
            return {"flops": cost_model_for(spec.model), "calibrated": planned}
        return {"flops": planned or cost_model_for(spec.model)}


def _example_outputs(result) -> dict[str, Any]:
    """example_outputs.json's entry for one pass type: per-example losses, and the gradient norm if there is one."""
    out: dict[str, Any] = {"loss": [o.loss for o in result.outputs]}
    if result.grad_norm is not None:
        out["grad_norm"] = result.grad_norm
    return out
