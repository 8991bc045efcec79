"""The command line of the benchmark: ``python -m optfuse.bench [--quick|--memory|--fsdp|
--what-fits|--host-fits|--offload-cost|--offload-time|--slices|--fit [BUDGET]] [--target NAMES]
[--out DIR]``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from optfuse._analysis._fit import parse_budget
from optfuse._analysis._slices import DEFAULT_TARGETS, kind_slices
from optfuse._base._errors import BudgetError, TargetError
from optfuse._targets import _registry
from optfuse.bench import (
  _fit_table,
  _fsdp,
  _host_fits,
  _offload_cost,
  _offload_time,
  _report,
  _slices,
  _suite,
  _what_fits,
)


def _budget(text: str) -> int | str:
  if text == "target":
    return text
  try:
    return parse_budget(text)
  except BudgetError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _fit_models(text: str) -> tuple[str, ...]:
  names = tuple(n.strip() for n in text.split(",") if n.strip())
  unknown = [n for n in names if n not in _fit_table.fit_models()]
  if unknown or not names:
    raise argparse.ArgumentTypeError(
        f"unknown model(s) {', '.join(unknown) or text!r}; choose from "
        f"{', '.join(_fit_table.fit_models())}")
  return names


def _offloads(text: str) -> tuple[str, ...]:
  names = tuple(n.strip() for n in text.split(",") if n.strip())
  unknown = [n for n in names if n not in _what_fits.OFFLOAD_MODES]
  if unknown or not names:
    raise argparse.ArgumentTypeError(
        f"unknown offload choice(s) {', '.join(unknown) or text!r}; choose from "
        f"{', '.join(_what_fits.OFFLOAD_MODES)}")
  return names


def _target_names(text: str) -> tuple[str, ...]:
  names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
  for name in names:
    try:
      _what_fits.resolve(name)
    except TargetError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
  if not names:
    raise argparse.ArgumentTypeError("name at least one target")
  return names


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m optfuse.bench",
      description="Step time, compile time and compiled peak memory of optfuse's fused training "
      "steps against the plain optax step, on the default JAX backend.")
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_const", dest="suite", const="quick",
                    help="small models, timed, led by the step of the 1.3B decoder that fits TPU "
                    "v5e where libtpu is installed (the README's main job)")
  size.add_argument("--memory", action="store_const", dest="suite", const="memory",
                    help="only the compile-only memory of the 1.3B and 6.6B scanned decoders")
  size.add_argument("--loops", action="store_const", dest="suite", const="loops",
                    help="the 8-layer d=256 scanned decoder (remat and not) with AdamW, timed")
  size.add_argument("--gpt", action="store_const", dest="suite", const="gpt",
                    help="only the 184M-parameter scanned GPT yardstick (remat, AdamW), timed")
  size.add_argument("--smoke", action="store_const", dest="suite", const="smoke",
                    help="the smallest models, a few seconds (for tests)")
  size.add_argument("--fsdp", action="store_const", dest="suite", const="fsdp",
                    help="only the compile-only memory per device of a scanned decoder under "
                    "FSDP on 8 simulated CPU devices (in a subprocess); see --fsdp-size")
  size.add_argument("--fit", metavar="BUDGET", type=_budget, nargs="?", const="target",
                    help="the largest batch per mode whose compiled step (AdamW) fits BUDGET "
                    "(24GB, 80GiB, 1.5 GB...; by default each --target's memory), compile-only, "
                    "for the --fit-models")
  size.add_argument("--what-fits", action="store_const", dest="suite", const="what_fits",
                    help="per --target: the largest d=2048 scanned decoder (layers at batch 1, "
                    "batch at 24 layers) that fits with optax and with backward fusion")
  size.add_argument("--host-fits", action="store_const", dest="suite", const="host_fits",
                    help="per accelerator --target and the machines it comes in (their host "
                    "memory, with its source): the deepest d=2048 and d=4096 decoders at batch "
                    "1 and the largest batch at 24 layers with each --offload choice (default "
                    "params), the host bytes each needs and whether each machine holds them; "
                    "then the 6.6B decoder on TPU v5e and L4 (with --state-bits, also in low "
                    "bits); compile-only")
  size.add_argument("--offload-cost", action="store_const", dest="suite", const="offload_cost",
                    help="a model, not a timing: the bytes each offload choice moves a step "
                    "(from the plan) for the 1.3B and 6.6B decoders, the time they take at each "
                    "chip's host link beside the step's matmuls at its peak FLOP/s, and the "
                    "batch from which the transfer hides; the figures' sources")
  size.add_argument("--offload-time", action="store_const", dest="suite", const="offload_time",
                    help="on this machine: backward fusion's step time with no offload, the "
                    "state and the params in host memory, for the 8-layer d=256 scanned decoder, "
                    "interleaved rounds (--rounds), median and range")
  size.add_argument("--slices", action="store_const", dest="suite", const="slices",
                    help="per kind of chip among the --target slices (default: TPU v5e and v6e "
                    "of 1, 4 and 8 chips, and the registry's GPUs): the fewest chips on which "
                    "each step (optax, backward, backward + offload) of --model fits, data "
                    "parallel and FSDP, and the largest batch per chip there; compile-only")
  parser.add_argument("--target", metavar="NAMES", type=_target_names,
                      help="comma-separated compile targets for the compile-only parts: cpu "
                      f"(this machine), {', '.join(_registry.SPECS)}, optionally with a topology "
                      "(tpu-v5e:2x2). Default: cpu, and tpu-v5e where libtpu is installed "
                      "(--quick, --what-fits); cpu otherwise")
  _add_run_options(parser)
  return parser


def _add_run_options(parser: argparse.ArgumentParser) -> None:
  """The options that tune a section: its cache, model, state bits, offload choices, rounds and
  output."""
  parser.add_argument("--no-cache", action="store_true",
                      help="recompile the what-fits searches instead of reading the disk cache "
                      "of compile-only peaks (optfuse/bench/_cache.py)")
  parser.add_argument("--fsdp-size", choices=sorted(_fsdp.SIZES), default="16l",
                      help="the decoder of --fsdp: tiny (4x64, seconds), 16l (16x1024 T512 B8, "
                      "the default), 1.3b (24x2048 T2048 B8)")
  parser.add_argument("--fit-models", metavar="NAMES", type=_fit_models,
                      help="comma-separated models for --fit (default "
                      f"{','.join(_fit_table.DEFAULT_MODELS)}): "
                      f"{', '.join(_fit_table.fit_models())}")
  parser.add_argument("--model", choices=sorted(_fit_table.fit_models()),
                      default=_slices.DEFAULT_MODEL,
                      help=f"the decoder of --slices (default {_slices.DEFAULT_MODEL})")
  parser.add_argument("--state-bits", type=int, choices=(8, 4),
                      help="--slices with AdamW's state in 8 or 4 bits (optfuse.low_bit); "
                      "--what-fits with those rows added")
  parser.add_argument("--optimizer", choices=_what_fits.OPTIMIZERS, default="adamw",
                      help="--what-fits with this optimizer: adamw (the default), or adafactor "
                      "(optax's defaults; the fused step in two passes)")
  parser.add_argument("--offload", metavar="CHOICES", type=_offloads, default=("params",),
                      help="comma-separated offload choices of --host-fits (default params): "
                      f"{', '.join(_what_fits.OFFLOAD_MODES)}")
  parser.add_argument("--rounds", type=int, default=7, metavar="N",
                      help="--offload-time's interleaved rounds (default 7)")
  parser.add_argument("--max-batch-per-chip", type=int, metavar="N",
                      help="--slices searches batches up to N per chip (a step that fits N "
                      "answers N, marked as the cap): fewer compiles for a model far smaller "
                      "than the chips")
  parser.add_argument("--out", metavar="DIR",
                      help="write results.json, results.md and results.png into DIR (with "
                      "--fsdp: fsdp.json and fsdp.md; with --fit: fit.json and fit.md)")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _quick_slices(use_cache: bool, progress: bool) -> list[dict]:
  """The slice planner's rows for this machine's TPU or GPU; none on a machine without one."""
  kind = _registry.accelerator_kind()
  if kind is None:
    return []
  return _slices.run(_slices.DEFAULT_MODEL, kind_slices(kind),
                     layouts=_slices.QUICK_LAYOUTS, use_cache=use_cache, progress=progress)


def _run(args: argparse.Namespace) -> tuple[list[dict], Callable, Callable, str]:
  """The rows of the section ``args`` ask for, with their writer, their table and a footer."""
  start, progress = time.perf_counter(), not args.no_progress
  if args.suite == "fsdp":
    rows = _fsdp.run(args.fsdp_size, progress=progress)
    write, markdown, footer = _fsdp.write, _fsdp.markdown, ""
  elif args.fit is not None:
    names = args.fit_models or _fit_table.DEFAULT_MODELS
    budget = None if args.fit == "target" else args.fit
    rows = [row for target in args.target or ("cpu",)
            for row in _fit_table.run_fit(names, budget, progress=progress,
                                    target=_what_fits.resolve(target))]
    write, markdown = _report.write_fit, _report.fit_markdown
    footer = f"(--fit {', '.join(names)}: {time.perf_counter() - start:.0f} s)"
  elif args.suite == "slices":
    rows = _slices.run(args.model, args.target or DEFAULT_TARGETS, args.state_bits,
                       use_cache=not args.no_cache, progress=progress,
                       max_batch_per_chip=args.max_batch_per_chip)
    write, markdown, footer = _report.write_slices, _slices.markdown, ""
  elif args.suite == "host_fits":
    targets = args.target or tuple(n for n in _what_fits.default_targets() if n != "cpu")
    rows = _host_fits.run_host(targets, args.offload, use_cache=not args.no_cache,
                               progress=progress, state_bits=args.state_bits)
    write, markdown = _report.write_host_fits, _report.host_fits_markdown
    footer = f"(--host-fits: {time.perf_counter() - start:.0f} s)"
  elif args.suite == "offload_cost":
    rows = _offload_cost.run()
    write, markdown, footer = _report.write_offload_cost, _report.offload_cost_markdown, ""
  elif args.suite == "offload_time":
    rows = _offload_time.run(rounds=args.rounds)
    write, markdown = _report.write_offload_time, _report.offload_time_markdown
    footer = f"(--offload-time: {time.perf_counter() - start:.0f} s)"
  elif args.suite == "what_fits":
    rows = _what_fits.run(args.target or _what_fits.default_targets(), ("layers", "batch"),
                          use_cache=not args.no_cache, progress=progress,
                          state_bits=args.state_bits, optimizer=args.optimizer)
    write, markdown = _report.write_what_fits, _report.what_fits_markdown
    footer = f"(--what-fits: {time.perf_counter() - start:.0f} s)"
  else:
    suite = _suite.SUITES[args.suite or "full"]()
    targets = args.target or ("cpu",)
    fits = []
    if suite.name == "quick":
      # One compile per accelerator target and step (optax's, and the 8-bit state's that fits
      # TPU v5e); the depth and batch searches (three or four compiles a step, a CPU-minute or
      # more each for TPU on two cores) are --what-fits'.
      fits = _what_fits.at_size(args.target or _what_fits.default_targets(),
                                use_cache=not args.no_cache, progress=progress)
      fits += _quick_slices(not args.no_cache, progress)
    rows = _suite.run_suite(suite, progress=progress,
                            targets=tuple(_what_fits.resolve(t) for t in targets))
    rows += [{**row, **{k: rows[0][k] for k in _suite.ENV_KEYS}} for row in fits]
    write, markdown = _report.write, _report.markdown
    footer = f"({suite.name} suite: {time.perf_counter() - start:.0f} s)"
    if suite.name == "quick" and _registry.accelerator_kind() is None:
      footer = f"{_slices.POINTER}\n{footer}"
  return rows, write, markdown, footer


def main(argv: Sequence[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.fit_models and args.fit is None:
    parser.error("--fit-models needs --fit BUDGET")
  if args.fit == "target" and not args.target:
    parser.error("--fit without a BUDGET needs --target: the budget is each target's memory")
  if args.suite == "host_fits" and not any(
      _what_fits.resolve(t) is not None for t in args.target or _what_fits.default_targets()):
    parser.error("--host-fits needs an accelerator --target (tpu-v5e, l4, h100...): XLA:CPU "
                 "counts host memory as device memory")
  rows, write, markdown, footer = _run(args)
  if args.out:
    paths = write(rows, args.out)
    print(f"wrote {', '.join(paths.values())}", file=sys.stderr)
  print(markdown(rows))
  if footer:
    print(footer)
  failed = [r for r in rows if r.get("failed")]
  if failed:
    print(f"{len(failed)} measurements failed (see the notes above)", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
