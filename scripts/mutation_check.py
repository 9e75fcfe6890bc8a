"""Break the core on purpose, one named mutation at a time, and show the tests that guard it fail.

    python scripts/mutation_check.py                 # every mutation, a markdown table at the end
    python scripts/mutation_check.py --only greedy   # names containing "greedy"
    python scripts/mutation_check.py --list

Each mutation is an exact text replacement (it must match once) applied to a
fresh copy of the working tree in a temporary folder (tracked and untracked,
not ignored files), never to the checkout itself. The copy's own tests for that
mutation run there with PYTHONPATH pointing at the copy; a mutation is
"caught" when they fail and "survived" when they pass. A mutation that no
longer applies (the code moved) is reported as "stale", so the list is kept
honest. Not part of CI: it runs real multi-process tests and takes minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids (or files) that must fail


MUTATIONS = (
    Mutation(
        "the kernel record trusts the package's import, not what transformers bound when its module was imported",
        "balance_batch/integrations/transformers/packing.py",
        "return _cuda_kernel_available(package) if bound is None else bound",
        "return _cuda_kernel_available(package)",
        ("tests/unit/balance_batch/integrations/transformers/test_kernels.py::test_the_record_follows_what_transformers_bound_at_import_not_what_imports_now",),
    ),
    Mutation(
        "backend.compile traces the delta-rule scan into the compiled layer (a graph per set of boundaries)",
        "balance_batch/integrations/transformers/packing.py",
        "    torch_chunk_gated_delta_rule = _eager(torch_chunk_gated_delta_rule)\n",
        "",
        (
            "tests/unit/test_compiling.py::test_compiling_wraps_each_decoder_layer_once_and_keeps_the_boundary_kernels_eager",
        ),
    ),
    Mutation(
        "ranks' compile seconds added up, though they compile side by side",
        "backends/model/compiling.py",
        '_combined(records, max(r["compile_s"] for r in records))',
        '_combined(records, sum(r["compile_s"] for r in records))',
        ("tests/unit/test_compiling.py::test_ranks_merge_with_the_slowest_ranks_seconds_and_passes_add_up",),
    ),
    Mutation(
        "packed planner without its exact search for few sequences: a tight fill LPT misses costs a step",
        "balance_batch/balanced/packed.py",
        "if enough > bound and 0 < n_search <= _SEARCH_BINS:",
        "if False:",
        ("tests/unit/balance_batch/balanced/test_balanced.py::test_balanced_packed_reaches_the_bound_whenever_a_plan_can",),
    ),
    Mutation(
        "backend.compile without the plan's sizes named: each graph compiles for its first shape, then again",
        "backends/model/compiling.py",
        'config.dynamic_values = ",".join(str(n) for n in sorted(sizes - model_sizes))',
        "config.dynamic_values = before",
        (
            "tests/unit/test_compiling.py::test_plan_sizes_are_symbolic_from_the_first_compile_and_a_size_guard_is_counted",
        ),
    ),
    Mutation(
        "loss divided by each micro-batch's token count, not the batch's weight",
        "backends/model/step.py",
        "(loss_per_row.sum() * scale).backward()",
        "(loss_per_row.sum() / weights.numel()).backward()",
        ("tests/unit/test_loss_oracle.py",),
    ),
    Mutation(
        "greedy closes a micro-batch at the budget (> becomes >=)",
        "balance_batch/greedy.py",
        "if count and ((count + 1) * longest > budget or count == cap):",
        "if count and ((count + 1) * longest >= budget or count == cap):",
        (
            "tests/unit/balance_batch/test_greedy.py::test_greedy_closes_a_batch_only_when_the_next_sequence_does_not_fit",
            "tests/unit/balance_batch/test_greedy.py::test_a_micro_batch_that_exactly_fills_the_budget_is_kept_whole",
        ),
    ),
    Mutation(
        "the histogram packer's best fit forgets the cap on sequences per micro-batch",
        "balance_batch/balanced/packed.py",
        "q = int(min(room // length, cap - self.cnt[g]))",
        "q = int(room // length)",
        ("tests/unit/balance_batch/balanced/test_scaling.py::test_histogram_best_fit_decreasing_packs_as_the_one_at_a_time_form",),
    ),
    Mutation(
        "the balanced planner's LPT keeps filling a micro-batch past the cap",
        "balance_batch/balanced/packed.py",
        "t = min(room // length, k // nb, cap - self.cnt[g])",
        "t = min(room // length, k // nb)",
        (
            "tests/unit/balance_batch/balanced/test_scaling.py::test_the_cap_holds_where_a_few_cheap_micro_batches_take_many_short_sequences",
        ),
    ),
    Mutation(
        "the lower bound leaves out the cap on sequences",
        "balance_batch/stats.py",
        "    if max_seqs:\n        most = min(most, max_seqs)\n",
        "",
        (
            "tests/unit/balance_batch/balanced/test_scaling.py::test_the_cap_is_part_of_the_lower_bound_and_the_balanced_planner_reaches_it",
        ),
    ),
    Mutation(
        "FSDP2 drops its dummy steps",
        "backends/fsdp2.py",
        "return list(local) + [None] * (int(count.item()) - len(local))",
        "return [b for b in local if b is not None]",
        (
            "tests/integration/test_distributed.py::test_fsdp2_a_short_rank_runs_a_dummy_step_and_the_gradient_is_the_oracles",
        ),
    ),
    Mutation(
        "FSDP2's other ranks wait for rank 0's read in their first broadcast, not on the store",
        "backends/model/loading.py",
        "    else:\n        gate.wait()\n",
        "",
        (
            "tests/integration/test_loading.py::test_fsdp2_ranks_wait_for_a_rank0_read_longer_than_the_collective_timeout",
        ),
    ),
    Mutation(
        "FSDP2 ranks do not compare their step counts",
        "backends/fsdp2.py",
        "        check_equal_step_counts(len(schedule), self.world_size, self.device)\n",
        "",
        ("tests/integration/test_distributed.py::test_a_step_count_mismatch_is_a_clear_error_in_seconds",),
    ),
    Mutation(
        "ranks dealt contiguous blocks instead of cards",
        "balance_batch/greedy.py",
        "return [order[r::world_size] for r in range(world_size)]",
        "return [order[r * len(order) // world_size : (r + 1) * len(order) // world_size] for r in range(world_size)]",
        (
            "tests/unit/balance_batch/test_greedy.py::test_dealing_covers_every_example_once_and_balances_counts",
            "tests/unit/test_reports.py::test_committed_results_are_a_real_sweep_of_this_machine",
        ),
    ),
    Mutation(
        "resume runs finished points again",
        "harness/point/task.py",
        'if previous.get("status") == "ok":',
        'if previous.get("status") == "never":',
        (
            "tests/integration/test_harness_cli.py::test_resume_keeps_finished_results_and_finds_points_by_their_overrides",
        ),
    ),
    Mutation(
        "an allocator's refusal is not classified as out of memory",
        "backends/runtime/memory.py",
        "if any(m in text for m in _OOM_MARKERS):",
        "if False:",
        ("tests/unit/test_memory.py", "tests/integration/test_memory.py",
         "tests/integration/test_faults.py::test_out_of_memory_is_a_result_and_the_sweep_goes_on",
         "tests/integration/test_faults.py::test_pytorch_backend_recovers_after_an_oom_point"),
    ),
    Mutation(
        "packed position ids do not restart at each sequence",
        "backends/model/packing.py",
        "positions = np.arange(int(cu[-1]), dtype=np.int64) - starts",
        "positions = np.arange(int(cu[-1]), dtype=np.int64)",
        ("tests/unit/balance_batch/integrations/transformers/test_packing.py::test_collate_lays_sequences_end_to_end",),
    ),
    Mutation(
        "packed cu_seqlens make the whole row one sequence",
        "backends/model/packing.py",
        "    cu_seqlens = host_to_device(cu, device)\n"
        "    remember_bounds(cu_seqlens, cu.tolist())",
        "    cu_seqlens = host_to_device(cu[[0, -1]].copy(), device)\n"
        "    remember_bounds(cu_seqlens, cu[[0, -1]].tolist())",
        (
            "tests/unit/balance_batch/integrations/transformers/test_packing.py::test_collate_lays_sequences_end_to_end",
            "tests/unit/test_loss_oracle.py::test_each_grouping_reports_the_oracles_losses_and_gradient",
        ),
    ),
    Mutation(
        "a failed point's W&B run is left unfinished",
        "harness/point/point.py",
        "        if self.tracker is not None:\n            self.tracker.finish(self.results.doc)",
        '        if self.tracker is not None and self.results.doc.get("status") == "ok":\n'
        "            self.tracker.finish(self.results.doc)",
        ("tests/integration/test_tracking.py::test_a_failed_point_still_finishes_its_run_and_the_next_starts",),
    ),
    Mutation(
        "pytorch mixes up the outputs of equal-length examples (shapes stay right)",
        "backends/pytorch.py",
        "outputs=[by_index[i] for i in range(len(examples))],",
        "outputs=[by_index[max(j for j in range(len(examples)) if len(examples[j]) == len(examples[i]))]"
        " for i in range(len(examples))],",
        ("tests/integration/test_batching_invariance.py::test_outputs_come_back_in_request_order",),
    ),
    Mutation(
        "packed masks as a dict subclass whose missing keys are None (FSDP2's bf16 input cast drops it)",
        "backends/model/packing.py",
        "    return {layer_type: None for layer_type in layer_types}",
        '    return type("Masks", (dict,), {"__missing__": lambda self, key: None})()',
        ("tests/integration/test_precision.py::test_bf16_packed_gives_the_padded_answer",),
    ),
    Mutation(
        "LoRA adapters computed in float32 off FSDP2 (peft's own cast): FSDP2 and Megatron not like for like",
        "backends/model/build.py",
        "    if dtype not in HALF_DTYPES:\n        return 0\n    import types",
        "    if True:\n        return 0\n    import types",
        (
            "tests/unit/test_precision.py::test_lora_adapters_compute_in_bf16_and_keep_float32_weights_and_gradients",
            "tests/integration/test_precision.py::test_fsdp2_and_megatron_compute_lora_alike_in_bf16",
        ),
    ),
    Mutation(
        "padded rows keep transformers' delta rule while packed rows run the project's scan",
        "balance_batch/integrations/transformers/packing.py",
        "        # the scan records itself: a path that does not reach it records nothing\n",
        "        if cu_seqlens is None:\n"
        "            return torch_delta_rule(query, key, value, chunk_size=chunk_size, **common, **kwargs)\n",
        ("tests/unit/balance_batch/integrations/transformers/test_kernels.py::test_each_layout_records_what_ran_and_both_run_the_same_scan_and_convolution",),
    ),
    Mutation(
        "CPU tensors handed to the kernel transformers bound on a GPU host (padded convolution)",
        "balance_batch/integrations/transformers/packing.py",
        "return (original if fused else torch_conv1d)(hidden_states",
        "return original(hidden_states",
        (
            "tests/unit/balance_batch/integrations/transformers/test_kernels.py::test_cpu_tensors_never_reach_a_gpu_kernel_even_where_the_kernel_packages_import",
        ),
    ),
    Mutation(
        "a LoRA backward counted as 3 forwards (weight gradients for the frozen base)",
        "harness/metrics/flops.py",
        "trained_weights=0.0 if lora else weights,",
        "trained_weights=weights,",
        ("tests/integration/test_training_flops.py",),
    ),
    Mutation(
        "blame names the failing rank's own error before a peer that died",
        "backends/runtime/failures.py",
        "        peer = find_peer()\n",
        "        peer = None\n",
        ("tests/unit/test_failures.py",),
    ),
    Mutation(
        "a running point whose process is gone still reads as running",
        "harness/point/results.py",
        'if status == "running" and recorded_process_gone(doc.get("process")):',
        'if False and recorded_process_gone(doc.get("process")):',
        ("tests/unit/test_died.py",),
    ),
    Mutation(
        "a sweep without mbs=1 gets no baseline",
        "harness/sweep/points.py",
        "        added[key] = baseline\n",
        "        added.pop(key, None)\n",
        (
            "tests/unit/test_answer.py::test_a_sweep_without_mbs1_gets_one_ahead_of_each_setting_and_one_that_has_it_gets_none",
        ),
    ),
    Mutation(
        "budgets of different plans share one measurement",
        "harness/point/sharing.py",
        'what = {"config": conf, "layout": plan.stats.layout, "schedules": plan.schedules}',
        'what = {"config": conf, "layout": plan.stats.layout}',
        (
            "tests/unit/test_answer.py::test_two_budgets_share_a_measurement_only_when_the_plan_and_everything_else_match",
        ),
    ),
    Mutation(
        "mtpm=auto runs candidates predicted over the limit",
        "harness/auto/model.py",
        "        if c.predicted_peak_bytes <= self.limit:",
        "        if True:",
        (
            "tests/unit/test_answer.py::test_the_search_runs_what_fits_skips_what_is_predicted_over_and_chooses_the_fastest",
        ),
    ),
    Mutation(
        "mtpm=auto chooses the slowest candidate",
        "harness/auto/model.py",
        "chosen = max(fitting, key=lambda c: c.speedup if paired else c.tok_per_s) if fitting else None",
        "chosen = min(fitting, key=lambda c: c.speedup if paired else c.tok_per_s) if fitting else None",
        (
            "tests/unit/test_answer.py::test_the_search_runs_what_fits_skips_what_is_predicted_over_and_chooses_the_fastest",
        ),
    ),
    Mutation(
        "a budget defaults to the original greedy padded planner",
        "harness/app/batching.py",
        'return ("balanced", "packed") if has_budget else ("greedy", "padded")',
        'return ("greedy", "padded")',
        (
            "tests/unit/test_answer.py::test_a_budget_defaults_to_the_balanced_packed_planner_and_the_presets_keep_the_original",
        ),
    ),
    Mutation(
        "a client records its own planner and layout, not the server's",
        "harness/point/setup.py",
        "layout, planner = backend.layout or layout, backend.planner or planner",
        "layout, planner = b.layout, b.planner",
        (
            "tests/integration/test_serve.py::test_a_packed_server_is_recorded_as_it_runs_by_its_client_and_keeps_its_budget",
        ),
    ),
    Mutation(
        "a committed result edited by hand (pad efficiency)",
        "reports/results/cpu-2rank-tiny/3/results.json",
        '"pad_efficiency": 0.5958749107698851,',
        '"pad_efficiency": 0.6058749107698851,',
        ("tests/unit/test_reports.py::test_committed_results_are_a_real_sweep_of_this_machine",),
    ),
    Mutation(
        "a dataset's loss weights not shifted: position t weighted by its own token, not the one it predicts",
        "harness/data/dataset.py",
        'w[:-1] = 1.0 if train_on == "all" else trained[1:].astype(np.float32)',
        'w[:-1] = 1.0 if train_on == "all" else trained[:-1].astype(np.float32)',
        ("tests/unit/test_dataset.py::test_chat_rows_train_on_the_assistant_turns_and_their_end_of_turn",),
    ),
    Mutation(
        "the chat rows' masks train the whole conversation (the assistant spans ignored)",
        "harness/data/rendering.py",
        "trained = [b > a and any(a < e and b > s for s, e in spans) for a, b in offsets]",
        "trained = [b > a for a, b in offsets]",
        ("tests/unit/test_dataset.py::test_chat_rows_train_on_the_assistant_turns_and_their_end_of_turn",),
    ),
    Mutation(
        "the token cache key forgets the files' contents",
        "harness/data/dataset.py",
        '"files": [{"path": str(f.resolve()), "sha256": file_sha256(f)} for f in files],',
        '"files": [{"path": str(f.resolve())} for f in files],',
        ("tests/unit/test_dataset.py::test_the_cache_is_read_on_a_second_run_and_invalidated_by_a_change",
         "tests/unit/test_dataset.py::test_an_edit_that_keeps_the_size_and_time_is_tokenized_again"),
    ),
    Mutation(
        "a dataset point runs random ids instead of the dataset's",
        "harness/data/workload.py",
        "        return dataset_examples(self.dataset)",
        "        return make_examples(self.lengths, vocab_size, seed)",
        ("tests/integration/test_dataset_loss.py",),
    ),
    Mutation(
        "the profile's breakdown charges an operator its whole duration, not its self time",
        "backends/runtime/profiling.py",
        'own = max(0.0, e["dur"] - children)',
        'own = e["dur"]',
        ("tests/unit/test_profiling.py::test_a_hand_made_timeline_is_split_exactly",),
    ),
    Mutation(
        "the profile's breakdown reads every thread as the pass's",
        "backends/runtime/profiling.py",
        'mine = sorted((e for e in events if e.get("tid") == tid and e.get("pid") == pid and e is not region',
        'mine = sorted((e for e in events if e is not region',
        ("tests/unit/test_profiling.py::test_a_hand_made_timeline_is_split_exactly",),
    ),
    Mutation(
        "an FSDP2 rank's busy time keeps its collective waits: a rank blocked in a collective looks busy",
        "backends/runtime/timeline.py",
        "        busy = [t - w for t, w in zip(steps, waits)] if waits else steps",
        "        busy = steps",
        (
            "tests/unit/test_balance.py::test_a_cpu_rank_clock_counts_the_time_in_its_collective_waits_apart_from_its_busy_time",
            "tests/integration/test_balance_waits.py::test_fsdp2_measured_idle_tracks_the_modeled_idle_of_an_uneven_plan",
        ),
    ),
    Mutation(
        "the end of a pass's last step is not marked: its time is lost",
        "backends/model/step.py",
        "        clock.mark()  # where the last step ends\n",
        "",
        ("tests/integration/test_balance.py::test_each_ranks_step_times_add_up_to_its_pass_time",),
    ),
    Mutation(
        "the measured critical path of lock-step ranks ignores their waiting at every step",
        "harness/metrics/balance.py",
        "    elif lockstep:\n        steps = max(",
        "    elif False:\n        steps = max(",
        ("tests/unit/test_balance.py::test_lockstep_ranks_wait_for_the_slowest_at_every_step_independent_ones_once",),
    ),
    Mutation(
        "the calibration's fit keeps negative coefficients",
        "harness/metrics/calibration.py",
        "        if (coef < 0).any():\n            continue\n",
        "",
        ("tests/unit/test_calibration.py::test_the_fit_recovers_known_coefficients_and_never_goes_negative",),
    ),
    Mutation(
        "a calibrated model's cost per micro-batch is left out of the plan's statistics",
        "balance_batch/stats.py",
        "    if cost_model.fixed:\n",
        "    if False:\n",
        (
            "tests/unit/test_balance.py::test_a_fixed_cost_per_micro_batch_is_counted_once_per_micro_batch_and_never_for_a_dummy",
        ),
    ),
    Mutation(
        "the calibration cache is keyed without the layout: a padded fit plans packed rows",
        "harness/metrics/calibration.py",
        '        "layout": layout,\n        "gc": bool(gc),',
        '        "gc": bool(gc),',
        ("tests/unit/test_calibration.py::test_the_cache_key_changes_with_everything_a_fit_depends_on",),
    ),
    Mutation(
        "paired repeats always run the point first: a drift inside every pair biases the speedup",
        "harness/measuring/measure.py",
        "        baseline_first = pairing is not None and i % 2 == 1\n",
        "        baseline_first = False\n",
        (
            "tests/unit/test_spread.py::test_a_drifting_machine_fools_points_measured_one_after_the_other_and_not_paired_repeats",
        ),
    ),
    Mutation(
        "no settling pass: the first timed pass after a switch of shape pays for the switch",
        "harness/measuring/runner.py",
        "        if pairing is None or self.last == which:\n            return\n",
        "        if True:\n            return\n",
        (
            "tests/unit/test_spread.py::test_every_timed_pass_of_a_pair_follows_one_of_its_own_shape_so_a_switch_costs_neither_side",
        ),
    ),
    Mutation(
        "a normal quantile in place of Student's t: an interval of 3 repeats half as wide as it should be",
        "harness/metrics/spread.py",
        "    if df <= len(_T975):\n        return _T975[df - 1]\n",
        "",
        (
            "tests/unit/test_spread.py::test_the_interval_is_students_t_on_the_logs_and_covers_the_geometric_mean_as_often_as_it_says",
        ),
    ),
    Mutation(
        "bench.target_ci_pct is ignored for a pass's own tok/s: it stops at bench.repeat however wide the interval",
        "harness/measuring/stats.py",
        (
            "        if needs_more([self.real_tokens / t for t in self.elapsed], target_ci_pct):\n"
            "            return True\n"
        ),
        "",
        (
            "tests/unit/test_spread.py::test_repeats_go_on_until_the_interval_is_as_tight_as_asked_and_stop_at_the_most_allowed",
        ),
    ),
    Mutation(
        "a spread over 10% is never flagged noisy",
        "harness/metrics/spread.py",
        '"noisy": min(known) > 0 and max(known) / min(known) > NOISY_RATIO}',
        '"noisy": False}',
        (
            "tests/unit/test_spread.py::test_a_figure_records_its_median_spread_interval_and_whether_it_is_noisy",
            "tests/unit/test_reports.py::test_committed_results_are_a_real_sweep_of_this_machine",
        ),
    ),
    Mutation(
        "the report divides by the sweep's mbs=1 row though the point measured its speedup in pairs",
        "reports/render.py",
        '        if paired is not None and r.status == "ok":\n',
        '        if False:\n',
        (
            "tests/unit/test_spread.py::test_the_table_and_the_answer_show_the_paired_interval_and_say_when_it_cannot_tell_or_is_noisy",
        ),
    ),
    Mutation(
        "the answer ranks rows by tok/s though they were measured in pairs: "
        "a point timed while the machine ran fast wins",
        "reports/render.py",
        '        by_pairs = bool(pool["speedup"].notna().all())\n',
        '        by_pairs = False\n',
        (
            "tests/unit/test_spread.py::test_the_table_and_the_answer_show_the_paired_interval_and_say_when_it_cannot_tell_or_is_noisy",
            "tests/unit/test_lead.py::test_the_reports_answer_says_a_tie_and_prefers_the_budget_shown_faster_than_mbs1",
        ),
    ),
    Mutation(
        "a hot backend's paired baseline runs with the point's budget: the control file is not switched to mbs=1",
        "harness/measuring/runner.py",
        '        control = getattr(backend, "control", None)\n',
        "        control = None\n",
        ("tests/integration/test_hot.py::test_a_hot_sweep_loads_once_switches_budgets_and_gives_the_cold_answer",),
    ),
    Mutation(
        "a rank forked by the fork server keeps the fork server's environment, not its controller's",
        "backends/runtime/spawned.py",
        "    apply_environment(environ)\n",
        "",
        ("tests/integration/test_distributed.py::test_ranks_get_the_environment_of_their_start_not_the_fork_servers",),
    ),
    Mutation(
        "mtpm=0 accepted as a budget",
        "harness/app/config.py",
        "    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:\n"
        "        raise UserError(f\"mtpm: must",
        "    if isinstance(value, bool) or not isinstance(value, int) or value < 0:\n"
        "        raise UserError(f\"mtpm: must",
        ("tests/unit/test_config.py",),
    ),
    Mutation(
        "the stream's items go to the ranks in the plan's order, whichever rank the plan gave them to",
        "balance_batch/stream.py",
        "held.update(zip(np.flatnonzero((ranks == src) & (runs_on == self.rank)).tolist(), incoming[src]))",
        "held.update(zip(sorted(np.flatnonzero(ranks == src).tolist(), reverse=True), incoming[src]))",
        ("tests/integration/balance_batch/test_stream.py::test_every_item_once_equal_counts_within_budget",),
    ),
    Mutation(
        "the stream's state forgets the items read and not yet trained",
        "balance_batch/stream.py",
        '"source_dry": self.dry, "buffer": list(self.items)}',
        '"source_dry": self.dry, "buffer": []}',
        ("tests/unit/balance_batch/test_stream.py",
         "tests/integration/balance_batch/test_stream.py::test_a_restart_after_step_k_trains_what_the_run_trained_after_it"),
    ),
    Mutation(
        "a rank whose source ran dry stops alone, before the others",
        "balance_batch/stream.py",
        "        planned = _planned_step(self._exchange.gather(offer, error), size, by_count, self._settings)\n",
        "        if reader.dry and not reader.items:\n            return None\n"
        "        planned = _planned_step(self._exchange.gather(offer, error), size, by_count, self._settings)\n",
        ("tests/integration/balance_batch/test_stream.py",),
    ),
)


def working_tree_files(repo: Path) -> list[str]:
    """Tracked and untracked files git does not ignore: the working tree as it is, uncommitted edits included."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout
    return sorted({p for p in out.decode().split("\0") if p and (repo / p).is_file()})


def copy_tree(repo: Path, dest: Path) -> None:
    for rel in working_tree_files(repo):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target)


def apply(mutation: Mutation, root: Path) -> bool:
    """Replace the mutation's text in the copy; False when it does not occur exactly once."""
    path = root / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        return False
    path.write_text(text.replace(mutation.old, mutation.new))
    return True


def run_tests(root: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[str, str]:
    """(result, last lines of pytest's output) for ``tests`` run in the copy at ``root``."""
    env = dict(os.environ, PYTHONPATH=str(root), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return f"caught (timed out after {timeout_s:g} s)", out[-2000:]
    tail = (proc.stdout + proc.stderr)[-2000:]
    if proc.returncode == 0:
        return "survived", tail
    if proc.returncode in (1, 3):  # tests failed, or errored in a fixture
        return "caught", tail
    return f"not run (pytest exit {proc.returncode})", tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the mutations whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--baseline", action="store_true",
                        help="first run each mutation's tests unmutated (they must pass)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per mutation (default 600)")
    parser.add_argument("--verbose", action="store_true", help="print pytest's last lines for every mutation")
    args = parser.parse_args(argv)

    chosen = [m for m in MUTATIONS if not args.only or args.only.lower() in m.name.lower()]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name}  [{m.path}]  {' '.join(m.tests)}")
        return 0 if chosen else 2

    rows = []
    for m in chosen:
        with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
            root = Path(tmp)
            copy_tree(REPO, root)
            if args.baseline:
                result, tail = run_tests(root, m.tests, args.timeout_s)
                if result != "survived":
                    print(f"baseline failed for {m.name!r}: {result}\n{tail}", file=sys.stderr)
                    rows.append((m, "baseline fails", 0.0))
                    continue
            start = time.monotonic()
            if not apply(m, root):
                result, tail = "stale (text not found once)", ""
            else:
                result, tail = run_tests(root, m.tests, args.timeout_s)
            elapsed = time.monotonic() - start
        rows.append((m, result, elapsed))
        print(f"{result:>10}  {elapsed:6.1f} s  {m.name}", file=sys.stderr, flush=True)
        if args.verbose or result == "survived":
            print(tail, file=sys.stderr)

    print("| mutation | file | tests run | result | seconds |")
    print("|---|---|---|---|---|")
    for m, result, elapsed in rows:
        tests = "<br>".join(f"`{t}`" for t in m.tests)
        print(f"| {m.name} | `{m.path}` | {tests} | {result} | {elapsed:.0f} |")
    return 0 if all(r.startswith("caught") for _, r, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
