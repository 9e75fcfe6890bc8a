"""FSDP2 and Megatron-core DDP on 2 real gloo ranks: same answers as PyTorch, dummies, failures, clean exits."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from backends.errors import BackendError
from backends.fsdp2 import FSDP2Backend
from backends.megatron_ddp import MegatronDDPBackend
from backends.messages import make_command
from backends.runtime.forkserver import is_fork_server
from backends.specs import BackendSpec, ModelSpec
from backends.start import make_backend
from harness.data.workload import make_examples, mixed_lengths
from tests.conftest import REPO, left_behind, load_json, start_harness, sweep_results
from tests.loss_oracle import oracle, tiny_examples

EXAMPLES = make_examples(mixed_lengths(16, 64, 512, 42), 2048, seed=0)
CASES = {
    "mtpm=700": (EXAMPLES, 700, 1),
    "mtpm=null mbs=1": (EXAMPLES, None, 1),
    "n_examples=1": (EXAMPLES[:1], None, 1),
    # every rank plans the same global plan and takes its row (a lone rank gets a dummy)
    "balanced mtpm=700": (EXAMPLES, 700, 1, {"planner": "balanced"}),
    "balanced n_examples=3": (EXAMPLES[:3], 400, 1, {"planner": "balanced"}),
    # packed rows (sequences end to end), uneven ranks and a rank that runs only a dummy
    "greedy packed mtpm=1500": (EXAMPLES, 1500, 1, {"layout": "packed"}),
    "balanced packed mtpm=1500": (EXAMPLES, 1500, 1, {"planner": "balanced", "layout": "packed"}),
    "packed n_examples=1": (EXAMPLES[:1], 1500, 1, {"layout": "packed"}),
    # small enough for tests/loss_oracle.py to compute by hand: uneven weights, grouped, uneven ranks
    "oracle mtpm=28": (tiny_examples(), 28, 1),
    "oracle packed mtpm=30": (tiny_examples(), 30, 1, {"layout": "packed"}),
}


def worker_children(ignore: frozenset = frozenset()) -> list[psutil.Process]:
    """This process's live descendants not in ``ignore``, minus the helpers that live as long as it does:
    multiprocessing's resource tracker and the ranks' fork server (its ranks count: they have it as parent)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
            helper = "resource_tracker" in line or (is_fork_server(line) and p.ppid() == os.getpid())
            if p.pid not in ignore and p.status() != psutil.STATUS_ZOMBIE and not helper:
                out.append(p)
        except psutil.Error:
            continue
    return out


def _pids(procs) -> frozenset:
    return frozenset(p.pid for p in procs)


def run_cases(backend) -> dict:
    out = {}
    for name, (examples, mtpm, mbs, *options) in CASES.items():
        for pass_type in ("forward", "forward_backward"):
            out[name, pass_type] = backend.run_pass(
                make_command(pass_type, examples, mtpm, mbs, **(options or [{}])[0])
            )
    return out


@pytest.fixture(scope="module")
def reference():
    with make_backend(BackendSpec(name="pytorch", device="cpu"), ModelSpec()) as b:
        return run_cases(b)


# Log-prob chunk sizes run beside the default on the "mtpm=700" case: None = full logits (the
# reference), 37 = under every row and dividing no micro-batch.
CHUNKS = (None, 37)


def run_chunk_cases(backend) -> dict:
    command = make_command("forward_backward", EXAMPLES, 700, 1)
    return {
        ("mtpm=700", "forward_backward", c): backend.run_pass(command.replace(logprob_chunk_tokens=c)) for c in CHUNKS
    }


@pytest.fixture(scope="module", params=["fsdp2", "megatron_ddp"])
def distributed(request):
    backend = make_backend(BackendSpec(name=request.param, world_size=2, device="cpu"), ModelSpec())
    try:
        yield request.param, {**run_cases(backend), **run_chunk_cases(backend)}, backend
    finally:
        backend.close()


@pytest.mark.parametrize("case", list(CASES))
def test_same_losses_and_gradient_as_pytorch(reference, distributed, case):
    name, results, _ = distributed
    for pass_type in ("forward", "forward_backward"):
        got, ref = results[case, pass_type], reference[case, pass_type]
        assert len(got.outputs) == len(ref.outputs)
        np.testing.assert_allclose([o.loss for o in got.outputs], [o.loss for o in ref.outputs], rtol=1e-4)
        for o, r in zip(got.outputs, ref.outputs):
            np.testing.assert_allclose(o.logprobs, r.logprobs, rtol=1e-4, atol=1e-5)
    got, ref = results[case, "forward_backward"], reference[case, "forward_backward"]
    assert len(got.mem_peak_bytes_per_rank) == 2 and all(m > 100 * 1024**2 for m in got.mem_peak_bytes_per_rank)
    assert got.mem_peak_bytes == max(got.mem_peak_bytes_per_rank)
    assert ref.grad_norm > 0
    assert math.isclose(got.grad_norm, ref.grad_norm, rel_tol=1e-4), (name, case, got.grad_norm, ref.grad_norm)


@pytest.mark.parametrize("chunk", ["default", 37])
def test_chunked_logprobs_match_full_logits_on_each_backend(distributed, chunk):
    name, results, _ = distributed
    full = results["mtpm=700", "forward_backward", None]
    got = (
        results["mtpm=700", "forward_backward"]
        if chunk == "default"
        else results["mtpm=700", "forward_backward", chunk]
    )
    np.testing.assert_allclose([o.loss for o in got.outputs], [o.loss for o in full.outputs], rtol=1e-5)
    for o, r in zip(got.outputs, full.outputs):
        np.testing.assert_allclose(o.logprobs, r.logprobs, rtol=1e-5, atol=1e-6)
    assert math.isclose(got.grad_norm, full.grad_norm, rel_tol=1e-5), (name, chunk, got.grad_norm, full.grad_norm)


def test_fsdp2_runs_bf16_with_fp32_gradient_reduction(reference):
    """model.dtype=bfloat16 on gloo: the policy is checked inside the ranks; answers stay near float32's."""
    spec = BackendSpec(name="fsdp2", world_size=2, device="cpu", gradient_checkpointing=True,
                       hooks="tests.probes:FSDP2ExpectsBf16Policy")
    with make_backend(spec, ModelSpec(dtype="bfloat16")) as backend:
        command = make_command("forward_backward", EXAMPLES, 700, 1)
        chunked = backend.run_pass(command)
        full = backend.run_pass(command.replace(logprob_chunk_tokens=None))
    ref = reference["mtpm=700", "forward_backward"]
    for got in (chunked, full):
        np.testing.assert_allclose([o.loss for o in got.outputs], [o.loss for o in ref.outputs], rtol=2e-2)
        assert math.isclose(got.grad_norm, ref.grad_norm, rel_tol=5e-2)
    np.testing.assert_allclose([o.loss for o in chunked.outputs], [o.loss for o in full.outputs], rtol=1e-3)


def test_fsdp2_pads_unequal_ranks_with_dummies(distributed):
    name, results, _ = distributed
    plan = results["mtpm=700", "forward_backward"].plan
    assert plan["n_microbatches"][0] != plan["n_microbatches"][1]  # ranks really differ
    lonely = results["n_examples=1", "forward_backward"].plan
    assert lonely["n_microbatches"] == [1, 0]  # rank 1 received nothing
    if name == "fsdp2":
        # every rank steps the same number of times; the short one ran dummies
        steps = [m + d for m, d in zip(plan["n_microbatches"], plan["n_dummy"])]
        assert steps[0] == steps[1] and sum(plan["n_dummy"]) > 0
        assert lonely["n_dummy"] == [0, 1]
    else:
        assert plan["n_dummy"] == [0, 0] and lonely["n_dummy"] == [0, 0]
    balanced = results["balanced mtpm=700", "forward_backward"].plan
    greedy_steps = max(m + d for m, d in zip(plan["n_microbatches"], plan["n_dummy"]))
    assert balanced["planner"] == "balanced" and balanced["steps"] <= greedy_steps
    assert balanced["n_microbatches"][0] == balanced["n_microbatches"][1]  # equal work, equal steps
    three = results["balanced n_examples=3", "forward_backward"].plan
    assert sum(three["n_microbatches"]) == 3 and three["steps"] == 2
    assert three["n_dummy"] == ([0, 1] if name == "fsdp2" else [0, 0])


@pytest.mark.parametrize("case", ["oracle mtpm=28", "oracle packed mtpm=30"])
def test_the_gradient_is_the_hand_computed_one_on_two_ranks(distributed, case):
    """Not only equal to pytorch's: equal to a plain forward per example, summed and divided by the batch's weight."""
    name, results, _ = distributed
    examples = CASES[case][0]
    expected = oracle(examples)
    got = results[case, "forward_backward"]
    assert sum(m > 0 for m in got.plan["n_microbatches"]) == 2 and got.plan["max_microbatch_size"] > 1
    for i, out in enumerate(got.outputs):
        np.testing.assert_allclose(out.logprobs, expected["logprobs"][i], rtol=1e-4, atol=1e-5)
        assert math.isclose(out.loss, expected["losses"][i], rel_tol=1e-4)
    assert math.isclose(got.grad_norm, expected["grad_norm"], rel_tol=1e-4), (
        name,
        got.grad_norm,
        expected["grad_norm"],
    )


def test_workers_stop_at_close(distributed):
    """close() stops every rank: the processes are gone (exited on their own, status 0), not just signalled."""
    _, _, backend = distributed
    procs = [psutil.Process(pid) for pid in backend.pids()]
    assert len(procs) == 2 and all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    backend.close()  # the results the other tests read were all gathered when the fixture started
    assert [p.is_running() for p in procs] == [False, False]  # is_running also tells a reused pid apart
    assert [p.exitcode for p in backend.procs] == [0, 0]  # each rank left its command loop, none was killed


@pytest.mark.parametrize(
    "cls, hooks",
    [(FSDP2Backend, "tests.faults:FSDP2RaiseMidPass"), (MegatronDDPBackend, "tests.faults:MegatronRaiseMidPass")],
)
def test_a_worker_that_raises_names_its_rank_and_leaves_no_process(cls, hooks):
    before = _pids(worker_children())
    backend = cls(BackendSpec(name=cls.name, world_size=2, device="cpu"), ModelSpec(), hooks_path=hooks)
    pids = backend.pids()
    assert len(pids) == 2
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        backend.run_pass(make_command("forward_backward", EXAMPLES, 300, 1))
    assert time.monotonic() - started < 30
    assert str(info.value).startswith("rank 1 failed during forward_backward: RuntimeError: injected failure")
    assert "injected failure" in info.value.details  # the traceback is kept for the log
    assert worker_children(before) == []


def test_fsdp2_a_short_rank_runs_a_dummy_step_and_the_gradient_is_the_oracles():
    """Three examples on two ranks: rank 1 runs one real step and one dummy; the answer is the hand-computed one."""
    examples = tiny_examples()[:3]
    with FSDP2Backend(BackendSpec(name="fsdp2", world_size=2, device="cpu"), ModelSpec()) as backend:
        result = backend.run_pass(make_command("forward_backward", examples, None, 1))
    assert result.plan["n_microbatches"] == [2, 1] and result.plan["n_dummy"] == [0, 1]
    assert math.isclose(result.grad_norm, oracle(examples)["grad_norm"], rel_tol=1e-4)


@pytest.mark.parametrize("name", ["fsdp2", "megatron_ddp"])
def test_every_rank_plans_with_the_cap_and_the_gradient_is_the_oracles(name):
    """The cap on sequences per micro-batch rides in each rank's command and every rank plans its row with
    it: rows of 3 become rows of at most 2 on both ranks, the gathered plan's lower bound counts the cap (1 step
    without it), and the answer is still the hand-computed one."""
    from balance_batch.stats import lower_bound_steps

    examples = tiny_examples()
    lengths = [len(e) for e in examples]
    with make_backend(BackendSpec(name=name, world_size=2, device="cpu"), ModelSpec()) as backend:
        result = backend.run_pass(make_command("forward_backward", examples, 30, 1, planner="balanced", layout="packed",
                                               max_seqs_per_microbatch=2))
    plan = result.plan
    assert (
        plan["max_microbatch_size"] == 2 and plan["n_microbatches"] == [2, 2] and plan["max_seqs_per_microbatch"] == 2
    )
    assert plan["lower_bound_steps"] == lower_bound_steps(lengths, 2, 30, 1, max_seqs=2) == 2
    expected = oracle(examples)
    for i, out in enumerate(result.outputs):
        assert math.isclose(out.loss, expected["losses"][i], rel_tol=1e-4)
    assert math.isclose(result.grad_norm, expected["grad_norm"], rel_tol=1e-4), (name, result.grad_norm)


def test_a_step_count_mismatch_is_a_clear_error_in_seconds():
    """A rank that would skip its dummy steps: named with both counts before any step, not a crash or a hang."""
    before = _pids(worker_children())
    # a short collective time-out: without the check, the unequal ranks fail (gloo) within it instead of hanging
    backend = FSDP2Backend(BackendSpec(name="fsdp2", world_size=2, device="cpu", dist_timeout_s=60), ModelSpec(),
                           hooks_path="tests.faults:FSDP2Rank1DropsItsDummies")
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        backend.run_pass(make_command("forward", EXAMPLES[:1], None, 1))  # rank 1's only step is a dummy
    assert time.monotonic() - started < 30
    message = str(info.value)
    assert "\n" not in message and message.startswith("rank ") and "failed during forward: StepCountMismatch" in message
    assert "rank 0 has 1, rank 1 has 0" in message
    assert worker_children(before) == []


def test_ranks_get_the_environment_of_their_start_not_the_fork_servers(monkeypatch):
    """Ranks are forked by a server started once per process (backends/runtime/forkserver.py): a variable set after
    it started still reaches the next ranks, as spawn passed it, and one removed is gone there."""
    from multiprocessing import forkserver

    from backends.runtime.forkserver import start_early

    start_early()
    assert forkserver._forkserver._forkserver_pid is not None  # running before the variable is set
    monkeypatch.setenv("BALANCE_BATCH_TEST_PROBE", "set-after-the-fork-server")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the ranks' threads follow it, as the in-process backend's do
    with FSDP2Backend(BackendSpec(name="fsdp2", world_size=2, device="cpu"), ModelSpec(),
                      hooks_path="tests.probes:FSDP2SeesItsControllersEnvironment") as backend:
        assert backend.run_pass(make_command("forward", EXAMPLES[:2], None, 1)).outputs
        assert backend.threads_per_rank == 3
    monkeypatch.delenv("BALANCE_BATCH_TEST_PROBE")
    with pytest.raises(BackendError, match="BALANCE_BATCH_TEST_PROBE=None"):
        FSDP2Backend(BackendSpec(name="fsdp2", world_size=2, device="cpu"), ModelSpec(),
                     hooks_path="tests.probes:FSDP2SeesItsControllersEnvironment")


# A stand-in for fla, whose fla/utils.py calls torch.cuda.get_device_capability() at import: a process that imported
# it has a CUDA context, and a child it forks cannot use CUDA. Here the child ends at once, with a code of its own.
_FAKE_FLA = "import os\nos.register_at_fork(after_in_child=lambda: os._exit(86))\n"
_FORK_ONE_RANK = """
import os
from backends.runtime.forkserver import rank_context
rank = rank_context().Process(target=os.getpid)
rank.start()
rank.join(120)
print(rank.exitcode)
"""


def test_the_fork_server_imports_nothing_that_makes_a_cuda_context(tmp_path):
    """A rank forked after its fork server made a CUDA context cannot use CUDA ("Cannot re-initialize CUDA in forked
    subprocess"): the server's preload must not import the kernel packages (transformers' Qwen3.5 modeling module
    imports fla through its hub-kernel fallback). A fake fla on the path stands in for CUDA: a rank forked from a
    server that imported it ends with 86."""
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text(_FAKE_FLA)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))  # the server's path too
    proc = subprocess.run([sys.executable, "-c", _FORK_ONE_RANK], cwd=REPO, env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "0", proc.stdout + proc.stderr[-2000:]


def test_closing_leaves_no_process():
    before = _pids(worker_children())
    backend = FSDP2Backend(BackendSpec(name="fsdp2", world_size=2, device="cpu"), ModelSpec())
    backend.run_pass(make_command("forward", EXAMPLES[:4], None, 2))
    assert len(worker_children(before)) == 2
    backend.close()
    assert worker_children(before) == []


def test_cli_backends_agree_and_leave_nothing_in_their_session(workdir):
    """Through the CLI, the backends' outputs are within 1e-4 of pytorch's, and the sweep's session empty at the end.

    Each point closes its backend as a single run does (the session check once also ran single runs of fsdp2 and
    megatron_ddp: the same close, in two more cold processes)."""
    sweep = workdir / "sweep"
    log = workdir / "log.txt"
    proc = start_harness(
        "-m",
        "backend=pytorch,fsdp2,megatron_ddp",
        "world_size=null",
        "mtpm=700",
        "planner=greedy",  # the original planner's plan: fsdp2's second rank pads its schedule with a dummy
        "layout=padded",
        "bench.baseline=false",
        "workload=smoke",
        "bench.save_outputs=true",
        "bench.warmup=0",
        "bench.repeat=1",
        f"hydra.sweep.dir={sweep}",
        cwd=workdir,
        log=log,
    )
    assert proc.wait(timeout=300) == 0, log.read_text()
    # The harness ran in a session of its own (start_new_session): every process it started, and every one those
    # started, is in that session. Checked at once, with no wait, exited ones not yet reaped included: the harness
    # exits only once all of them have exited and been reaped.
    left = left_behind(proc.pid)
    assert left == [], left
    assert "starting 2 ranks" in log.read_text()  # the session did hold ranks while it ran
    results = sweep_results(sweep)
    assert [r["backend"] for r in results] == ["pytorch", "fsdp2", "megatron_ddp"]
    assert [r["world_size"] for r in results] == [1, 2, 2]
    assert all(r["status"] == "ok" for r in results)
    assert results[1]["plan"]["n_dummy"] == [0, 1]
    # what was built, as each backend reports it (the workers from rank 0): the same model everywhere
    assert results[0]["model"]["built"]["architecture"] == "Qwen3_5MoeForCausalLM"
    assert [r["model"]["built"] for r in results[1:]] == [results[0]["model"]["built"]] * 2
    outs = [load_json(p.parent / "example_outputs.json") for p in sorted(sweep.glob("*/results.json"))]
    for out in outs[1:]:
        np.testing.assert_allclose(out["forward_backward"]["loss"], outs[0]["forward_backward"]["loss"], rtol=1e-4)
        assert math.isclose(
            out["forward_backward"]["grad_norm"], outs[0]["forward_backward"]["grad_norm"], rel_tol=1e-4
        )
