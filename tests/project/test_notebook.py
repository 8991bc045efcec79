"""``examples/quickstart.ipynb`` runs top to bottom and trains optax and optfuse alike.

The notebook is executed in a fresh Jupyter kernel (``nbclient``) with
``OPTFUSE_NOTEBOOK_QUICK=1``: fewer steps and smaller shapes, about 20 s on two CPU cores.
"""

import os
import pathlib
import re

import nbclient
import nbformat
import pytest

from tests import criteria

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "examples" / "quickstart.ipynb"


def _printed(cells) -> str:
  return "".join(out.get("text", "") for cell in cells if cell.cell_type == "code"
                 for out in cell.outputs if out.output_type == "stream" and out.name == "stdout")


@pytest.fixture(scope="module")
def executed():
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("OPTFUSE_NOTEBOOK_QUICK", "1")
    # The kernel imports optfuse from this checkout, whatever else is installed.
    patch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError if a cell fails
  return notebook


def test_the_committed_notebook_has_no_outputs():
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(notebook)
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_the_notebook_runs_and_prints_its_backend(executed):
  printed = _printed(executed.cells)
  assert f"from {REPO / 'optfuse'}" in printed
  assert re.search(r"backend: (cpu|gpu|tpu)", printed)


def test_optax_and_backward_fusion_train_to_the_same_losses(executed):
  printed = _printed(executed.cells)
  diff = float(re.search(r"max abs loss difference: (\S+)", printed).group(1))
  assert diff < criteria.EXAMPLE_DIFF
  assert any("image/png" in out.get("data", {}) for cell in executed.cells
             if cell.cell_type == "code" for out in cell.outputs)


def test_the_notebook_reports_memory_and_the_largest_batch_per_mode(executed):
  printed = _printed(executed.cells)
  assert re.search(r"^off +\S+ [kMG]?B", printed, re.MULTILINE)  # the memory_report table
  fit = dict(re.findall(r"^ *(off|backward|forward): batch +(\d+)", printed, re.MULTILINE))
  assert set(fit) == {"off", "backward", "forward"}
  # The budget is optax's peak at the batch measured above; backward fusion goes further.
  assert int(fit["backward"]) > int(fit["off"]) > 0


def test_on_a_cpu_runtime_the_notebook_shows_the_fit_for_colabs_tpu_v5e(executed):
  from optfuse._targets import _registry
  printed = _printed(executed.cells)
  if _registry.compiler_installed("tpu"):
    # The TPU compiler's memory is the budget: 15.75 GiB.
    assert "16.91 GB (16911433728 bytes) of compiled peak memory per device on tpu-v5e" in printed
    assert re.search(r"backward: batch +\d+ = +\d+ positions per step on tpu-v5e", printed)
  else:
    assert 'cannot compile for TPU v5e here' in printed and '".[tpu]"' in printed
