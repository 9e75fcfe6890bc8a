"""What each rank of a distributed backend is sent, checked in-process (the real gloo ranks:
tests/integration/test_distributed.py)."""

from __future__ import annotations

from harness.data.workload import make_examples, mixed_lengths


def test_each_rank_is_sent_only_its_share_of_the_examples():
    """Every length goes to every rank (each plans the whole batch), each example only to the rank that runs it."""
    from backends.messages import make_command
    from backends.runtime.ranks import rank_commands

    examples = make_examples(mixed_lengths(16, 64, 512, 42), 2048, 0)
    for lockstep in (False, True):
        command = make_command("forward", examples, 700, 1)
        sent = rank_commands(command, 3, lockstep)
        assert len(sent) == 3
        shares = [set(c.examples) for c in sent]
        assert sorted(i for s in shares for i in s) == list(range(16))  # disjoint, and together all of them
        for rank, c in enumerate(sent):
            assert c.all_lengths() == [len(e) for e in examples]
            assert all(c.examples[i] is examples[i] for i in shares[rank])
            assert c.plan(3, lockstep).schedules == command.plan(3, lockstep).schedules


def test_threads_per_rank_is_one_rule_and_the_in_process_backend_follows_it(monkeypatch):
    """The cores shared by the ranks on the host, or OMP_NUM_THREADS where set, for spawned, launched and in-process
    ranks alike: the in-process PyTorch backend no longer keeps torch's default (a thread per core, whatever ran
    beside it), says what it ran with, and gives the process its own count back at close."""
    import torch

    from backends.pytorch import PyTorchBackend
    from backends.runtime.devices import threads_per_rank, usable_cpu_cores
    from backends.specs import BackendSpec, ModelSpec

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("backends.runtime.devices.usable_cpu_cores", lambda: 8)
    assert [threads_per_rank(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(2) == 3
    monkeypatch.undo()

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(before + 1))  # not what this process runs: the backend must set it
    backend = PyTorchBackend(BackendSpec(name="pytorch", device="cpu"), ModelSpec())
    try:
        assert backend.threads_per_rank == torch.get_num_threads() == before + 1
    finally:
        backend.close()
    assert torch.get_num_threads() == before
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_per_rank(1) == usable_cpu_cores()


def test_a_fork_server_preloads_megatron_core_only_where_its_ranks_may_be_megatron_ddps():
    """The fork server's imports, in order: every backend's, then the registry's rank_preload of the backend it was
    started for (all of them when that is not known: the warm CLI's, a test's ``rank_context()``)."""
    from backends.runtime.forkserver import preloads

    everyones, megatrons = "backends.runtime.preload", "backends.runtime.preload_megatron"
    assert preloads("fsdp2") == [everyones]
    assert preloads("megatron_ddp") == preloads(None) == [everyones, megatrons]
