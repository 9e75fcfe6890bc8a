"""docs/library.md's Python blocks run as written (in order, one namespace), except those that say they are a sketch
(the DataLoader loop, whose runnable form is examples/dataloader.py, a shell block the docs test runs)."""

import re

from tests.conftest import REPO


def test_the_library_pages_python_blocks_run():
    text = (REPO / "docs" / "library.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if not b.startswith("# a sketch")]
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/library.md", "exec"), namespace)
    assert namespace["plan"].microbatches == [[[2]], [[4, 0, 3, 5, 1]]] and namespace["plan"].loss_tokens == 7608
    # resumed where the sampler's epoch loop ended: the next epoch, on 2 ranks and on 4 with twice the budget
    assert next(namespace["resumed"].steps()).epoch == 1 and next(namespace["elastic"].steps()).epoch == 1
    assert namespace["taken"] and namespace["optimizer"]
