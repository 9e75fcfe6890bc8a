"""TokenBudgetSampler behind torchdata's StatefulDataLoader with worker processes: a state taken mid-step resumes at
that micro-batch, although the workers had fetched ahead of the loop."""

from tests.stateful_loader import check_mid_step_resume


def test_stateful_dataloader_with_two_workers_resumes_mid_step_at_that_microbatch():
    check_mid_step_resume(workers=2)
