"""One benchmark point: resolve the config, plan, run the passes, write results.json."""

from __future__ import annotations

import logging
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from backends.errors import BackendError, UserError
from backends.model.configs import cost_model_for
from backends.planning import plan_batch
from backends.registry import LOCKSTEP_BACKENDS
from backends.runtime.job import resolve_world_size
from harness.config import HarnessConfig, launcher_sets_world_size, resolve_config
from harness.results import OUTPUTS_FILE, PLAN_FILE, RESULTS_FILE, write_json_atomic, write_plan_json
from harness.roles import follow, leads
from harness.state import EXIT_FAILED, EXIT_OK, EXIT_USER_ERROR, STATE
from harness.tracking import Tracker, run_name, sweep_group
from harness.workload import make_examples, workload_lengths

log = logging.getLogger("harness")

def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers", "peft", "megatron-core", "hydra-core"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def _output_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _sweep_group():
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    return sweep_group(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None


def _overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task)


def base_document(cfg: DictConfig) -> dict[str, Any]:
    """The run's identity, read leniently so even an invalid config leaves a readable results.json."""

    def get(key: str) -> Any:
        try:
            return OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
        except Exception:
            return None

    return {
        "status": "running",
        "error": None,
        "backend": get("backend.name"),
        "world_size": get("backend.world_size"),
        "device": None,
        "model": {"name": get("model.name"), "path": get("model.path"), "lora_rank": get("model.lora_rank")},
        "mtpm": get("mtpm"),
        "mbs": get("mbs"),
        "layout": get("layout"),
        "planner": get("planner"),
        "gc": get("gc"),
        "bench": {"warmup": get("bench.warmup"), "repeat": get("bench.repeat")},
        "workload": {"name": get("workload.name")},
        "plan": None,
        "precision": None,  # the precision policy that ran: params, adapters, compute, reduce (backends/model/build.py)
        "passes": {},
        "peak": None,  # the device peak MFU is measured against (harness/flops.py)
        "overrides": _overrides(),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
    }


class Point:
    """One run of the benchmark, writing its results.json as it goes."""

    def __init__(self, cfg: DictConfig, out_dir: Path):
        self.cfg = cfg
        self.out_dir = out_dir
        self.doc = base_document(cfg)
        self.t0 = time.perf_counter()
        self.label = ""
        self.backend = None  # closed at the end of the point (not a hot sweep's shared one)
        self.hot = False
        self.vocab_size = 0
        self.tracker = None
        self.cost_model = None  # the planner's cost model (backends.planning.CostModel), from the model's config
        self.schedules = None  # the plan's micro-batches per rank

    def save(self) -> None:
        self.doc["wall_s"] = time.perf_counter() - self.t0
        write_json_atomic(self.out_dir / RESULTS_FILE, self.doc)

    def fail(self, status: str, message: str) -> None:
        self.doc["status"] = status
        self.doc["error"] = message
        self.save()

    def run(self) -> int:
        self.save()
        try:
            self._run(resolve_config(self.cfg))
        except UserError as exc:
            log.error("%s", exc)
            self.fail("error", str(exc))
            return EXIT_USER_ERROR
        except BackendError as exc:
            if self.hot:
                from harness.hot import HOT

                HOT.close()  # its workers are gone; the next point loads a fresh one
            log.error("%s%s", self.label, exc)
            if exc.details:
                (self.out_dir / "error.txt").write_text(exc.details)
            self.fail(exc.status, str(exc))
            # Running out of memory is a measurement (this budget does not fit), not a failure.
            return EXIT_OK if exc.status == "oom" else EXIT_FAILED
        except KeyboardInterrupt:
            log.error("%sinterrupted; finished passes are kept in %s", self.label, self.out_dir / RESULTS_FILE)
            self.fail("interrupted", "interrupted (Ctrl-C or SIGTERM) before the point finished")
            raise
        except Exception as exc:  # an internal failure: one line on the console, the traceback in the log
            log.error("%s%s: %s", self.label, type(exc).__name__, exc)
            log.debug("%s", traceback.format_exc())
            (self.out_dir / "error.txt").write_text(traceback.format_exc())
            self.fail("error", f"{type(exc).__name__}: {exc}")
            return EXIT_FAILED
        finally:
            if self.backend is not None:
                self.backend.close()
                self.backend = None
            if self.tracker is not None:
                self.tracker.finish(self.doc)
        return EXIT_OK

    def _run(self, spec: HarnessConfig) -> None:
        b = spec.backend
        mtpm, mbs = b.max_tokens_per_microbatch, b.micro_batch_size
        self.label = f"[{b.name} mtpm={mtpm} mbs={mbs}] "
        launcher_sets_world_size(b, _overrides())
        lengths = workload_lengths(spec.workload)
        if spec.dry_run:
            # torch is imported here, not at start-up, so a config error is reported at once.
            from backends.runtime.devices import device_description, resolve_device

            device = resolve_device(b.device)
            name, world_size = b.name, resolve_world_size(b.name, b.world_size, device.type)
            device_info = device_description(device, world_size)
            built = load = precision = None  # a dry run builds no model
        else:
            backend = self._start_backend(spec)
            name, world_size, device_info = backend.name, backend.world_size, backend.describe_device()
            built = backend.model_info
            precision = backend.precision
            load = backend.load_info
            if spec.target.url:
                mtpm, mbs = backend.batching  # what the server runs: its plan is authoritative
            self.label = f"[{name} mtpm={mtpm} mbs={mbs}] "
        self.cost_model = cost_model_for(spec.model)
        plan = plan_batch(
            lengths,
            world_size,
            mtpm,
            mbs,
            align=name in LOCKSTEP_BACKENDS,
            layout=b.layout,
            planner=b.planner,
            cost_model=self.cost_model,
        )
        self.schedules = plan.schedules  # the micro-batches each rank runs: hardware FLOPs are counted from them
        write_plan_json(self.out_dir / PLAN_FILE, plan.to_json(backend=name))
        from backends.runtime.job import launch_record

        self.doc.update(
            backend=name,
            world_size=world_size,
            launch=launch_record(world_size),  # who started the ranks: spawn (the harness), torchrun, slurm
            mtpm=mtpm,
            mbs=mbs,
            device=device_info,
            model={
                "name": spec.model.name,
                "path": spec.model.path,
                "lora_rank": spec.model.lora_rank,
                "dtype": spec.model.dtype,
                "built": built,  # what the backend reports it built: architecture, parameters, vocabulary, dtype
            },
            workload={
                "name": spec.workload.name,
                "n_examples": len(lengths),
                "total_tokens": sum(lengths),
                "min_len": min(lengths),
                "max_len": max(lengths),
                "seed": spec.workload.seed,
            },
            plan=plan.stats.as_dict(),
            # what the backend built runs in (params, adapters, compute, reduce); a dry run builds nothing
            precision=precision,
            load=load,  # how the backend loaded the weights: time and host/device peaks per rank
            hot=spec.hot and not spec.target.url,
            target={"url": spec.target.url} if spec.target.url else None,
        )
        st = plan.stats
        log.info(
            "%splan (%s, %s): %d examples, %s real / %s padded tokens, pad efficiency %.3f, micro-batches per rank %s, dummies %s",
            self.label,
            st.planner,
            st.layout,
            len(lengths),
            f"{st.real_tokens:,}",
            f"{st.padded_tokens:,}",
            st.pad_efficiency,
            st.n_microbatches,
            st.n_dummy,
        )
        log.info(
            "%s%d steps (fewest possible %d), %d micro-batches over budget, modeled cost per rank max/mean %.4f, critical path %.4f",
            self.label,
            st.steps,
            st.lower_bound_steps,
            st.over_budget,
            st.cost_imbalance,
            st.critical_path,
        )
        if spec.dry_run:
            self.doc["status"] = "planned"
            self.save()
            return
        self._measure(spec, lengths, backend)

    def _start_backend(self, spec: HarnessConfig):
        """A running server (client mode), the sweep's loaded backend (hot), or a new one (cold)."""
        b = spec.backend
        if spec.target.url:
            from harness.client import RemoteBackend

            self.backend = backend = RemoteBackend(spec.target.url, spec.target.timeout_s)
            backend.configure(b.max_tokens_per_microbatch, b.micro_batch_size)
            self.vocab_size = backend.vocab_size
            return backend
        from backends.model.build import model_vocab_size

        self.vocab_size = model_vocab_size(spec.model)
        if spec.hot:
            from harness.hot import HOT

            backend = HOT.get(b, spec.model)
            self.hot = True
            return backend
        from backends.start import make_backend

        log.info("%sstarting %s", self.label, b.name)
        self.backend = backend = make_backend(b, spec.model)
        return backend

    def _measure(self, spec: HarnessConfig, lengths: list[int], backend) -> None:
        from harness.flops import device_peak, flops_record, training_flops_for
        from harness.measure import PASS_TYPES, default_command_for, measure_pass

        b = spec.backend
        mtpm, mbs = b.max_tokens_per_microbatch, b.micro_batch_size
        examples = make_examples(lengths, self.vocab_size, spec.seed)
        self.save()
        self.tracker = Tracker(
            OmegaConf.to_container(self.cfg.logger, resolve=True) if self.cfg.get("logger") else None,
            self.out_dir,
            OmegaConf.to_container(self.cfg, resolve=True),
            run_name(backend.name, mtpm, mbs, b.planner, b.layout),
            _sweep_group(),
        )
        outputs: dict[str, Any] = {}
        command_for = default_command_for(
            examples,
            mtpm,
            mbs,
            layout=b.layout,
            planner=b.planner,
            cost_model=self.cost_model.as_dict(),
            progress_every_s=spec.bench.progress_every_s,
            timeout_s=spec.bench.pass_timeout_s,
        )
        # The device's peak for MFU: a data-sheet figure on GPUs, measured once per process on CPUs.
        self.doc["peak"] = device_peak(self.doc["device"] or {}, backend.world_size,
                                       (self.doc.get("precision") or {}).get("compute") or "float32")
        # FLOPs of a training pass: the config's matmuls, LoRA adapters and what backward computes for them.
        training = training_flops_for(spec.model, chunked_logprobs=b.logprob_chunk_tokens is not None)
        for pass_type in PASS_TYPES:
            record, result = measure_pass(
                backend,
                examples,
                pass_type,
                spec.bench.warmup,
                spec.bench.repeat,
                command_for,
                spec.bench.util_sample_s,
                label=self.label,
                on_repeat=self.tracker.log_repeat,
            )
            self.doc["plan"] = result.plan  # what the backend ran (same as planned; FSDP2 agrees on it by collective)
            from backends.model.kernels import summary as kernel_summary

            log.info("%s%s kernels: %s", self.label, pass_type, kernel_summary(result.kernels))
            self.doc["passes"][pass_type] = {
                **record.as_dict(),
                **flops_record(pass_type, lengths, training, result.plan, b.gradient_checkpointing,
                               record.elapsed_s, backend.world_size, self.doc["peak"], cost_model=self.cost_model,
                               schedules=self.schedules),
            }
            self.save()
            if spec.bench.save_outputs:
                outputs[pass_type] = {"loss": [o.loss for o in result.outputs]}
                if result.grad_norm is not None:
                    outputs[pass_type]["grad_norm"] = result.grad_norm
                write_json_atomic(self.out_dir / OUTPUTS_FILE, outputs)
        self.doc["status"] = "ok"
        self.doc["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.save()
        fwd, fb = self.doc["passes"]["forward"], self.doc["passes"]["forward_backward"]
        log.info(
            "%sok: forward %s tok/s, forward_backward %s tok/s, pad efficiency %.3f, MFU (fwd+bwd) %s",
            self.label,
            f"{fwd['tok_per_s']:,.0f}",
            f"{fb['tok_per_s']:,.0f}",
            self.doc["plan"]["pad_efficiency"],
            "—" if fb["mfu_pct"] is None else f"{fb['mfu_pct']:.2f}%",
        )


def _folder_key() -> str:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return "hydra.sweep.dir" if HydraConfig.get().mode == RunMode.MULTIRUN else "hydra.run.dir"


def skip_reason(cfg: DictConfig, out_dir: Path) -> str | None:
    """Why this point is not run (a finished result is kept); raises UserError for a folder it must not write."""
    from harness.points import check_run_folder, identity, read_result

    previous = read_result(out_dir)
    if previous is None:
        return None
    # The sweeper and the run-folder callback check this before anything is written; this
    # also covers other sweepers and launchers: never overwrite another point's result.
    check_run_folder(_folder_key(), out_dir, _overrides(), bool(cfg.get("resume")))
    point = " ".join(identity(_overrides())) or "this point"
    if previous.get("status") == "ok":
        return f"resume: {point} already ok in {out_dir}; skipped"
    if cfg.get("dry_run") and previous.get("status") != "planned":
        return f"resume: dry run; {point} keeps its {previous.get('status')} result in {out_dir}"
    return None


def run_point(cfg: DictConfig, job_spans_run: bool = False) -> int:
    """Hydra task function body: never raises for a failed point, records its exit code.

    In a launched job only the lead (global rank 0, harness/roles.py) measures and writes; it ends the
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
    out_dir = _output_dir()
    STATE.last_dir = out_dir
    try:
        skip = skip_reason(cfg, out_dir)
    except UserError as exc:
        log.error("%s", exc)
        STATE.record(EXIT_USER_ERROR)
        return EXIT_USER_ERROR
    if skip is not None:
        log.info("%s", skip)
        return EXIT_OK
    code = Point(cfg, out_dir).run()
    STATE.record(code)
    return code


__all__ = ["run_point"]
