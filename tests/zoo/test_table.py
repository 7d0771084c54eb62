"""The README's zoo table is what ``python -m tests.zoo.table --render`` makes of the committed results."""

from __future__ import annotations

from tests.zoo.table import README, RESULTS, load, readme_block, render


def test_readme_zoo_table_is_generated_from_the_committed_results():
    assert RESULTS.exists(), f"{RESULTS} missing: run `python -m tests.zoo.table`"
    rows = load()
    assert rows, "no zoo results"
    block = readme_block(README.read_text())
    assert block is not None, "README has no <!-- zoo-table:start --> ... <!-- zoo-table:end --> block"
    assert block == render(rows), "README zoo table is stale: run `python -m tests.zoo.table --render`"
