"""What each rank of a distributed backend is sent, checked in-process (the real gloo ranks: tests/integration/test_distributed.py)."""

from __future__ import annotations

from harness.workload import make_examples, mixed_lengths


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
