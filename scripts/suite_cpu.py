"""Where a command's CPU goes, by kind of process: how busy the machine was while it ran, and the CPU-seconds of the
processes it started, grouped (pytest workers, ranks, fork servers, CLI runs, torchrun, the C++ compiler, ...).

    python scripts/suite_cpu.py --out cpu.json -- make test

The command and every process under it are sampled every ``--every`` seconds (user + system time, command line, the
parent's); a process is counted at the last sample that saw it, so one that lives less than a sample is missed or
counted short (the compiler's processes most of all), and one that left the tree (reparented to init) is lost.
The machine's busy share comes from /proc/stat (Linux). What it prints is docs/development.md's table of processes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

import psutil

COMPILERS = ("cc1plus", "cc1", "g++", "gcc", "as", "ld", "collect2")


def kind(name: str, cmd: str, parent: str) -> str:
    """The kind of a process, from its name, its command line and its parent's."""
    if name in COMPILERS:
        return "C++ compiler (inductor's kernels)"
    rules = (("warm_cli.py", "warm CLI runs (forked)" if "warm_cli.py" in parent else "warm CLI servers"),
             ("multiprocessing.forkserver", "ranks (forked)" if "forkserver" in parent else "rank fork servers"),
             ("torch.distributed.run", "torchrun agents"), ("exec(eval(sys.stdin", "pytest workers (in-process)"),
             ("-m pytest", "pytest controller"), (" -m pip ", "pip (set-up)"))
    for needle, label in rules:
        if needle in cmd:
            return label
    if "torch.distributed.run" in parent:
        return "torchrun workers"
    if " -m harness" in cmd:
        return "harness CLI (fresh interpreters)"
    return "other python" if "python" in name else f"other: {name}"


def _busy(before: list[int], after: list[int]) -> dict:
    delta = [b - a for a, b in zip(before, after)]
    hz = os.sysconf("SC_CLK_TCK")
    idle = delta[3] + delta[4]
    return {"busy_share": 1 - idle / max(1, sum(delta)), "user_s": (delta[0] + delta[1]) / hz,
            "system_s": delta[2] / hz, "idle_s": idle / hz, "steal_s": delta[7] / hz}


def _stat() -> list[int]:
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:]]


def sample(command: list[str], every: float) -> tuple[int, float, dict, dict]:
    """Run ``command``, sampling it and every process it started (while they are its descendants); its exit code,
    wall seconds, the machine's busy share and the processes seen."""
    seen: dict = {}
    before, start = _stat(), time.monotonic()
    proc = subprocess.Popen(command)
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        for p in processes:
            try:
                with p.oneshot():
                    times, key = p.cpu_times(), (p.pid, p.create_time())
                    if key not in seen:
                        parent = p.parent()
                        seen[key] = [0.0, kind(p.name(), " ".join(p.cmdline()),
                                               " ".join(parent.cmdline()) if parent else "")]
                seen[key][0] = max(seen[key][0], times.user + times.system)
            except psutil.Error:
                continue
        time.sleep(every)
    return proc.returncode, time.monotonic() - start, _busy(before, _stat()), seen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--every", type=float, default=0.3, help="seconds between samples (default 0.3)")
    parser.add_argument("command", nargs="+", help="the command to run, after --")
    args = parser.parse_args(argv)
    code, wall, machine, seen = sample(args.command, args.every)
    cpu, count = collections.Counter(), collections.Counter()
    for seconds, label in seen.values():
        cpu[label] += seconds
        count[label] += 1
    doc = {"command": args.command, "exit": code, "wall_s": wall, "machine": machine,
           "kinds": {label: {"cpu_s": cpu[label], "processes": count[label]} for label in cpu}}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wall {wall:.0f} s, machine busy {machine['busy_share']:.1%} (idle {machine['idle_s']:.0f} core-s)")
    for label, seconds in cpu.most_common():
        print(f"{seconds:8.1f} s {count[label]:5d}  {label}")
    return code


if __name__ == "__main__":
    sys.exit(main())
