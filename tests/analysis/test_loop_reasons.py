"""``optfuse.describe`` says why a stacked leaf is not updated inside its loop, and the loss is
traced once per compiled step."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from tests.fusion.test_loops import _batch, _init, _layer, scan_loss, two_scans_loss


def _scan(p, x, layers=None):
  layers = p["layers"] if layers is None else layers
  h, _ = jax.lax.scan(lambda h, lp: (_layer(h, lp, p["shared"]), None), x, layers)
  return h


def _head(p, h, y):
  return jnp.mean((h @ p["head"] - y) ** 2)


def while_loss(p, x, y):
  # JAX differentiates no while_loop in reverse mode: a step (which describe traces) runs only
  # with the loop held out of the gradient, as a frozen teacher's would be.
  h = jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, _scan(p, c[1])), (0, x))[1]
  return _head(p, jax.lax.stop_gradient(h), y)


def cond_loss(p, x, y):
  return _head(p, jax.lax.cond(jnp.sum(x) > -1e9, lambda: _scan(p, x), lambda: x), y)


@jax.custom_vjp
def _custom_stack(layers, shared, x):
  return _scan({"layers": layers, "shared": shared}, x)


def _custom_fwd(layers, shared, x):
  out, pullback = jax.vjp(lambda *a: _scan({"layers": a[0], "shared": a[1]}, a[2]), layers,
                          shared, x)
  return out, pullback


_custom_stack.defvjp(_custom_fwd, lambda pullback, ct: pullback(ct))


def custom_vjp_loss(p, x, y):
  return _head(p, _custom_stack(p["layers"], p["shared"], x), y)


def merged_rows_loss(p, x, y):
  """The layer axis merged with the next one and split again: a reshape that mixes rows."""
  w = p["layers"]["w"]
  merged = w.reshape(-1, w.shape[-1]).reshape(w.shape[1], w.shape[0], w.shape[2])
  return _head(p, _scan(p, x, {"w": merged, "b": p["layers"]["b"]}), y)


def scaled_loss(p, x, y):
  return _head(p, _scan(p, x, jax.tree.map(lambda w: 2.0 * w, p["layers"])), y)


def closed_over_loss(p, x, y):
  """The body indexes the whole stack it closes over instead of scanning it."""
  def body(h, i):
    return _layer(h, jax.tree.map(lambda w: w[i], p["layers"]), p["shared"]), None
  h, _ = jax.lax.scan(body, x, jnp.arange(p["layers"]["w"].shape[0]))
  return _head(p, h, y)


CASES = {
    "two_scans": (two_scans_loss, optax.adam(1e-2), 5, "read more than once"),
    "while_loop": (while_loss, optax.adam(1e-2), 5, "inside a while_loop"),
    "cond": (cond_loss, optax.adam(1e-2), 5, "inside a cond"),
    "custom_vjp": (custom_vjp_loss, optax.adam(1e-2), 5, "inside a custom_vjp function"),
    "merged_rows": (merged_rows_loss, optax.adam(1e-2), 8, "no axis of the stored leaf"),
    "elementwise_before_scan": (scaled_loss, optax.adam(1e-2), 5, "after mul"),
    "closed_over": (closed_over_loss, optax.adam(1e-2), 5, "read whole by a loop body"),
    "short_loop": (scan_loss, optax.adamw(1e-2), 3, "its loop has 3 iterations"),
    "update_mixes_rows": (scan_loss, optax.lamb(1e-2), 5, "its update mixes rows"),
}


@pytest.mark.jax_upgrades
@pytest.mark.parametrize("case", sorted(CASES))
def test_describe_says_why_a_stacked_leaf_is_not_fused(case):
  loss, tx, layers, why = CASES[case]
  params = _init(jax.random.PRNGKey(0), layers=layers)
  if case == "merged_rows":
    params["layers"]["w"] = params["layers"]["w"].reshape(8, 8, 8)
  where = optfuse.describe(tx, loss, params, *_batch())
  assert where["['layers']['w']"] == "tap"
  assert why in where.reasons["['layers']['w']"], where.reasons
  assert "['head']" not in where.reasons  # not stacked: nothing to explain


def test_fused_stacked_leaves_have_no_reason_and_the_table_names_every_leaf():
  where = optfuse.describe(optax.adam(1e-2), scan_loss, _init(jax.random.PRNGKey(0)), *_batch())
  assert where.reasons == {}
  assert [line.split()[0] for line in where.table().splitlines()] == sorted(where)


def _counting(loss):
  calls = []

  @functools.wraps(loss)
  def counted(*args):
    calls.append(1)
    return loss(*args)

  return counted, calls


def _unrolled_loss(p, x, y):
  h = x
  for w, b in zip(p["layers"]["w"], p["layers"]["b"]):
    h = _layer(h, {"w": w, "b": b}, p["shared"])
  return _head(p, h, y)


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("model", ["scanned", "unrolled"])
@pytest.mark.parametrize("mode", ["off", "backward", "forward", "two_pass"])
def test_the_loss_is_called_once_per_compiled_step(mode, model, microbatches):
  loss, calls = _counting(scan_loss if model == "scanned" else _unrolled_loss)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  if mode == "backward":
    tx = optax.adam(1e-2)
  fx = optfuse.fuse(tx, mode="backward" if mode == "two_pass" else mode,
                    global_ops="two_pass" if mode == "two_pass" else None)
  params = _init(jax.random.PRNGKey(0), layers=6)
  step = fx.value_and_update(loss, microbatches=microbatches)
  jax.jit(step).lower(params, fx.init(params), *_batch())
  assert len(calls) == 1
