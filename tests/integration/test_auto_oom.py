"""mtpm=auto after a budget runs out of memory: the pytorch backend under bench.memory_limit_gb hands back what
the failed budget allocated, so a smaller budget measured next (as the search does, and the chosen budget's final
passes) runs as it did before.

The scenario runs in a process of its own: the limit (RLIMIT_DATA) and glibc's allocator settings are
process-wide, and the pytorch backend limits the process it runs in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# 6 sequences of 2,000 tokens, the real Qwen3.5 vocabulary (its 1,024-token log-prob chunk is 1 GiB in fp32): at
# mtpm=2,048 one sequence a micro-batch peaks near 1.7 GiB, at mtpm=16,384 all six in one run out of 2 GiB at once.
SCENARIO = """
import json, sys
from backends.errors import BackendError
from backends.pytorch import PyTorchBackend
from backends.specs import BackendSpec, ModelSpec
from harness.data.workload import make_examples
from harness.measuring.measure import default_command_for, measure_pass

vocab = 248320
backend = PyTorchBackend(BackendSpec(name="pytorch", device="cpu", memory_limit_gb=2), ModelSpec(vocab_size=vocab))
examples = make_examples([2000] * 6, vocab, seed=0)

def measure(pass_type, mtpm, few):
    command_for = default_command_for(examples[:2] if few else examples, mtpm, 1, layout="packed",
                                      planner="balanced")
    try:
        record, _ = measure_pass(backend, examples[:2] if few else examples, pass_type, 0, 1, command_for)
        return {"status": "ok", "peak": max(record.mem_peak_bytes)}
    except BackendError as exc:
        return {"status": exc.status, "error": str(exc)}

out = {"fits": measure("forward", 2048, True)}
out["before"] = backend.footprint()
out["larger"] = measure("forward_backward", 16384, False)
out["after"] = backend.footprint()
out["fits_again"] = measure("forward", 2048, True)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA and VmData are Linux's")
def test_a_budget_that_fits_runs_again_after_a_larger_one_ran_out_of_memory():
    """The larger budget runs out of memory under the 2 GiB limit; the process's data segment (what the limit
    counts) is then back within 128 MiB of where it was, and the smaller budget, which fitted before, runs again.
    With glibc's default mmap threshold the failed budget's freed heap stayed counted: the data segment stayed about
    0.7 GiB up, and the smaller budget's 1 GiB log-prob chunk was refused."""
    proc = subprocess.run([sys.executable, "-c", SCENARIO], cwd=REPO, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    out = json.loads(line[len("RESULT "):])
    assert out["fits"]["status"] == "ok", out
    assert out["larger"]["status"] == "oom" and "bench.memory_limit_gb=2" in out["larger"]["error"], out
    assert out["fits_again"]["status"] == "ok", out["fits_again"]
    assert out["before"]["measure"] == "vm_data" and out["after"]["measure"] == "vm_data"
    assert out["after"]["bytes"] - out["before"]["bytes"] <= 128 * 1024**2, out


def _auto_run(workdir: Path, name: str, env: dict) -> tuple[dict, str]:
    from tests.conftest import load_json, run_harness

    run = workdir / name
    proc = run_harness("backend=fsdp2", "mtpm=auto", "workload=smoke", "workload.n_examples=4", "bench.warmup=0",
                       "bench.repeat=1", "backend.hooks=tests.faults:FSDP2ForwardOutOfMemory",
                       f"hydra.run.dir={run}", cwd=workdir, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log  # out of memory is a result
    return load_json(run / "results.json"), log


def test_auto_measures_the_chosen_budget_again_on_fresh_ranks_after_its_final_pass_ran_out(workdir):
    """The search measures fwd+bwd; the chosen budget's final forward pass then runs out of memory once (the ranks'
    injected refusal): fresh ranks run it and the point ends ok with its answer; ``auto.final`` says what happened."""
    import os

    marker = workdir / "refused-once"
    res, log = _auto_run(workdir, "once", {**os.environ, "BALANCE_BATCH_TEST_OOM_ONCE": str(marker)})
    assert marker.exists()
    assert res["status"] == "ok" and res["mtpm"] == res["auto"]["chosen"], log
    assert set(res["passes"]) == {"forward", "forward_backward"}
    final = res["auto"]["final"]
    assert final["fresh_backend"] == "ok" and "out of memory in forward" in final["error"], final
    assert "measuring them again on a fresh backend" in log and "ran on the fresh backend" in log


def test_auto_whose_chosen_budget_runs_out_on_fresh_ranks_too_answers_in_one_line(workdir):
    """The final forward pass runs out of memory on the fresh ranks too: the point ends oom, not as though no budget
    fitted: the answer and the search's own measurement are its one line, ``mtpm`` and ``auto.chosen`` hold it."""
    import os

    res, log = _auto_run(workdir, "twice", {k: v for k, v in os.environ.items() if k != "BALANCE_BATCH_TEST_OOM_ONCE"})
    chosen = res["auto"]["chosen"]
    assert res["status"] == "oom" and res["mtpm"] == chosen and res["auto"]["final"]["fresh_backend"] == "oom"
    assert res["error"].startswith(f"mtpm=auto chose mtpm={chosen} (the search measured it ok: "), res["error"]
    assert "final passes ran out of memory twice, on a fresh backend too" in res["error"]
    errors = [line for line in log.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and f"mtpm=auto chose mtpm={chosen}" in errors[0], log
