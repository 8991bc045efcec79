"""The optimizer table of docs/modes.md says only what the suite checks.

Its first row names the optimizers whose stacked leaves are updated row by row inside the
backward loop, "and their ``optfuse.low_bit`` forms". This test reads that row from the page and
checks, for every optimizer it names, plain and in 8-bit form, that ``describe`` places the
scanned model's stacked leaves in the loop: a name added to the page without a case here fails,
and so does an optimizer whose placement changes. That each one trains like optax is checked
elsewhere (``test_backward_equivalence.py``, 50 steps each, plain forms; the low-bit forms the
page names as trained against the unfused low-bit step, in ``test_low_bit_fusion.py`` and
``test_muon.py``): the page claims training for those only, which is checked here too.
"""

import re
from pathlib import Path

import pytest

import optfuse
from tests import models
from tests.engines import test_backward_equivalence
from tests.low_bit import test_low_bit_fusion

PAGE = Path(__file__).parents[2] / "docs" / "modes.md"

# Every optimizer of the table's elementwise row, as the row names it: the transformations
# test_backward_equivalence trains against optax (sgd with momentum, the row's "sgd" with state).
_TRAINED_AS = {"sgd": "sgd_momentum", "contrib.schedule_free_adamw": "schedule_free_adamw"}
ELEMENTWISE = {
    name: test_backward_equivalence.OPTIMIZERS[_TRAINED_AS.get(name, name)]
    for name in ("sgd", "adam", "adamw", "nadamw", "adamax", "amsgrad", "adabelief", "adagrad",
                 "adadelta", "rmsprop", "lion", "radam", "yogi", "adan",
                 "contrib.schedule_free_adamw")
}
STACKED = ("['layers']['b']", "['layers']['w']")


def _elementwise_row() -> list[str]:
  """The optimizers the table's first row names, before "their ``optfuse.low_bit`` forms"."""
  (row,) = [line for line in PAGE.read_text().splitlines()
            if line.startswith("| sgd,") and "elementwise" in line]
  names = row.split("|")[1].split(", their")[0]
  return [name.strip().strip("`") for name in names.split(",")]


def _low_bit_trained() -> list[str]:
  """The low-bit forms the table's first row says are trained, in the order it names them."""
  (row,) = [line for line in PAGE.read_text().splitlines()
            if line.startswith("| sgd,") and "elementwise" in line]
  found = re.search(r"low-bit forms trained against the unfused low-bit step: ([^(]+) \(", row)
  return [name.strip() for name in found.group(1).split(",")]


def test_the_page_names_as_trained_only_the_low_bit_forms_that_are():
  # test_low_bit_fusion's cases, as "adamw_8bit" and "sgd_momentum_4bit": the optimizer's
  # name is the case's without its bits (and sgd's momentum).
  trained = {re.sub(r"(_momentum)?_\d+bit$", "", case) for case in test_low_bit_fusion.INNER}
  assert sorted(_low_bit_trained()) == sorted(trained)
  assert set(_low_bit_trained()) < set(ELEMENTWISE)
  assert "the other low-bit forms: quantization tested, training not" in PAGE.read_text()


def test_the_page_names_exactly_the_optimizers_checked_here():
  assert _elementwise_row() == list(ELEMENTWISE)
  assert re.search(r"their `optfuse\.low_bit` forms", PAGE.read_text())


@pytest.mark.parametrize("bits", [None, 8])
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_each_elementwise_optimizer_updates_stacked_leaves_in_the_loop(name, bits):
  tx = ELEMENTWISE[name]()
  if bits:
    tx = optfuse.low_bit(tx, bits, min_size=0)
  params, (tokens, targets) = models.stacked_params(layers=8), models.tied_lm_batches()[0]
  placed = optfuse.describe(tx, models.scanned_loss, params, tokens, targets)
  assert {path: placed[path] for path in STACKED} == dict.fromkeys(STACKED, "loop"), placed.reasons
