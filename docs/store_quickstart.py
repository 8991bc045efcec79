"""Stores the quick-start notebook's outputs for the docs: ``python docs/store_quickstart.py``.

``examples/quickstart.ipynb`` is kept without outputs (``tests/project/test_notebook.py`` executes
it); the docs render ``docs/quickstart.ipynb``, the same cells with their outputs, without running
anything (``nb_execution_mode = "off"``). Run this after editing the example: it executes the
example in a fresh kernel, from ``examples/`` as a reader would (about 3 minutes on two CPU
cores), and writes the result. ``tests/project/test_docs.py`` checks that the two notebooks' cells
agree.
"""

import os
import pathlib

import nbclient
import nbformat

REPO = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # keep the plugins' hardware probe quiet
  notebook = nbformat.read(REPO / "examples" / "quickstart.ipynb", as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                   resources={"metadata": {"path": str(REPO / "examples")}})
  client.execute()
  nbformat.write(notebook, REPO / "docs" / "quickstart.ipynb")


if __name__ == "__main__":
  main()
