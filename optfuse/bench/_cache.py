"""A disk cache of compile-only peaks, so the bench's fits do not recompile what cannot change.

A compile-only peak is deterministic: the same program, compiled by the same compiler version
for the same target, gets the same buffer assignment. The TPU compiler takes about 18 s (36
CPU-seconds) per step of a d=2048 decoder on a 2-core machine, so the main job's fit lines
would take minutes each run. Each entry's key hashes everything the figure depends on: the
source of the whole ``optfuse`` package (any change to the library or the bench models
invalidates every entry), the versions of jax, jaxlib, libtpu and the CUDA plugin, the target,
the mode and the model's configuration. ``OPTFUSE_CACHE`` names the file (default
``~/.cache/optfuse/compile_only.json``); ``python -m optfuse.bench --no-cache`` bypasses it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
from typing import Any

import optfuse

PACKAGES = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt")


def path() -> pathlib.Path:
  """The cache file."""
  default = pathlib.Path.home() / ".cache" / "optfuse" / "compile_only.json"
  return pathlib.Path(os.environ.get("OPTFUSE_CACHE", default))


@functools.lru_cache(maxsize=1)
def _code_version() -> str:
  digest = hashlib.sha256()
  root = pathlib.Path(optfuse.__file__).parent
  for source in sorted(root.rglob("*")):
    if source.suffix in (".py", ".txtpb"):
      digest.update(str(source.relative_to(root)).encode())
      digest.update(source.read_bytes())
  for name in PACKAGES:
    try:
      digest.update(f"{name}=={importlib.metadata.version(name)}".encode())
    except importlib.metadata.PackageNotFoundError:
      digest.update(f"{name} absent".encode())
  return digest.hexdigest()


def key(*parts: Any) -> str:
  """The key of a figure that depends on ``parts`` and on the code and compiler versions."""
  return hashlib.sha256(json.dumps([_code_version(), *map(str, parts)]).encode()).hexdigest()


def load() -> dict[str, Any]:
  """The cached entries (empty when there is no cache file or it cannot be read)."""
  try:
    return json.loads(path().read_text())
  except (OSError, ValueError):
    return {}


def store(entries: dict[str, Any]) -> None:
  """Adds ``entries`` to the cache file (best effort: a read-only home only loses the cache)."""
  merged = {**load(), **entries}
  try:
    path().parent.mkdir(parents=True, exist_ok=True)
    tmp = path().with_suffix(".tmp")
    tmp.write_text(json.dumps(merged))
    tmp.replace(path())
  except OSError:
    pass
