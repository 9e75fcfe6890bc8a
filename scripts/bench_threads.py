"""Time the in-process PyTorch backend's fwd+bwd under each CPU thread setting, on the machine as it is and beside
busy processes, each setting in a fresh interpreter (OpenMP reads its settings once, when torch loads).

    PYTHONPATH=. python scripts/bench_threads.py                 # as the machine is, then beside 2 busy processes
    PYTHONPATH=. python scripts/bench_threads.py --load 0        # as the machine is only (a quiet machine: quiet)

The settings: the harness's threads with OpenMP's default waiting (its threads spin for a while before sleeping: what
ran before harness/__init__.py set a default), with OMP_WAIT_POLICY=PASSIVE (they sleep at once: the harness's
default), and one thread (nothing to wait for). Each line gives the best
and the median wall time of a pass, and the process's CPU time over wall time ("busy": near the thread count when
every thread had a core). Compare lines of one run; a busy process is `while True: pass`, one per --load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "spin": {},  # OMP_WAIT_POLICY unset, and torch loaded before the harness could set it
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}


def child(n_examples: int, length: int, repeat: int) -> None:
    """One setting: build the backend as the harness does, one warm-up pass, then ``repeat`` timed ones (JSON)."""
    import torch  # noqa: F401 - first: OpenMP reads its settings now, before harness/__init__.py sets a default

    from backends.messages import make_command
    from backends.pytorch import PyTorchBackend
    from backends.specs import BackendSpec, ModelSpec
    from harness.data.workload import make_examples

    backend = PyTorchBackend(BackendSpec(name=PyTorchBackend.name, device="cpu"), ModelSpec())
    examples = make_examples([length] * n_examples, 2048, seed=0)
    command = make_command("forward_backward", examples, None, 1)
    backend.run_pass(command)
    walls, busy = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        backend.run_pass(command)
        wall = time.perf_counter() - t0
        walls.append(wall)
        busy.append((time.process_time() - c0) / wall)
    backend.close()
    print(json.dumps({"threads": backend.threads_per_rank, "walls": walls, "busy": busy,
                      "tokens": n_examples * length}))


def measure(name: str, env: dict, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--n-examples", str(args.n_examples), "--length", str(args.length),
           "--repeat", str(args.repeat)]
    full = {**os.environ, **env}
    for key in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS"):
        if key not in env:
            full.pop(key, None)
    out = subprocess.run(cmd, env=full, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_all(args, load: int) -> None:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        print(f"-- beside {load} busy process(es); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
              flush=True)
        for name, env in SETTINGS.items():
            r = measure(name, env, args)
            walls = r["walls"]
            print(f"{name:>9}: {r['threads']} thread(s), fwd+bwd of {r['tokens']:,} tokens: best {min(walls):6.2f} s, "
                  f"median {statistics.median(walls):6.2f} s ({r['tokens'] / statistics.median(walls):7,.0f} tok/s), "
                  f"busy {statistics.median(r['busy']):.2f}", flush=True)
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the second round (0: no second round)")
    ap.add_argument("--n-examples", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.n_examples, args.length, args.repeat)
        return
    run_all(args, 0)
    if args.load:
        run_all(args, args.load)


if __name__ == "__main__":
    main()
