"""The notebooks under ``notebooks/`` are valid, numbered by the README step they go with, and committed with their
outputs (``make notebooks`` runs and saves them): every code cell ran, in order, without an error, and those that
plot carry their figure. (They run top to bottom in ``tests/system/test_notebooks.py``.)"""

from __future__ import annotations

import re

import nbformat

from tests.helpers import NOTEBOOK_DIR, README

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_notebooks_are_numbered_by_the_readme_step() -> None:
    assert [p.name for p in NOTEBOOKS] == [
        "00_what_is_ddp.ipynb",
        "02_regression_ddp.ipynb",
        "03_kill_and_resume.ipynb",
        "05_mingpt.ipynb",
        "06_fsdp2.ipynb",
    ]
    steps = re.findall(r"^## (\d)\. ", README.read_text(), re.M)
    for path in NOTEBOOKS:
        number = int(path.name[:2])
        nb = nbformat.read(path, as_version=4)
        assert nb.cells[0].source.startswith(f"# {number}. "), f"{path.name}: its title carries its number"
        assert number == 0 or number > 5 or str(number) in steps, path.name
        assert path.stem in README.read_text(), f"the README lists {path.stem}"


def test_notebooks_are_committed_with_their_outputs() -> None:
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        counts = [cell.execution_count for cell in code]
        assert counts == list(range(1, len(code) + 1)), f"{path.name}: run top to bottom (make notebooks)"
        for i, cell in enumerate(code):
            kinds = [output.output_type for output in cell.outputs]
            assert "error" not in kinds, f"{path.name} code cell {i} ended in an error"
            if "plt.show()" in cell.source:
                assert any("image/png" in output.get("data", {}) for output in cell.outputs), f"{path.name} cell {i}"
        assert any(cell.outputs for cell in code), path.name
