"""Plain PyTorch backend: one process, one device; sorts by length and returns outputs by original position."""

from __future__ import annotations

import logging
import math
import time
import traceback
from typing import Optional

import torch

from backends.backend import Backend
from backends.errors import BackendError, first_line
from backends.messages import PassCommand, PassResult
from backends.model import compiling
from backends.model.build import build_model, describe_model, describe_precision, load_method
from backends.model.loading import LoadMeter, merge_load_records
from backends.model.step import (
    PassTimeout,
    ProgressLogger,
    grad_norm_local_sq,
    outputs_to_host,
    run_steps,
    synchronize,
    total_loss_weight,
)
from backends.runtime.devices import resolve_device, use_threads_per_rank
from backends.runtime.job import resolve_world_size
from backends.runtime.memory import (
    MemoryHistory,
    data_segment_bytes,
    footprint,
    is_out_of_memory,
    limit_memory,
    near_the_limit,
    oom_message,
    peak_memory,
    release_cached_memory,
    reset_peak_memory,
    restore_memory_limit,
)
from backends.runtime.profiling import profiled
from backends.runtime.timeline import StepClock, busy_clock, step_clock_name
from backends.specs import BackendSpec, ModelSpec
from balance_batch.integrations.transformers import kernels

log = logging.getLogger(__name__)


class PyTorchBackend(Backend):
    name = "pytorch"

    def __init__(self, spec: BackendSpec, model: ModelSpec):
        super().__init__(spec, model)
        self.world_size = resolve_world_size(self.name, spec.world_size, "cpu")
        self.device = resolve_device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(0)
        self._previous_limit = self._limit_memory()
        # One rank in this process: its threads by the rule every backend's ranks follow; put back at close.
        self._previous_threads = torch.get_num_threads()
        if self.device.type == "cpu":
            self.threads_per_rank = use_threads_per_rank(1)
        try:
            with LoadMeter(self.device) as meter:
                self.model = build_model(model, self.device, spec.gradient_checkpointing)
            self.model_info = describe_model(self.model, model)
            if spec.compile:
                compiling.compile_decoder_layers(self.model, spec.compile_eager_fallback)
            self.model_info["compile"] = compiling.describe(self.model) if spec.compile else None
            self.precision = describe_precision(self.model, None)  # one process: nothing reduced
            self.load_info = merge_load_records(load_method(model), [meter.as_dict()])
        except BaseException as exc:
            restore_memory_limit(self._previous_limit)
            torch.set_num_threads(self._previous_threads)
            if is_out_of_memory(exc):  # a result, as the other backends' ranks report it
                raise BackendError(f"out of memory in start-up (bench.memory_limit_gb={spec.memory_limit_gb:g}): "
                                   f"{first_line(str(exc), 200) or type(exc).__name__} while building the model",
                                   status="oom") from None
            raise

    def _limit_memory(self):
        """bench.memory_limit_gb on this process, which is also the harness's: what building the model imports is
        imported first (under the limit an import fails with an empty MemoryError, or a library's unchecked
        allocation crashes the process), and a limit below what the process holds already is an out of memory at
        once, not a limit applied to the harness."""
        limit_gb = self.spec.memory_limit_gb
        if limit_gb is None or self.device.type != "cpu":
            return limit_memory(limit_gb, self.device)
        import peft  # noqa: F401 - imported before the limit (above)
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: F401 - as above

        held = data_segment_bytes()
        if near_the_limit(held, limit_gb * 1024**3):
            raise BackendError(f"out of memory in start-up: bench.memory_limit_gb={limit_gb:g} is less than this "
                               f"process holds before the model ({held / 1024**3:.2f} GiB: the pytorch backend runs "
                               "in the harness's own process, whose imports count); give it more, or use a "
                               "distributed backend, whose ranks are limited alone", status="oom")
        return limit_memory(limit_gb, self.device)

    def _run_pass(self, command: PassCommand) -> PassResult:
        examples = command.examples
        pass_type = command.pass_type
        plan = command.plan(world_size=1, lockstep=False)
        reset_peak_memory(self.device, release=command.release_memory)
        if pass_type == "forward_backward":
            self.model.zero_grad(set_to_none=True)
        progress = ProgressLogger(
            log.info, f"pytorch {pass_type}", plan.stats.real_tokens, command.progress_every_s
        )
        total_weight = total_loss_weight(examples)
        with (
            profiled(command.profile_dir, pass_type, 0, self.device, len(plan.schedules[0]), command.profile_steps,
                     command.profile_ranks, command.profile_memory) as profile,
            compiling.PassMeter(self.model) as compiled,
        ):
            pending, grad_norm, step_s, timeline = self._timed_steps(command, plan, progress, total_weight,
                                                                     profile.step)
        mem = peak_memory(self.device)
        ran = kernels.snapshot()
        by_index = outputs_to_host(pending, examples)
        del pending
        return PassResult(
            outputs=[by_index[i] for i in range(len(examples))],
            plan=plan.stats.as_dict(),
            grad_norm=grad_norm,
            mem_peak_bytes=mem["peak_bytes"],
            mem_peak_bytes_per_rank=[mem["peak_bytes"]],
            mem_peak_allocated_bytes_per_rank=None if mem["allocated_bytes"] is None else [mem["allocated_bytes"]],
            mem_peak_reserved_bytes_per_rank=None if mem["reserved_bytes"] is None else [mem["reserved_bytes"]],
            step_s=step_s,
            kernels=ran,
            profile=[profile] if profile else None,
            compile=compiling.merge([compiled.record]),
            timeline={"step_clock": step_clock_name(self.device), "busy_clock": busy_clock(self.device, lockstep=False),
                      "per_rank": [timeline]},
        )

    def _timed_steps(self, command: PassCommand, plan, progress, total_weight, on_step_end=None):
        """The timed region: the steps, the gradient norm, the device synchronized (an out of memory raised after)."""
        examples, pass_type, timeout_s = command.examples, command.pass_type, command.timeout_s
        oom = None
        clock = StepClock(self.device, on_step_end=on_step_end)
        t0, cpu0 = time.perf_counter(), time.process_time()
        clock.start()
        try:
            # an out of memory leaves it with the failed step's tensors still held: the snapshot shows them
            with MemoryHistory(command.memory_snapshot_dir, pass_type, 0, self.device):
                pending = run_steps(
                    self.model,
                    examples,
                    plan.schedules[0],
                    pass_type,
                    total_weight,
                    self.device,
                    progress=progress,
                    deadline=None if timeout_s is None else time.monotonic() + timeout_s,
                    layout=command.layout,
                    logprob_chunk_tokens=command.chunk_tokens(self.spec.logprob_chunk_tokens),
                    clock=clock,
                )
        except PassTimeout as exc:
            raise BackendError(f"{exc} (bench.pass_timeout_s={timeout_s:g})", status="timeout") from None
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            oom = oom_message(pass_type, "", plan.stats.max_microbatch_padded_tokens, self.spec.memory_limit_gb, exc)
            traceback.clear_frames(exc.__traceback__)  # the failed step's locals (its activations) let go now
        if oom is not None:
            # Raised out here, once the failed step's frames (and their tensors) are gone; what they held is handed
            # back (gc, the CUDA cache, glibc's free heap) before the next pass measures anything.
            self.model.zero_grad(set_to_none=True)
            release_cached_memory(self.device)
            raise BackendError(oom, status="oom")
        grad_norm = math.sqrt(grad_norm_local_sq(self.model)) if pass_type == "forward_backward" else None
        end = clock.end_event()
        synchronize(self.device)
        step_s = time.perf_counter() - t0  # copying the outputs to the host comes after
        self._flag_waiting_threads(pass_type, time.process_time() - cpu0, step_s)
        return pending, grad_norm, step_s, clock.finish(end)

    def _flag_waiting_threads(self, pass_type: str, cpu_s: float, step_s: float) -> None:
        """One warning for a CPU pass that computed for less than half of its time: a compute-bound pass keeps at
        least its main thread busy (idle threads sleep), so its threads waited for cores the machine gave to others
        (0.26-0.32 CPU-seconds a second on a loaded 2-core machine), and the time measures the load, not the
        batching."""
        threads = getattr(self, "threads_per_rank", None)
        if self.device.type != "cpu" or not threads or step_s <= 0 or cpu_s >= 0.5 * step_s:
            return
        log.warning("pytorch %s: its %d thread(s) computed %.2f CPU-seconds in the pass's %.2f s: they waited for "
                    "cores busy elsewhere, so this time is the machine's load, not the batching",
                    pass_type, threads, cpu_s, step_s)

    def footprint(self) -> Optional[dict]:
        return footprint(self.device)

    def close(self) -> None:
        # Release the model, then hand its memory back (gc, the CUDA cache, glibc's heap), so a later
        # point in this process (a sweep, a server) starts from an empty device, not this one's cache.
        self.model = None
        release_cached_memory(self.device)
        restore_memory_limit(self._previous_limit)
        self._previous_limit = None
        torch.set_num_threads(self._previous_threads)
