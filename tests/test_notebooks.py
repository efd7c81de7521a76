"""The notebooks run as real notebooks (a Jupyter kernel via nbclient), top to bottom, without
an error and with at least one figure each; and they are stored without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_shards.ipynb", "02_memory.ipynb",
                                           "03_train_step.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path: Path):
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    for index, cell in enumerate(book.cells):
        if cell.cell_type == "code":
            fix = "clear all outputs before committing (Jupyter: Edit > Clear Outputs of All Cells)"
            assert cell.outputs == [], f"{path.name} cell {index} has stored outputs: {fix}"
            assert cell.execution_count is None, f"{path.name} cell {index} has a count: {fix}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_draws(path: Path, monkeypatch: pytest.MonkeyPatch):
    # The kernel inherits this environment: no GUI backend outside `%matplotlib inline`, and
    # this checkout's fzero first on the path (as the editable install may point elsewhere).
    monkeypatch.setenv("MPLBACKEND", "Agg")
    root = str(NOTEBOOK_DIR.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get(
        "PYTHONPATH")])))
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(book, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    images = [
        output
        for cell in book.cells if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "display_data" and "image/png" in output.get("data", {})
    ]
    assert images, f"{path.name} produced no figure"
