"""Prints the margins of the low-bit and Muon equivalence checks: how close each passing fused
run is to failing, and how far beyond the check each injected error (tests/faults.py) lands.

Usage::

  python -m tests.low_bit_margins            # the cases the default suite runs
  python -m tests.low_bit_margins --all      # and the ones under -m slow
  python -m tests.low_bit_margins --all --groups flax muon_8bit_one_step  # some groups only

It runs the tests' own cases with the tests' own criteria, under the suite's XLA settings
(tests/conftest.py: the CPU, ``--xla_backend_optimization_level=0`` unless XLA_FLAGS sets a
level or ``OPTFUSE_TESTS_XLA_DEFAULT_OPT=1`` asks for XLA's default level, as CI's run does).
For the spread check (tests/models.py) a distance is in units of the width accepted (the check
passes a leaf below 1), the largest over the losses and the params leaves; "tol" where every
leaf is within LOW_BIT_TOL of the reference. "width" is the widest accepted width over the
leaves as a fraction of how far the reference moved that leaf, against the cap SPREAD_CAP. For
8-bit Muon, judged one step at a time (tests/criteria.py, ``assert_each_step_matches``), a
distance is in units of that check's tolerance (the largest over the steps, the losses, the
params leaves' updates and the state), "width" the widest width over the params leaves as a
fraction of the reference's step, against the cap STEP_WIDTH_CAP. For float32 Muon against the
hand-written optax loop a distance is in units of ``np.allclose``'s tolerance, ``max |got -
want| / (atol + rtol |want|)`` (the check passes below 1).
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if (os.environ.get("OPTFUSE_TESTS_XLA_DEFAULT_OPT") != "1"
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

import numpy as np  # noqa: E402

from tests import criteria, faults, models  # noqa: E402
from tests.adapters import test_low_bit_flax as flax  # noqa: E402
from tests.engines import test_muon as muon  # noqa: E402
from tests.low_bit import test_low_bit_fusion as fusion  # noqa: E402

FAULTS = ("lr_1pct_off", "count_frozen", "row_skipped")
# The groups of cases, in the order they print (``--groups``).
GROUPS = ("low_bit", "low_bit_microbatches", "flax", "muon_4bit", "muon_8bit_one_step",
          "muon_optax_loop")


def _spread_margin(judged: list[models.Judged]) -> str:
  beyond = [j for j in judged if not j.within_tol]
  if not beyond:
    return "tol"
  worst = max(beyond, key=lambda j: j.margin)
  return f"{worst.margin:.3g} ({worst.name})"


def _width(spread: models.Spread) -> str:
  """The widest width accepted, as a fraction of how far the reference moved that leaf."""
  fractions = [w * models.SPREAD_CAP / c if c else float("inf")
               for w, c in zip(spread.widths, spread.caps)]
  i = int(np.argmax(fractions))
  return f"{fractions[i]:.2g} ({spread.names[i]})"


def _low_bit_rows(cases: list[tuple[str, str]]) -> Iterator[list[str]]:
  for optimizer, model in cases:
    params, loss = fusion.MODELS[model]()
    for modes, clip in ((("backward",), False), (("forward", "two_pass"), True)):
      reference = fusion._with_clipping(fusion.low_bit_tx(optimizer), modes[-1])
      spread = models.reference_spread(
          fusion._optax_reference(reference, loss, params, fusion.STEPS), params)
      for mode in modes:
        got = fusion._run(fusion._fuse(reference, mode), loss, params, fusion.STEPS)
        row = [f"{optimizer} {model} {mode}", _width(spread),
               _spread_margin(models.judge(got, spread))]
        for name in FAULTS:
          if clip:
            row.append("")
            continue
          fault = fusion.injected_faults(model)[name]
          tx = fusion.low_bit_tx(optimizer, fault)
          bad = fusion._run(fusion._fuse(tx, mode), loss, params, fusion.STEPS)
          unread = name == "count_frozen" and optimizer in fusion.COUNT_UNREAD
          row.append(_spread_margin(models.judge(bad, spread)) + (" count unread" if unread
                                                                  else ""))
        yield row


def _low_bit_microbatch_rows() -> Iterator[list[str]]:
  """test_microbatches_with_low_bit_state_match_the_unfused_microbatched_step's cases, and the
  errors test_the_microbatched_check_rejects_each_error_injected_into_the_fused_step injects."""
  params, loss = fusion.MODELS["axis0"]()
  for mode in ("backward", "forward"):
    tx = fusion._with_clipping(fusion.low_bit_tx("adamw_8bit"), mode)
    spread = models.reference_spread(fusion._microbatched_reference(tx, loss, params), params)
    got = fusion._run(fusion._fuse(tx, mode), loss, params, fusion.STEPS, microbatches=2)
    row = [f"adamw_8bit axis0 {mode} 2 microbatches", _width(spread),
           _spread_margin(models.judge(got, spread))]
    for name in FAULTS:
      fault = fusion.injected_faults("axis0")[name]
      bad_tx = fusion._with_clipping(fusion.low_bit_tx("adamw_8bit", fault), mode)
      bad = fusion._run(fusion._fuse(bad_tx, mode), loss, params, fusion.STEPS, microbatches=2)
      row.append(_spread_margin(models.judge(bad, spread)))
    yield row


def _flax_rows(adapters: list[str]) -> Iterator[list[str]]:
  """test_the_flax_low_bit_check_rejects_each_error_injected_into_the_fused_step's cases."""
  for adapter in adapters:
    fused, spread_of, kernel = flax.ADAPTERS[adapter]
    spread = spread_of(8)
    row = [f"{adapter} adamw_8bit offload=state", _width(spread),
           _spread_margin(models.judge(fused(lambda tx: tx), spread))]
    for name in FAULTS:
      fault = faults.faults(lambda path, kernel=kernel: path == kernel)[name]
      row.append(_spread_margin(models.judge(fused(fault), spread)))
    yield row


def _muon_rows(cases: list[tuple[int, int]]) -> Iterator[list[str]]:
  for layer_axis, bits in cases:
    spread = models.reference_spread(
        muon.low_bit_reference(muon.low_bit_muon(layer_axis, bits), layer_axis),
        muon.decoder_params(layer_axis), muon.MUON_NUDGES)
    run = lambda tx, axis=layer_axis: models.run_fused(
        tx, "backward", muon.decoder_params(axis), muon._batches(), 20, muon._loss(axis))[:2]
    row = [f"low-bit Muon {bits}-bit axis{layer_axis} backward", _width(spread),
           _spread_margin(models.judge(run(muon.low_bit_muon(layer_axis, bits)), spread))]
    row += [_spread_margin(models.judge(
                run(muon.low_bit_muon(layer_axis, bits, muon.muon_faults(layer_axis)[name])),
                spread)) for name in FAULTS]
    yield row


def _one_step_distance(layer_axis: int, microbatches: int, fault) -> str:
  starts, want, widths = muon.one_step_reference(layer_axis, microbatches)
  got = muon.fused_steps(muon.low_bit_muon(layer_axis, fault=fault), layer_axis, microbatches)
  d, where = criteria.one_step_distance(got, want, starts, widths, bits=8)
  return f"{d:.3g} ({where})"


def _muon_one_step_rows(cases: list[tuple[int, int]]) -> Iterator[list[str]]:
  """8-bit Muon judged one step at a time (test_muon's ``one_step_reference``): ``cases`` are
  ``(layer_axis, microbatches)``."""
  for layer_axis, microbatches in cases:
    widths = muon.one_step_reference(layer_axis, microbatches)[2]
    i = int(np.argmax(widths.widths))
    row = [f"low-bit Muon 8-bit axis{layer_axis} backward"
           + (f" {microbatches} microbatches" if microbatches > 1 else "") + " one step at a time",
           f"{widths.widths[i]:.2g} of a step ({widths.names[i]}; cap "
           f"{criteria.STEP_WIDTH_CAP:g})", _one_step_distance(layer_axis, microbatches,
                                                               lambda tx: tx)]
    row += [_one_step_distance(layer_axis, microbatches, muon.muon_faults(layer_axis)[name])
            for name in FAULTS]
    yield row


def _allclose_margin(got, want) -> str:
  return f"{criteria.matches_optax_distance(got, want)[0]:.3g}"


def _muon_optax_rows(options: list[str]) -> Iterator[list[str]]:
  for name in options:
    want = muon.optax_reference(muon._muon(), muon.FUSED_OPTIONS[name].get("microbatches", 1))
    row = [f"Muon {name} vs optax loop", "",
           _allclose_margin(muon._fused_run(name, muon._muon()), want)]
    row += [_allclose_margin(muon._fused_run(name, muon.muon_faults()[fault](muon._muon())), want)
            for fault in FAULTS]
    yield row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--all", action="store_true", help="also the cases under -m slow")
  parser.add_argument("--groups", nargs="+", choices=GROUPS, default=GROUPS,
                      help="the groups of cases to print (default: every group)")
  args = parser.parse_args()
  every = args.all
  low_bit = [("adamw_8bit", "axis0"), ("adamw_4bit", "axis1")]
  low_bit += [("adamw_8bit", "axis1"), ("adamw_4bit", "axis0"), ("lion_8bit", "axis0"),
              ("sgd_momentum_4bit", "axis0")] if every else []
  one_step = [(0, 1)] + ([(1, 1), (0, 2)] if every else [])
  groups = {
      "low_bit": lambda: _low_bit_rows(low_bit),
      "low_bit_microbatches": _low_bit_microbatch_rows,
      "flax": lambda: _flax_rows(["linen", "nnx"] if every else ["linen"]),
      "muon_4bit": lambda: _muon_rows([(0, 4)]),
      "muon_8bit_one_step": lambda: _muon_one_step_rows(one_step),
      "muon_optax_loop": lambda: _muon_optax_rows(sorted(muon.FUSED_OPTIONS)),
  }
  rows = itertools.chain.from_iterable(groups[name]() for name in GROUPS if name in args.groups)
  header = ["case", f"width / movement (cap {models.SPREAD_CAP:g})", "fused run", *FAULTS]
  print("| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header))
  for row in rows:
    print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
  main()
