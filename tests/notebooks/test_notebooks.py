"""Every notebook runs top to bottom (nbclient), and is stored without outputs."""

import os

import nbformat
import pytest

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "notebooks")
NAMES = sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))


def test_all_seven_notebooks_exist():
    assert [n[:3] for n in NAMES] == ["01_", "02_", "03_", "04_", "05_", "06_", "07_"]


@pytest.mark.parametrize("name", NAMES)
def test_outputs_are_stripped(name):
    book = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{name}: clear the outputs before committing (Kernel > Restart & Clear Output)"
            )


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name):
    from nbclient import NotebookClient

    book = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    client = NotebookClient(
        book,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": NOTEBOOKS}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in book.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
