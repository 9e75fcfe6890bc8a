"""python -m harness.serve as a real server on a loopback port: auth, validation, live budget, shutdown."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from balance_batch import plan_step
from tests.conftest import harness_env, load_json, run_harness, session_processes

TOKEN = "test-token-7f3a"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    control: Path
    log: Path

    def call(self, method: str, path: str, body=None, token: str | None = TOKEN, raw: bytes | None = None):
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def config(self) -> dict:
        status, body = self.call("GET", "/admin/config")
        assert status == 200, body
        return body


def start_server(tmp: Path, *args: str, token: str | None = TOKEN, **env_extra: str) -> Server:
    port = free_port()
    control = tmp / "control.ctl"
    log = tmp / "server.log"
    env = harness_env(**env_extra)
    env.pop("BALANCE_BATCH_ADMIN_TOKEN", None)
    if token:
        env["BALANCE_BATCH_ADMIN_TOKEN"] = token
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "harness.serve", *args, f"server.port={port}", f"server.control_path={control}",
             f"hydra.run.dir={tmp / 'run'}"],
            cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", proc, control, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()}")
        try:
            if server.call("GET", "/healthz", token=None)[0] == 200:
                return server
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"server did not come up:\n{log.read_text()}")


def stop(server: Server) -> int:
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while session_processes(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return code


def examples(lengths, vocab=2048, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(0, vocab, n).tolist()
        out.append(
            {"input_ids": ids, "target_tokens": ids[1:] + [0], "weights": [0.0] * (n // 2) + [1.0] * (n - n // 2)}
        )
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    s = start_server(tmp, "backend=pytorch", "workload=smoke", "server.max_request_tokens=20000", "server.queue_size=0")
    yield s
    assert stop(s) == 0
    assert session_processes(s.proc.pid) == []
    assert not s.control.exists()  # the control file goes with the server


ADMIN_ROUTES = [("GET", "/admin/config", None), ("POST", "/admin/set_max_tokens_per_microbatch", {"value": 5}),
                ("POST", "/admin/set_micro_batch_size", {"value": 2})]


@pytest.mark.parametrize("method, path, body", ADMIN_ROUTES)
def test_admin_needs_the_right_token(server, method, path, body):
    before = server.config()
    assert server.call(method, path, body, token=None)[0] == 401
    assert server.call(method, path, body, token="wrong")[0] == 403
    assert server.config() == before


@pytest.mark.parametrize("value", [-1, 0, "x", 1.5, True, 10**9, "777"])
def test_bad_values_are_422_and_change_nothing(server, value):
    before = server.config()
    for route in ("/admin/set_max_tokens_per_microbatch", "/admin/set_micro_batch_size"):
        status, body = server.call("POST", route, {"value": value})
        assert status == 422, body
        assert "value" in body["detail"]
    assert server.call("POST", "/admin/set_max_tokens_per_microbatch", {"valu": 5})[0] == 422
    assert server.call("POST", "/admin/set_max_tokens_per_microbatch", raw=b"{not json")[0] == 422
    assert server.config() == before


def test_set_then_a_pass_uses_the_new_budget(server):
    status, body = server.call("POST", "/admin/set_max_tokens_per_microbatch", {"value": 777})
    assert status == 200 and body["max_tokens_per_microbatch"] == 777
    exs = examples([300, 200, 500, 100])
    status, reply = server.call("POST", "/forward", {"examples": exs}, token=None)
    assert status == 200, reply
    assert len(reply["outputs"]) == 4
    assert [len(o["logprobs"]) for o in reply["outputs"]] == [300, 200, 500, 100]
    assert reply["plan"]["max_tokens_per_microbatch"] == 777
    greedy = plan_step([300, 200, 500, 100], world_size=1, max_tokens_per_microbatch=777, layout="padded",
                       planner="greedy", lockstep=False)
    assert reply["plan"]["n_microbatches"] == greedy.stats.n_microbatches
    # back to fixed slices of 2 sequences
    assert server.call("POST", "/admin/set_max_tokens_per_microbatch", {"value": None})[0] == 200
    assert server.call("POST", "/admin/set_micro_batch_size", {"value": 2})[0] == 200
    status, reply = server.call("POST", "/forward_backward", {"examples": exs})
    assert status == 200 and reply["plan"]["max_tokens_per_microbatch"] is None
    assert reply["plan"]["micro_batch_size"] == 2 and reply["plan"]["n_microbatches"] == [2]
    assert reply["grad_norm"] > 0
    assert len(reply["mem_peak_bytes_per_rank"]) == 1 and reply["mem_peak_bytes"] == reply["mem_peak_bytes_per_rank"][0]


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"input_ids": [1, 2, 3], "target_tokens": [2, 3], "weights": [1, 1, 1]}, "same length"),
        ({"input_ids": [], "target_tokens": [], "weights": []}, "non-empty"),
        ({"input_ids": [1, 99999], "target_tokens": [2, 3], "weights": [1, 1]}, "vocabulary"),
        ({"input_ids": [1, -2], "target_tokens": [2, 3], "weights": [1, 1]}, "vocabulary"),
        # beyond int64: refused by its range like any id outside the vocabulary, not an OverflowError's 500
        ({"input_ids": [1, 2], "target_tokens": [2, 10**30], "weights": [1, 1]},
         "target_tokens: token ids must lie in 0..2047"),
        ({"input_ids": [1, 2], "target_tokens": [2, 3], "weights": [1, "a"]}, "weights"),
        ({"input_ids": "1 2", "target_tokens": [2, 3], "weights": [1, 1]}, "input_ids"),
        # float32 cannot hold the first two; the third overflows the loss
        ({"input_ids": [1, 2], "target_tokens": [2, 3], "weights": [1, 1e308]}, "weights"),
        ({"input_ids": [1, 2], "target_tokens": [2, 3], "weights": [1, float("inf")]}, "weights"),
        ({"input_ids": [1, 2], "target_tokens": [2, 3], "weights": [1, 1e38]}, "weights"),
        ({"input_ids": [1, 2], "target_tokens": [2, 3], "weights": [1, float("nan")]}, "weights"),
    ],
)
def test_malformed_examples_are_422(server, bad, needle):
    status, body = server.call("POST", "/forward", {"examples": [examples([5])[0], bad]})
    assert status == 422 and needle in body["detail"] and "examples[1]" in body["detail"]


def test_oversized_requests_are_refused(server):
    status, body = server.call("POST", "/forward", {"examples": examples([15000, 6000])})
    assert status == 413 and "max_request_tokens" in body["detail"]
    assert server.call("POST", "/forward", {"examples": []})[0] == 422


def test_a_full_queue_answers_503_and_an_fsdp2_server_stops_clean(tmp_path):
    """Deterministic: a rank held stopped (SIGSTOP) keeps the first pass running while the second request arrives.
    Then the lock-step server runs a budget set live (its short rank pads with a dummy) and its shutdown leaves no
    process: the server, its two ranks and their helpers are gone."""
    import psutil

    # the rank is held stopped on purpose while requests arrive: its heartbeat must not end the pass first
    s = start_server(tmp_path, "backend=fsdp2", "world_size=2", "workload=smoke", "server.queue_size=0",
                     BALANCE_BATCH_STALE_AFTER_S="120")
    sid = s.proc.pid
    assert len(session_processes(sid)) >= 3  # the server and two ranks
    results = {}
    first = threading.Thread(
        target=lambda: results.setdefault("first", s.call("POST", "/forward", {"examples": examples([30, 20])}))
    )
    rank1 = None
    try:
        status, health = s.call("GET", "/healthz", token=None)
        assert status == 200 and health["pending"] == 0
        rank1 = psutil.Process(health["pids"][-1])
        rank1.suspend()  # the next pass cannot finish until this rank runs again
        first.start()
        deadline = time.monotonic() + 60
        while s.call("GET", "/healthz", token=None)[1]["pending"] != 1:  # the first pass holds the only slot
            assert time.monotonic() < deadline and first.is_alive(), results
            time.sleep(0.05)
        results["second"] = s.call("POST", "/forward", {"examples": examples([10])})
        assert first.is_alive()  # still held: the answer above was given while the slot was taken
    finally:
        if rank1 is not None:
            rank1.resume()
        if first.ident is not None:
            first.join(timeout=120)
        try:
            assert results.get("first", [None])[0] == 200, results
            assert results["second"][0] == 503 and "busy" in results["second"][1]["detail"]
            assert s.call("POST", "/forward", {"examples": examples([10])})[0] == 200  # the slot is free again
            assert s.call("GET", "/healthz", token=None)[1]["pending"] == 0
            assert s.call("POST", "/admin/set_max_tokens_per_microbatch", {"value": 300})[0] == 200
            status, reply = s.call("POST", "/forward_backward", {"examples": examples([100, 250, 40])})
            assert (
                status == 200
                and reply["plan"]["max_tokens_per_microbatch"] == 300
                and len(reply["plan"]["n_dummy"]) == 2
            )
        finally:
            assert stop(s) == 0
    assert session_processes(sid) == []


def test_a_corrupt_control_file_keeps_the_last_good_value(server):
    assert server.call("POST", "/admin/set_max_tokens_per_microbatch", {"value": 900})[0] == 200
    server.control.write_text("{ this is not json")
    for _ in range(2):
        status, reply = server.call("POST", "/forward", {"examples": examples([100, 200])})
        assert status == 200 and reply["plan"]["max_tokens_per_microbatch"] == 900
    log = server.log.read_text()
    assert log.count("unreadable or corrupt") == 1  # one warning, not one per pass
    assert server.call("POST", "/admin/set_max_tokens_per_microbatch", {"value": 901})[0] == 200
    assert server.config()["max_tokens_per_microbatch"] == 901


def test_client_mode_writes_the_same_results_json(server, tmp_path):
    run = tmp_path / "run"
    proc = run_harness(f"target.url={server.url}", "mtpm=640", "workload=smoke", "bench.warmup=0", "bench.repeat=2",
                       f"hydra.run.dir={run}", cwd=tmp_path, env=harness_env(BALANCE_BATCH_ADMIN_TOKEN=TOKEN))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = load_json(run / "results.json")
    assert res["status"] == "ok" and res["backend"] == "pytorch" and res["mtpm"] == 640
    assert res["target"]["url"] == server.url
    assert res["plan"]["max_tokens_per_microbatch"] == 640
    assert len(res["passes"]["forward_backward"]["elapsed_s"]) == 2
    assert res["passes"]["forward"]["util_pct"] > 0  # the server's processes are sampled on this machine
    assert server.config()["max_tokens_per_microbatch"] == 640


def _no_token_env() -> dict:
    env = harness_env()
    env.pop("BALANCE_BATCH_ADMIN_TOKEN", None)
    return env


def test_client_without_the_token_never_records_a_budget_the_server_did_not_run(server, tmp_path):
    assert server.call("POST", "/admin/set_max_tokens_per_microbatch", {"value": 2048})[0] == 200
    common = ["workload=smoke", "workload.n_examples=4", "bench.warmup=0", "bench.repeat=1", "logger=none"]
    asked = run_harness(f"target.url={server.url}", "mtpm=65536", *common, f"hydra.run.dir={tmp_path / 'asked'}",
                        cwd=tmp_path, env=_no_token_env())
    assert asked.returncode == 2
    text = asked.stdout + asked.stderr
    assert "Traceback" not in text
    line = next(ln for ln in text.splitlines() if "ERROR" in ln)
    assert "mtpm" in line and "2048" in line and "BALANCE_BATCH_ADMIN_TOKEN" in line
    assert load_json(tmp_path / "asked" / "results.json")["status"] == "error"
    assert server.config()["max_tokens_per_microbatch"] == 2048

    same = run_harness(f"target.url={server.url}", "mtpm=2048", *common, f"hydra.run.dir={tmp_path / 'same'}",
                       cwd=tmp_path, env=_no_token_env())
    assert same.returncode == 0, same.stdout + same.stderr
    res = load_json(tmp_path / "same" / "results.json")
    assert res["status"] == "ok" and res["mtpm"] == 2048 and res["plan"]["max_tokens_per_microbatch"] == 2048
    assert res["model"]["built"]["architecture"] == "Qwen3_5MoeForCausalLM"  # reported by the server
    assert res["load"]["method"] and res["load"]["elapsed_s"] > 0  # the server's load, as it reported it
    assert res["precision"]["compute"] == "float32" and res["precision"]["adapters"] == "float32"  # the server's
    assert all(p["kernels"]["delta_rule"] == {"segment-scan": p["kernels"]["short_conv"]["torch-conv1d"]}
               for p in res["passes"].values())  # what the server's ranks ran, carried in each reply


def test_a_budget_changed_during_a_client_run_fails_the_point(server, monkeypatch):
    from backends.errors import BackendError
    from backends.messages import make_command
    from harness.data.workload import make_examples
    from harness.server.client import RemoteBackend

    monkeypatch.delenv("BALANCE_BATCH_ADMIN_TOKEN", raising=False)
    assert server.call("POST", "/admin/set_max_tokens_per_microbatch", {"value": 700})[0] == 200
    assert server.call("POST", "/admin/set_micro_batch_size", {"value": 1})[0] == 200  # whatever ran before
    remote = RemoteBackend(server.url, timeout_s=120)
    assert remote.configure(700, 1) == (700, 1)
    exs = make_examples([50, 80], remote.vocab_size, seed=0)
    assert remote.run_pass(make_command("forward", exs, 700, 1)).plan["max_tokens_per_microbatch"] == 700
    assert server.call("POST", "/admin/set_max_tokens_per_microbatch", {"value": 900})[0] == 200  # another client
    with pytest.raises(BackendError, match="changed during the run"):
        remote.run_pass(make_command("forward", exs, 700, 1))


def test_a_client_leaving_mid_request_leaves_no_traceback(server):
    body = json.dumps({"examples": examples([2000] * 4)}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    head = b"POST /forward_backward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", port)) as s:  # leaves before sending the whole body
        s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body[:100])
        time.sleep(0.5)
    with socket.create_connection(("127.0.0.1", port)) as s:  # leaves while its pass runs
        s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)
    deadline = time.monotonic() + 120
    while (
        status := server.call("POST", "/forward", {"examples": examples([10])})[0]
    ) == 503 and time.monotonic() < deadline:
        time.sleep(0.5)  # busy with the abandoned pass (this server queues none)
    assert status == 200
    log = server.log.read_text()
    assert "left before sending its whole request" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_a_port_in_use_fails_before_the_model_loads(server, tmp_path):
    port = server.url.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "harness.serve", "backend=fsdp2", f"server.port={port}",
                           f"hydra.run.dir={tmp_path}"], cwd=tmp_path, env=harness_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    text = proc.stdout + proc.stderr
    assert "server.port" in text and port in text and "Traceback" not in text
    assert "starting 2 ranks" not in text  # no worker was started


def test_an_unwritable_control_path_is_one_line(tmp_path, unwritable_dir):
    target = unwritable_dir / "control.ctl"
    proc = subprocess.run([sys.executable, "-m", "harness.serve", "backend=pytorch", "server.port=0",
                           f"server.control_path={target}", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=harness_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    text = proc.stdout + proc.stderr
    assert "server.control_path" in text and str(target) in text and "Traceback" not in text


def test_admin_is_refused_without_a_configured_token(tmp_path):
    s = start_server(tmp_path, "backend=pytorch", token=None)
    try:
        status, body = s.call("POST", "/admin/set_max_tokens_per_microbatch", {"value": 5})
        assert status == 403 and "BALANCE_BATCH_ADMIN_TOKEN" in body["detail"]
        assert s.call("POST", "/forward", {"examples": examples([8])}, token=None)[0] == 200
    finally:
        assert stop(s) == 0


def test_no_token_refuses_a_public_address(tmp_path):
    env = harness_env()
    env.pop("BALANCE_BATCH_ADMIN_TOKEN", None)
    proc = subprocess.run([sys.executable, "-m", "harness.serve", "server.host=0.0.0.0", f"hydra.run.dir={tmp_path}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    text = proc.stdout + proc.stderr
    assert "server.host" in text and "BALANCE_BATCH_ADMIN_TOKEN" in text and "Traceback" not in text


def test_healthz_tells_the_truth_after_a_worker_dies_and_the_next_pass_restarts(tmp_path):
    import psutil

    s = start_server(tmp_path, "backend=fsdp2", "world_size=2")
    sid = s.proc.pid
    try:
        status, health = s.call("GET", "/healthz", token=None)
        assert status == 200 and health["status"] == "ok" and health["restarts"] == 0
        assert health["model"]["architecture"] == "Qwen3_5MoeForCausalLM"  # reported by rank 0
        assert 0 < health["model"]["n_trainable_params"] < health["model"]["n_params"]
        workers = health["pids"][1:]
        psutil.Process(workers[-1]).kill()
        deadline = time.monotonic() + 30
        while (answer := s.call("GET", "/healthz", token=None))[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, down = answer
        assert status == 503 and down["status"] == "down"
        assert "rank 1" in down["reason"] and "SIGKILL" in down["reason"] and "next pass" in down["recovery"]

        status, reply = s.call("POST", "/forward", {"examples": examples([100, 40])})
        assert status == 200, reply  # the workers were started again
        status, health = s.call("GET", "/healthz", token=None)
        assert status == 200 and health["restarts"] == 1 and set(health["pids"][1:]).isdisjoint(workers)
        assert "starting them again" in s.log.read_text()
    finally:
        assert stop(s) == 0
    assert session_processes(sid) == []


def test_a_restart_that_fails_keeps_the_server_down_with_the_first_cause():
    import psutil

    from backends.errors import BackendError
    from backends.messages import make_command
    from backends.specs import BackendSpec, ModelSpec
    from backends.start import make_backend
    from harness.data.workload import make_examples
    from harness.server.supervisor import ServedBackend

    first = [BackendSpec(name="fsdp2", world_size=2, device="cpu")]  # then every start fails
    served = ServedBackend(
        lambda: make_backend(first.pop() if first else BackendSpec(name="no_such_backend"), ModelSpec())
    )
    try:
        assert served.failure() is None
        psutil.Process(served.backend.pids()[0]).kill()
        deadline = time.monotonic() + 30
        while served.failure() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "rank 0 was killed by SIGKILL" in served.failure()
        command = make_command("forward", make_examples([20], 2048, seed=0), None, 1)
        for _ in range(2):  # every pass tries again; the reason keeps the first cause
            with pytest.raises(BackendError, match="did not start again"):
                served.run_pass(command)
            assert served.failure().startswith("the workers were down (rank 0 was killed by SIGKILL) and did not start")
    finally:
        served.close()


def test_a_packed_server_is_recorded_as_it_runs_by_its_client_and_keeps_its_budget(tmp_path):
    """A client of a balanced packed server once recorded its own greedy padded planner and plan.json;
    "unset" written into the server's control file made every pass a 500 and stuck as the last good budget.
    Its cap on sequences per micro-batch is fixed for its life and recorded by its client the same way."""
    s = start_server(tmp_path, "backend=pytorch", "workload=smoke", "layout=packed", "planner=balanced", "mtpm=4096",
                     "max_seqs_per_microbatch=2")
    try:
        health = s.call("GET", "/healthz", token=None)[1]
        assert (health["layout"], health["planner"]) == ("packed", "balanced") and health["cost_model"]["a"] > 0
        assert health["max_seqs_per_microbatch"] == 2
        run = tmp_path / "client"
        # the client asks for the original procedure (since balanced packed became the default with a budget, a
        # client left to its defaults would record the server's planner and layout even if it recorded its own)
        proc = run_harness(f"target.url={s.url}", "mtpm=4096", "planner=greedy", "layout=padded", "workload=smoke",
                           "workload.n_examples=6", "bench.warmup=0", "bench.repeat=1", "logger=none",
                           f"hydra.run.dir={run}", cwd=tmp_path, env=_no_token_env())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # it says it records the server's
        assert "plans with planner=balanced layout=packed max_seqs_per_microbatch=2" in proc.stdout + proc.stderr
        res, plan = load_json(run / "results.json"), load_json(run / "plan.json")
        assert (res["planner"], res["layout"], res["max_seqs_per_microbatch"]) == ("balanced", "packed", 2)
        assert res["plan"]["max_seqs_per_microbatch"] == plan["max_seqs_per_microbatch"] == 2
        assert (res["plan"]["planner"], res["plan"]["layout"], res["plan"]["pad_efficiency"]) == (
            "balanced",
            "packed",
            1.0,
        )
        # plan.json is the plan the server ran: the same planner, layout, cost model and micro-batch count
        assert (plan["planner"], plan["layout"], plan["cost_model"]) == ("balanced", "packed", health["cost_model"])
        ran = [b for s_ in plan["schedules"] for b in s_ if b is not None]
        assert len(ran) == sum(res["plan"]["n_microbatches"])
        assert max(len(b) for b in ran) == res["plan"]["max_microbatch_size"] == 2  # the server's cap is what ran

        s.control.write_text('{"max_tokens_per_microbatch": "unset", "micro_batch_size": 1}')
        for _ in range(2):
            status, reply = s.call("POST", "/forward", {"examples": examples([100, 200])})
            assert status == 200 and reply["plan"]["max_tokens_per_microbatch"] == 4096
        s.control.write_text("{ not json")
        assert s.call("POST", "/forward", {"examples": examples([100])})[1]["plan"]["max_tokens_per_microbatch"] == 4096
        assert "not allowed with planner=balanced" in s.log.read_text()
    finally:
        assert stop(s) == 0


@pytest.fixture(scope="module")
def peer_server(tmp_path_factory):
    """A server whose planner refuses what its peer's code refuses: verl, whose budget is strict."""
    tmp = tmp_path_factory.mktemp("serve-verl")
    s = start_server(tmp, "backend=pytorch", "workload=smoke", "planner=verl", "mtpm=1024")
    yield s
    assert stop(s) == 0


def test_what_a_peer_planner_refuses_is_a_422_in_one_line_and_null_is_refused(peer_server):
    """A pass verl refuses (an example over its budget) was a bare 500 with an ASGI traceback, and a budget of null,
    accepted, made every later pass one."""
    status, body = peer_server.call("POST", "/forward", {"examples": examples([1500, 100])})
    assert status == 422, body
    detail = body["detail"]
    assert "\n" not in detail and "verl refuses example 0 of 1500 tokens" in detail
    assert "this server: max_tokens_per_microbatch=1024" in detail
    status, body = peer_server.call("POST", "/admin/set_max_tokens_per_microbatch", {"value": None})
    assert status == 422 and "null is not allowed with planner=verl" in body["detail"], body
    assert peer_server.config()["max_tokens_per_microbatch"] == 1024
    status, reply = peer_server.call("POST", "/forward", {"examples": examples([500, 100])})
    assert status == 200 and reply["plan"]["max_tokens_per_microbatch"] == 1024, reply
    log = peer_server.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_a_client_run_the_plan_refuses_leaves_the_servers_budget_as_it_was(peer_server, tmp_path):
    """The client once set its budget on the server, then found its plan refused: the server kept a budget no run
    measured."""
    run = tmp_path / "run"
    proc = run_harness(f"target.url={peer_server.url}", "mtpm=256", "workload=smoke", "workload.n_examples=4",
                       "bench.warmup=0", "bench.repeat=1", "logger=none", f"hydra.run.dir={run}", cwd=tmp_path,
                       env=harness_env(BALANCE_BATCH_ADMIN_TOKEN=TOKEN))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "verl refuses example" in text and "Traceback" not in text
    assert load_json(run / "results.json")["status"] == "error"
    assert peer_server.config()["max_tokens_per_microbatch"] == 1024
