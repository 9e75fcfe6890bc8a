"""mtpm=auto on a point: its budgets planned, each candidate measured on one backend the point starts for itself, the
search (harness/auto/model.py) run over them, the two leaders settled (harness/auto/lead.py), and the chosen budget's
record written as any point's, with ``auto`` saying how it was found.

The point lends what every point does (its results, label, backend, commands, pairing, plan and passes);
``AutoRun`` holds what only the search has: the candidates, the runs each budget gave, the memory limit.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from backends.errors import BackendError, UserError
from harness.app.config import HarnessConfig
from harness.auto.model import PlanningProgress, candidates_of, memory_limit, power_of_two_budgets, search
from harness.data.workload import Workload
from harness.point.logs import log_answer, log_candidate
from harness.point.results import workload_record
from harness.point.setup import Setup, label, plan_for, setup_fields

log = logging.getLogger("harness")

# A budget that ran out of memory has handed its memory back when the process's footprint is within this of where it
# was before the budget ran (what stays: the allocator's bookkeeping, a kernel's cached code)
FOOTPRINT_SLACK_BYTES = 128 * 1024**2


class AutoRun:
    """The search for one point (``point``: a harness.point.point.Point, whose record becomes the chosen budget's)."""

    def __init__(self, point, spec: HarnessConfig, workload: Workload):
        self.point = point
        self.spec = spec
        self.workload = workload
        self.lengths = workload.lengths
        # Ranks that cannot start under bench.memory_limit_gb are the search's first result, not its end: every
        # candidate would start the same ranks, so each is recorded out of memory with that start-up's message.
        self.start_failed: list[BackendError] = []
        self.runs: dict[Optional[int], tuple] = {}  # what each measured budget gave (None: the mbs=1 baseline)
        self.setup: Optional[Setup] = None
        self.cands: list = []
        self.auto: dict[str, Any] = {}
        self.limit = 0
        self.source = ""
        self.examples: list = []
        self.last_measured: Any = "none"  # the budget whose passes ran last (None: mbs=1), whose memory is cached

    def run(self) -> None:
        """Search the budgets on one loaded backend; the point's record is then the chosen budget's, with ``auto``."""
        spec = self.spec
        if spec.target.url:
            raise UserError("mtpm: auto searches on a backend it starts itself; against a server (target.url) set "
                            "mtpm to a number, or run the search without target.url")
        self.point.label = f"[{spec.backend.name} mtpm=auto] "
        self._plan_candidates()
        if spec.dry_run:
            self.point.results.mark("planned")
            return
        self.examples = self.point.examples(spec)
        chosen = self._settle_lead(self._search())
        self._save()
        self._record_answer(chosen)
        log_answer(self.point.label, self.point.results.doc)

    # -- before anything is measured ------------------------------------------------------------------
    def _first_setup(self) -> Setup:
        """A dry run's setup, else the started backend's (a start that runs out of memory: the dry-run one)."""
        spec = self.spec
        if spec.dry_run:
            return Setup.dry_run(spec)
        if spec.hot:
            self._release_hot_backend()
        try:
            return Setup.of_backend(spec, self._start_own_backend())
        except BackendError as exc:
            if exc.status != "oom":
                raise
            self.start_failed.append(exc)
            return Setup.dry_run(spec)

    def _plan_candidates(self) -> None:
        """The candidates (the workload planned at each power-of-two budget), the memory limit, and ``auto``."""
        spec, point, lengths = self.spec, self.point, self.lengths
        self.setup = setup = self._first_setup()
        setup.cost_model = point.planner_cost_model(spec, lengths, setup, point.backend)
        point.cost_model = setup.cost_model
        budgets = power_of_two_budgets(lengths, setup.world_size, setup.layout)
        progress = PlanningProgress(point.label, budgets, len(lengths), spec.bench.progress_every_s)
        refused: list = []
        self.cands = cands = candidates_of(lengths, budgets, lambda m: plan_for(lengths, setup, m), setup.layout,
                                           on_planned=progress, refused=refused)
        if refused:  # a peer planner's budgets under a sequence it will not run: the search keeps to the others
            if not cands:
                raise UserError(refused[-1]["reason"])
            log.warning("%smtpm=auto: planner %s refuses mtpm=%s (%s); searching the budgets it plans",
                        point.label, setup.planner, ", ".join(str(r["mtpm"]) for r in refused),
                        refused[0]["reason"].split("; ")[0])
        self.limit, self.source = limit, source = memory_limit(spec.bench.memory_limit_gb, setup.device or {},
                                                               setup.world_size, spec.bench.memory_headroom)
        headroom = spec.bench.memory_headroom  # applied to the device's memory; limit_source says which limit ruled
        log.info("%smtpm=auto: %d distinct plans (%s) on %s, %s; limit %.2f GiB per rank (%s)", point.label,
                 len(cands), ", ".join(str(c.mtpm) for c in cands), setup.name, f"{setup.planner} {setup.layout}",
                 limit / 2**30, source)
        self.auto = {"candidates": [c.as_dict() for c in cands], "memory_model": None, "headroom": headroom,
                     "limit_bytes": limit, "limit_source": source, "baseline": None, "chosen": None,
                     "refused": refused, "final": None}
        point.results.update(backend=setup.name, world_size=setup.world_size, device=setup.device,
                             planner=setup.planner, layout=setup.layout,
                             workload=workload_record(spec.workload, lengths, self.workload.file,
                                                      self.workload.dataset),
                             auto=self.auto)

    def _save(self) -> None:
        self.auto["candidates"] = [c.as_dict() for c in self.cands]
        self.point.results.save()

    # -- the search ------------------------------------------------------------------------------------
    def _measure(self, mtpm: Optional[int]):
        """One candidate's fwd+bwd (``mtpm`` None: the mbs=1 baseline), as the search takes it: a Measured."""
        from harness.auto.model import Measured
        from harness.measuring.measure import measure_pass

        spec, point, setup = self.spec, self.point, self.setup
        layout, planner = (setup.layout, setup.planner) if mtpm is not None else ("padded", "greedy")
        if point.backend is None:  # started when there is something to measure, not after the last failure
            if self.start_failed:
                return Measured("oom", error=str(self.start_failed[0]))
            try:
                self._start_own_backend()
            except BackendError as exc:
                if exc.status != "oom":
                    raise
                self.start_failed.append(exc)
                return Measured("oom", error=str(exc))
        command_for = point.command_for(spec, self.examples, mtpm, 1, layout, planner)
        pairing = point.pairing(spec, self.examples, "forward_backward", mtpm=mtpm)
        if pairing is not None:
            pairing.warm = False  # the baseline ran first, warm: each candidate pays for its own warm-up only
        before = point.backend.footprint()
        try:
            record, result = measure_pass(point.backend, self.examples, "forward_backward", spec.bench.warmup, 1,
                                          command_for, spec.bench.util_sample_s, label=label(setup.name, mtpm, 1),
                                          pairing=pairing)
        except BackendError as exc:
            if exc.status != "oom":
                raise
            log.info("%sout of memory: a result; the search goes on below it", label(setup.name, mtpm, 1))
            if point.backend.failure() is not None:  # its ranks are gone: the next candidate starts fresh ones
                point.backend.close()
                point.backend = None
                return Measured("oom", error=str(exc))
            return Measured("oom", error=str(exc), after_oom=self._after_oom(mtpm, before))
        self.runs[mtpm] = (record, result)
        self.last_measured = mtpm
        peaks = [p for p in record.mem_peak_bytes or [] if p is not None]
        speed = record.spread_fields().get("speedup")  # the candidate's pair ratio: what the search ranks by
        return Measured("ok", record.tok_per_s, max(peaks) if peaks else None,
                        speedup=speed["median"] if speed else None)

    def _after_oom(self, mtpm: Optional[int], before: Optional[dict]) -> Optional[dict]:
        """What a budget that ran out of memory left behind, its memory handed back (the backend releases it as the
        pass fails): the footprint a memory limit counts before it and now; one line when it is not back within
        ``FOOTPRINT_SLACK_BYTES`` of where it was, since every budget measured after it starts that much nearer the
        limit."""
        after = self.point.backend.footprint()
        if not before or not after or before["bytes"] is None or after["bytes"] is None:
            return None
        grew = after["bytes"] - before["bytes"]
        back = grew <= FOOTPRINT_SLACK_BYTES
        if not back:
            log.warning("%smtpm=auto: mtpm=%s ran out of memory and left the process %.2f GiB over where it started "
                        "(%s %.2f -> %.2f GiB, what the limit counts): budgets measured after it start that much "
                        "nearer the limit", self.point.label, mtpm, grew / 2**30, after["measure"],
                        before["bytes"] / 2**30, after["bytes"] / 2**30)
        return {"measure": after["measure"], "before_bytes": before["bytes"], "after_bytes": after["bytes"],
                "back": back}

    def _search(self):
        """The baseline, then the search over the candidates; the candidate chosen (none fits: a BackendError)."""
        auto, cands, limit, source = self.auto, self.cands, self.limit, self.source
        base = self._measure(None)
        auto["baseline"] = {"mbs": 1, "planner": "greedy", "layout": "padded", "status": base.status,
                            "tok_per_s": base.tok_per_s, "peak_bytes": base.peak_bytes, "error": base.error}
        self._save()
        kernels = self.runs[None][1].kernels if None in self.runs else None
        quadratic = "eager" in ((kernels or {}).get("attention") or {})  # scores materialised: memory ~ length^2
        longest = max(self.lengths)
        found = search(cands, lambda c: self._measure(c.mtpm), limit, quadratic=quadratic,
                       baseline_point=(longest, longest * longest, base.peak_bytes) if base.peak_bytes else None,
                       on_candidate=lambda c: (self._save(), log_candidate(self.point.label, c, limit)))
        auto.update(found.as_dict(self.spec.bench.memory_headroom, source), baseline=auto["baseline"])
        if found.chosen is None:
            smallest = cands[0] if cands else None
            self._save()
            raise BackendError(
                f"mtpm=auto: no budget fits in {limit / 2**30:.2f} GiB per rank ({source})"
                + (f"; the smallest, mtpm={smallest.mtpm}, ended {smallest.status}" if smallest else "")
                + (f": {smallest.reason}" if smallest and smallest.reason else ""), status="oom",
                details=self.start_failed[0].details if self.start_failed else None)
        return found.chosen

    def _settle_lead(self, chosen):
        """The two fastest candidates, measured in pairs, get more pairs while their intervals overlap
        (harness/auto/lead.py); a candidate ranked below them on its one pair is brought in while that pair is not
        below the chosen one's interval. Returns the candidate chosen; ``auto.tie`` says what it tied with and the
        rule, ``auto.ranking`` which budgets were measured again and which rest on their one pair."""
        from harness.auto.lead import Leader, settle_ranked

        spec, runs = self.spec, self.runs
        self.auto["tie"] = None
        fitting = [c for c in self.cands if c.status == "ok" and c.speedup is not None and c.mtpm in runs]
        if len(fitting) < 2:
            self._record_ranking(fitting, [])
            return chosen
        ranked = sorted(fitting, key=lambda c: (c.speedup, c is chosen), reverse=True)
        leaders = {c.mtpm: Leader(c.mtpm, self._peak_of(c.mtpm), self._pairs_of(c.mtpm)) for c in ranked}

        def more(lead: Leader, n: int) -> list[float]:
            self._more_pairs(lead.mtpm, n)
            lead.peak_bytes = self._peak_of(lead.mtpm)  # the tie rule weighs the peak the answer shows
            return self._pairs_of(lead.mtpm)

        settled, contested = settle_ranked([leaders[c.mtpm] for c in ranked], more, spec.bench.repeat,
                                           spec.bench.max_repeats)
        for c in ranked:
            c.speedup = runs[c.mtpm][0].spread_fields()["speedup"]["median"]
        self.auto.update(chosen=settled.chosen.mtpm, tie=settled.as_dict())
        self._record_ranking(ranked, contested)
        _log_settled(self.point.label, settled, [c for c in ranked if c.mtpm in contested])
        return next(c for c in ranked if c.mtpm == settled.chosen.mtpm)

    def _record_ranking(self, ranked, contested) -> None:
        """``auto.ranking``: how many pairs each measured budget's speedup rests on, which were measured again (the
        leaders and the budgets brought in against them) and which were ranked on their one pair alone."""
        self.auto["candidates"] = [c.as_dict() for c in self.cands]
        pairs = {c.mtpm: len(self._pairs_of(c.mtpm)) for c in ranked}
        self.auto["ranking"] = {
            "pairs": {str(m): n for m, n in pairs.items()},
            "measured_again": list(contested),
            "on_one_pair": [{"mtpm": c.mtpm, "speedup": c.speedup} for c in ranked
                            if c.mtpm not in contested and pairs[c.mtpm] == 1],
            "repeat": self.spec.bench.repeat,
        } if ranked else None

    def _pairs_of(self, mtpm: int) -> list[float]:
        return (self.runs[mtpm][0].spread_fields().get("speedup") or {}).get("pairs") or []

    def _peak_of(self, mtpm: int) -> Optional[int]:
        """A measured budget's fwd+bwd peak, the largest of every timed pass it ran (what its record shows)."""
        peaks = [p for p in self.runs[mtpm][0].mem_peak_bytes or [] if p is not None]
        return max(peaks) if peaks else None

    def _more_pairs(self, mtpm: int, n: int) -> None:
        """``n`` more fwd+bwd pairs of a measured budget, merged into its record. Cached memory is released first:
        another budget (or mbs=1) ran last, and a peak reset over what it left cached reads its memory, not this
        budget's."""
        from harness.measuring.measure import measure_pass
        from harness.measuring.records import merge_records

        spec, point, setup, examples = self.spec, self.point, self.setup, self.examples
        record = self.runs[mtpm][0]
        if point.backend is None:  # a larger candidate ran out of memory and took the ranks with it
            self._start_own_backend()
        extra, result = measure_pass(
            point.backend, examples, "forward_backward", 0, n,
            point.command_for(spec, examples, mtpm, 1, setup.layout, setup.planner), spec.bench.util_sample_s,
            label=label(setup.name, mtpm, 1), release_first=True,
            pairing=point.pairing(spec, examples, "forward_backward", mtpm=mtpm))
        self.runs[mtpm] = (merge_records(record, extra), result)
        self.last_measured = mtpm

    # -- the answer --------------------------------------------------------------------------------------
    def _record_answer(self, chosen) -> None:
        """The chosen budget's record (``_record_choice``); passes that run out of memory there, though the search
        measured the budget ``ok``, are run once more on a fresh backend (its ranks, or the pytorch backend's model,
        started again after everything was handed back). ``auto.final`` records what happened; an out of memory on
        the fresh backend too ends the point ``oom`` with the answer and the search's own measurement in its one
        line, never an out of memory that reads as though no budget fitted."""
        try:
            self._record_choice(chosen)
            return
        except BackendError as exc:
            if exc.status != "oom":
                raise
            first = str(exc)
        log.warning("%smtpm=auto: mtpm=%d's final passes ran out of memory though the search measured it ok (%s); "
                    "measuring them again on a fresh backend", self.point.label, chosen.mtpm, first)
        self.auto["final"] = {"error": first, "fresh_backend": None}  # None: measuring on it
        self._save()
        if self.point.backend is not None:
            self.point.backend.close()
            self.point.backend = None
        self.last_measured = "none"  # nothing cached on the fresh backend
        try:
            self._record_choice(chosen)
        except BackendError as exc:
            if exc.status != "oom":
                raise
            self.auto["final"].update(fresh_backend="oom", fresh_error=str(exc))
            self._save()
            gib = lambda n: "—" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
            speed = f"{chosen.speedup:.2f}× mbs=1, " if chosen.speedup is not None else ""
            raise BackendError(
                f"mtpm=auto chose mtpm={chosen.mtpm} (the search measured it ok: {speed}peak "
                f"{gib(chosen.measured_peak_bytes)} of {gib(self.limit)}), but its final passes ran out of memory "
                f"twice, on a fresh backend too: {exc}", status="oom") from None
        self.auto["final"]["fresh_backend"] = "ok"
        self.point.results.save()
        log.info("%smtpm=auto: mtpm=%d's final passes ran on the fresh backend", self.point.label, chosen.mtpm)

    def _record_choice(self, chosen) -> None:
        """The chosen budget's record, as any point's: its plan, its fwd+bwd topped up to ``bench.repeat`` timed
        runs (after the one the search made), and its forward pass."""
        from harness.measuring.measure import measure_pass
        from harness.measuring.records import merge_records

        spec, point, setup, examples = self.spec, self.point, self.setup, self.examples
        setup.mtpm = spec.backend.max_tokens_per_microbatch = chosen.mtpm
        point.label = label(setup.name, setup.mtpm, setup.mbs)
        if point.backend is None:  # a larger candidate ran out of memory and took the ranks with it
            self._start_own_backend()
        plan = point.plan(spec, lengths := self.lengths, setup)
        point.results.update(**setup_fields(spec, self.workload, setup, plan))
        command_for = point.command_for(spec, examples, chosen.mtpm, 1, setup.layout, setup.planner)
        record, result = self.runs[chosen.mtpm]
        if spec.bench.repeat > len(record.elapsed_s):
            pairing = point.pairing(spec, examples, "forward_backward", mtpm=chosen.mtpm)
            # another budget's (or mbs=1's) memory may be cached: released first (paired, the untimed settling pass
            # pays for it), else its peak would be read as this budget's
            more, result = measure_pass(point.backend, examples, "forward_backward", 0,
                                        spec.bench.repeat - len(record.elapsed_s), command_for,
                                        spec.bench.util_sample_s, label=point.label,
                                        release_first=pairing is not None or self.last_measured != chosen.mtpm,
                                        target_ci_pct=spec.bench.target_ci_pct, max_repeats=spec.bench.max_repeats,
                                        pairing=pairing)
            record = merge_records(record, more)
        point.measure(spec, lengths, point.backend, examples, command_for,
                      measured={"forward_backward": (record, result)})

    # -- the search's own backend --------------------------------------------------------------------
    def _release_hot_backend(self) -> None:
        """A hot sweep's loaded backend is closed before mtpm=auto starts its own: the search measures each budget's
        peak against the limit with its ranks alone on the device, not beside idle ranks holding a model (whose
        memory no limit accounts for). The sweep's next point loads the hot backend again; this one records
        ``hot: false``, the backend it ran on being its own."""
        from harness.sweep.hot import HOT

        if HOT.backend is not None:
            log.info("%shot: the sweep's loaded %s is released first, so the search's ranks are alone under the "
                     "memory limit; the next point loads it again", self.point.label, HOT.backend.name)
        HOT.close()

    def _start_own_backend(self):
        """A backend for this point alone (mtpm=auto sets each candidate's budget in its commands, not a control
        file)."""
        from backends.model.build import model_vocab_size
        from backends.start import make_backend

        spec, point = self.spec, self.point
        point.vocab_size = model_vocab_size(spec.model)
        log.info("%sstarting %s", point.label, spec.backend.name)
        point.backend = make_backend(spec.backend, spec.model)
        return point.backend


def _log_settled(prefix: str, settled, top) -> None:
    """How the two leaders were told apart (or not): one line."""
    shown = ", ".join(f"mtpm={lead.mtpm} {lead.option()['median']:.2f}×" + (
        f" ({lead.option()['ci'][0]:.2f}–{lead.option()['ci'][1]:.2f})" if lead.option()["ci"] else "")
        for lead in [settled.chosen, *settled.tied])
    if settled.tied:
        log.info("%smtpm=auto: the leaders cannot be told apart after %d pairs each (%s): they tie; mtpm=%d chosen "
                 "for %s", prefix, settled.pairs, shown, settled.chosen.mtpm, settled.rule)
    elif settled.pairs < 2:
        log.info("%smtpm=auto: mtpm=%d leads on one pair each (%s): bench.repeat=1 gives no interval to tell the "
                 "leaders apart", prefix, settled.chosen.mtpm, shown)
    else:
        log.info("%smtpm=auto: mtpm=%d leads clearly after %d pairs each (%s)", prefix, settled.chosen.mtpm,
                 settled.pairs, ", ".join(f"mtpm={c.mtpm} {c.speedup:.2f}×" for c in top))
