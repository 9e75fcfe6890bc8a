"""Which part this process plays in a run: it leads (Hydra, planning, results.json, W&B) or it follows rank 0.

A process that is no rank of a torchrun / Slurm / submitit job leads its own
run (it spawns its ranks itself). In a launched job only global rank 0 leads;
every other rank follows: no Hydra output, no files, only its share of rank
0's passes, until rank 0 ends the job (backends/runtime/job.py). harness/__main__.py
and run_point (harness/point/task.py) both ask ``leads()``; nothing else decides it.
"""

from __future__ import annotations


def leads() -> bool:
    """True when this process runs the benchmark: it is no launched job's rank, or it is global rank 0.

    In a launched job this connects to the job's store on first use (a UserError
    naming MASTER_ADDR/MASTER_PORT when it cannot be reached).
    """
    from backends.runtime.job import launched_job

    job = launched_job()
    return job is None or job.rank == 0


def follow() -> int:
    """A following rank's whole run: rank 0's commands until rank 0 ends the job; the process's exit status."""
    from backends.runtime.job import launched_job
    from backends.runtime.launched import follow as follow_rank0

    job = launched_job()
    assert job is not None and job.rank != 0, "only a launched job's non-zero rank follows"
    return follow_rank0(job)


def tell_launcher(line: str) -> None:
    """Under torchrun: put this rank's one-line failure in the error file torchrun reads, so its failure summary
    ("traceback : ...") names the cause instead of pointing at its docs; nothing elsewhere.

    torchrun itself still exits 1 when a rank fails (its own status); the rank's exit code (2: a user error) is the
    ``exitcode`` its summary shows.
    """
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):  # a first failure already recorded stays the one shown
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass
