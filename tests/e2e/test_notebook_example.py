"""examples/notebook.ipynb, executed cell by cell by nbclient on a real ipykernel: the runtime is opened
in one cell, queried and aborted in later ones, and closed in the last."""

from __future__ import annotations

from typing import Any

import nbclient
import nbformat

from tests import helpers

NOTEBOOK = helpers.REPO / "examples" / "notebook.ipynb"


def test_the_notebook_opens_a_runtime_queries_aborts_and_closes_it_across_cells() -> None:
    read: Any = nbformat.read  # typed or not depending on what else is installed (Ray's dependencies)
    notebook = read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=60, kernel_name="python3").execute()
    outputs = [
        "".join(output.get("text", "") for output in cell.get("outputs", []))
        for cell in notebook.cells
        if cell.cell_type == "code"
    ]
    assert outputs == [
        "runtime open: guest\n",
        "2 + 3 = 5\ncompleted 2 turns\n",
        "the tool is running\n",
        "aborted_tools 0 tasks left\n",
        "closed: True 0 sessions open\n",
    ]
