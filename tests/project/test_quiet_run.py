"""A first run prints only optfuse's output: no libtpu or CUDA plugin errors on a machine without
their hardware.

With the tpu and cuda extras installed and no TPU or GPU, libtpu would print ``E0000 ...
unexpected worker hostname`` and a source trace, and the CUDA plugin a traceback of its failed
version check, on every run; ``optfuse._targets`` now sets what they need before they start. The
checks run in a subprocess with the environment a user has (no ``JAX_PLATFORMS``, no
``ALLOW_MULTIPLE_LIBTPU_LOAD``: ``conftest.py`` sets both for the suite), since what is printed
happens once per process, when JAX starts its backends and when libtpu loads.
"""

import os
import pathlib
import subprocess
import sys

import pytest

import optfuse
from optfuse._targets import _registry

ROOT = pathlib.Path(optfuse.__file__).resolve().parent.parent
# What the suite's conftest sets and what optfuse sets in a process: a user's shell has none.
UNSET = ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK",
         "TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS", "TPU_SKIP_MDS_QUERY")
INSTALLED = [name for name, platform in (("tpu-v5e", "tpu"), ("h100", "cuda"))
             if _registry.compiler_installed(platform)]

no_accelerator = pytest.mark.skipif(_registry._accelerator_present(),
                                    reason="checks a machine without a TPU or GPU")


def _run(args, tmp_path) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in UNSET}
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
  env["OPTFUSE_CACHE"] = str(tmp_path / "cache.json")  # a first run: nothing cached
  return subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True,
                        text=True, timeout=600)


def _assert_quiet(done: subprocess.CompletedProcess) -> None:
  assert done.returncode == 0, done.stderr
  # libtpu's and absl's log lines (E0000, W0000, I0000 ...), the plugin's traceback and its
  # "Unable to load CUDA" all go to stderr, where optfuse writes nothing on a successful run.
  assert done.stderr == "", f"stderr is not empty:\n{done.stderr}"


@no_accelerator
def test_import_backends_and_the_target_listing_print_nothing_on_stderr(tmp_path):
  code = ("import optfuse, jax; from optfuse._targets import _registry; print(jax.devices()); "
          "print(sorted(optfuse.targets()))"
          + "".join(f"; _registry.resolve({n!r})" for n in INSTALLED))
  done = _run(["-c", code], tmp_path)
  _assert_quiet(done)
  assert "CpuDevice" in done.stdout and "tpu-v5e" in done.stdout


@no_accelerator
@pytest.mark.targets
@pytest.mark.skipif(not INSTALLED, reason='neither compiler is installed: pip install -e '
                    '".[tpu,cuda]"')
def test_the_bench_entry_point_compiling_for_the_targets_prints_nothing_on_stderr(tmp_path):
  # The main job's entry point on its smallest suite, with the compile-only section on each
  # installed compiler: the same start of JAX, libtpu and the plugin as --quick, in seconds.
  done = _run(["-m", "optfuse.bench", "--smoke", "--no-progress", "--target",
               ",".join(INSTALLED)], tmp_path)
  _assert_quiet(done)
  assert all(f"| {name} |" in done.stdout for name in INSTALLED), done.stdout


def test_defaults_are_set_only_without_an_accelerator_and_never_over_a_users(monkeypatch):
  for name in UNSET:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.2,10.0.0.3")
  monkeypatch.setattr(_registry, "_accelerator_present", lambda: False)
  _registry._quiet_compilers()
  assert os.environ["TPU_WORKER_HOSTNAMES"] == "10.0.0.2,10.0.0.3"
  assert os.environ["TPU_HOST_BOUNDS"] == "1,1,1"
  assert os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1"
  for name in UNSET:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(_registry, "_accelerator_present", lambda: True)
  _registry._quiet_compilers()
  assert not any(name in os.environ for name in UNSET)
