"""The notebooks under ``notebooks/`` are valid and committed without outputs. (They run top to bottom in
``tests/system/test_notebooks.py``.)"""

from __future__ import annotations

import nbformat

from tests.helpers import NOTEBOOK_DIR

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_notebooks_are_committed_without_outputs() -> None:
    assert [p.name for p in NOTEBOOKS] == [
        "01_what_is_ddp.ipynb",
        "02_regression_ddp.ipynb",
        "03_mingpt.ipynb",
        "04_fsdp2.ipynb",
    ]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them before committing"
                assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
