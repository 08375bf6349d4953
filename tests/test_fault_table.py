"""docs/reliability.md's fault table: each row is a test, so every test it names must exist."""

from __future__ import annotations

import importlib

from conftest import REPO
from test_bad_inputs import TEST_REFERENCE, table_rows


def test_every_test_named_in_the_fault_table_exists() -> None:
    rows = [row for row in table_rows((REPO / "docs" / "reliability.md").read_text(encoding="utf-8")) if "Fault" in row]
    assert len(rows) >= 4
    for row in rows:
        references = list(TEST_REFERENCE.finditer(row["Test"]))
        assert references, f"the row names no test: {row}"
        file = None
        for match in references:
            file = match.group(1) or file
            assert file, f"{match.group(0)} names no file: {row}"
            test = getattr(importlib.import_module(file.removesuffix(".py")), match.group(2), None)
            assert callable(test), f"{file}::{match.group(2)} does not exist"
