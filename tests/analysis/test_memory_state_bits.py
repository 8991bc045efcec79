"""``state_bits`` in the planners, and the bytes a step moves across the host link."""

import jax
import jax.numpy as jnp
import optax
import pytest

import optfuse
from optfuse._analysis._memory import with_state_bits
from optfuse._analysis._report import memory_report
from optfuse._targets import _registry

needs_tpu = pytest.mark.skipif(not _registry.compiler_installed("tpu"),
                               reason='the TPU compiler is not installed: pip install -e ".[tpu]"')

ROWS, N = 8, 1024  # one leaf of 8192 elements: above low_bit's 4096, 4 blocks of 256 a row


def _loss(p, x):
  return jnp.mean(jnp.tanh(x @ p["w"].T) ** 2)


PARAMS = {"w": jax.ShapeDtypeStruct((ROWS, N), jnp.float32)}
X = jax.ShapeDtypeStruct((4, N), jnp.float32)


def test_8_bit_state_moves_codes_of_one_byte_and_a_float_scale_a_block_between_host_and_device():
  report = memory_report(_loss, optax.adamw(1e-3), PARAMS, X, offload="state", state_bits=8)
  f32 = memory_report(_loss, optax.adamw(1e-3), PARAMS, X, offload="state")
  slot_8 = ROWS * N * 1 + ROWS * (N // 256) * 4  # codes, then one f32 scale a block
  slot_32 = ROWS * N * 4
  for mode in ("off", "backward", "forward"):
    pending = ROWS * N * 4 if mode == "forward" else 0  # forward streams the gradient too
    # Each of mu and nu read to the device once and written back once.
    assert report[mode]["host_transfer_bytes"] == 2 * (2 * slot_8 + pending)
    assert f32[mode]["host_transfer_bytes"] == 2 * (2 * slot_32 + pending)
  assert "host transfers" in report.table()


def test_state_bits_32_or_none_plans_tx_as_it_is_and_other_values_are_refused():
  tx = optax.adamw(1e-3)
  assert with_state_bits(tx, None) is tx and with_state_bits(tx, 32) is tx
  for bad in (16, 2, True, "8"):
    with pytest.raises(optfuse.LowBitError, match="state_bits"):
      with_state_bits(tx, bad)
  with pytest.raises(optfuse.LowBitError, match="state_bits"):
    optfuse.max_batch_size(_loss, tx, PARAMS, lambda b: (jax.ShapeDtypeStruct((b, N),
                                                                              jnp.float32),),
                           "1GB", state_bits=16)


@needs_tpu
@pytest.mark.targets
def test_on_tpu_the_streamed_codes_keep_their_stored_layout_so_host_memory_holds_one_copy():
  # The TPU compiler lays a packed row of codes out column-major; unpinned, it relayouts the
  # whole host stack through the device and back every step, and host memory holds it twice.
  params = {"layers": jax.ShapeDtypeStruct((4, 512, 4096), jnp.float32)}

  def loss(p, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w[:, :512]), None), x, p["layers"])
    return jnp.mean(h ** 2)

  x = jax.ShapeDtypeStruct((8, 512), jnp.float32)
  report = memory_report(loss, optax.adamw(1e-3), params, x, target="tpu-v5e", offload="state",
                         state_bits=8)
  codes = 2 * 4 * 512 * 4096  # mu and nu, a byte a value
  scales = 2 * 4 * 512 * 128 * 4  # a float a block of 256: 16 a row, tiled to 128 lanes on TPU
  assert report["backward"]["host_bytes"] <= 1.05 * (codes + scales)  # twice it unpinned
