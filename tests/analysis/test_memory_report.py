"""``memory_report``: compile-only memory of the optax and fused steps, before anything runs."""

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from optfuse._analysis._report import FIELDS, HOST_FIELDS, TRANSFER_FIELDS, memory_report

# 4 x (16384 x 16384) float32 weights: 4.3 GB of params, 12.9 GB with adamw's mu and nu, and the
# step's outputs again: far more than the test machines hold, so the report cannot allocate them.
WIDTH, DEPTH, BATCH = 16384, 4, 8


def _mlp_loss(params, x):
  for w in params["layers"]:
    x = jnp.tanh(x @ w)
  return jnp.mean(x**2)


def _big_mlp():
  params = {"layers": [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * DEPTH}
  return params, jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)


@pytest.fixture(scope="module")
def big_adamw_report():
  params, x = _big_mlp()
  return memory_report(_mlp_loss, optax.adamw(1e-3), params, x)


def test_memory_report_compiles_a_model_bigger_than_host_memory_from_shapes(big_adamw_report):
  param_bytes = DEPTH * WIDTH * WIDTH * 4
  assert {"off", "backward"} <= set(big_adamw_report)
  for mode, row in big_adamw_report.items():
    assert set(row) == set(FIELDS + HOST_FIELDS + TRANSFER_FIELDS), mode
    assert row["host_bytes"] == row["host_transfer_bytes"] == 0, mode  # nothing offloaded
    # The arguments are params, mu, nu (and count, the batch); donation aliases them all.
    assert row["argument_bytes"] >= 3 * param_bytes, mode
    assert row["alias_bytes"] >= 3 * param_bytes, mode


def test_peak_is_arguments_plus_temp_plus_outputs_minus_aliased(big_adamw_report):
  for row in big_adamw_report.values():
    assert row["peak_bytes"] == (row["argument_bytes"] + row["temp_bytes"] + row["output_bytes"]
                                 - row["alias_bytes"])
    assert row["peak_bytes"] >= row["argument_bytes"]


def test_backward_fusion_needs_no_more_memory_than_optax(big_adamw_report):
  off, backward = big_adamw_report["off"]["peak_bytes"], big_adamw_report["backward"]["peak_bytes"]
  # XLA already interleaves the update of an unrolled model with its backward pass, so the two
  # peaks are about equal; the slack (1 %) covers buffer-assignment differences of small buffers,
  # far below one 1 GB gradient leaf.
  assert backward <= off * 1.01


def test_printing_the_report_shows_a_table_with_one_line_per_mode(big_adamw_report):
  text = str(big_adamw_report)
  lines = text.splitlines()
  assert lines[0].split()[:3] == ["mode", "peak", "temp"]
  assert [line.split()[0] for line in lines[1:4]] == ["off", "backward", "forward"]
  assert "GB" in lines[1]
  # The last line says which compiler and which budget the "fits" column compares with.
  assert lines[4].startswith(f"compiled for {jax.default_backend()}, budget ")
  assert text in repr(big_adamw_report)


def test_a_mode_that_cannot_run_the_optimizer_is_reported_unavailable_with_the_reason():
  # Two leaves: clipping by their global norm makes each leaf's update read the other's gradient.
  params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32),
            "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
  x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  report = memory_report(lambda p, x: jnp.sum(x @ p["w"] + p["b"]), tx, params, x)
  assert "backward" not in report
  assert report.unavailable["backward"].startswith("NonSeparableError: ")
  assert "clip_by_global_norm" in report.unavailable["backward"]
  assert "off" in report
  backward_line = next(line for line in str(report).splitlines() if line.startswith("backward"))
  assert "unavailable: NonSeparableError" in backward_line


def test_two_pass_gives_a_clipped_optimizer_a_backward_row_and_is_refused_with_offload():
  params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32),
            "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
  x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  loss = lambda p, x: jnp.sum(x @ p["w"] + p["b"])
  report = memory_report(loss, tx, params, x, global_ops="two_pass")
  assert {"off", "backward", "forward"} <= set(report) and not report.unavailable
  # The options are fuse's (backward mode's: global_ops is backward mode's option), refused as
  # fuse refuses them; the other modes run without global_ops.
  with pytest.raises(optfuse.OffloadError, match='use mode="forward"'):
    memory_report(loss, tx, params, x, global_ops="two_pass", offload="state")
  offloaded = memory_report(loss, tx, params, x,
                            options=optfuse.FuseOptions("forward", offload="state"))
  assert {"off", "forward"} <= set(offloaded)
  with pytest.raises(optfuse.UnknownModeError, match="unknown global_ops 'three_pass'"):
    memory_report(loss, tx, params, x, global_ops="three_pass")


def test_memory_report_passes_keyword_arguments_and_detects_aux_outputs():
  params = {"w": jnp.ones((8, 4))}

  def loss(params, x, *, scale):
    y = x @ params["w"]
    return scale * jnp.mean(y**2), {"y": y}

  report = memory_report(loss, optax.sgd(0.1), params, jnp.ones((2, 8)), scale=2.0)
  assert {"off", "backward"} <= set(report)
  assert report["off"]["argument_bytes"] >= 8 * 4 * 4
