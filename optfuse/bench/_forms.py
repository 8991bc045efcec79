"""Scanned decoders written the ways large JAX codebases write them.

Loop fusion must reach a stacked param however the model brings it to its ``scan``. Each form
is the benchmark's decoder (``_models.decoder``: pre-norm blocks, tied embedding) with its layer
stack written as one codebase writes it:

* ``linen_axis1``: MaxText's Linen decoder: ``nn.scan(variable_axes={"params": 1})`` (the layer
  axis second, ``param_scan_axis: 1``), ``nn.remat`` on the layer, bfloat16 compute with float32
  params (``dtype=bfloat16, param_dtype=float32``);
* ``bf16_policy``: a mixed-precision policy casts the whole params tree to bfloat16 before the
  model runs (``jmp``'s ``cast_to_compute``, as Levanter does);
* ``moveaxis``: stacked params stored with the layer axis second and moved to the front with
  ``jnp.moveaxis`` before ``lax.scan`` (MaxText's NNX decoder);
* ``outer_remat``: ``jax.checkpoint`` around the whole scanned stack (model-level remat), the
  body itself not rematerialised.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from optfuse.bench._models import (
  DecoderConfig,
  Leaf,
  Model,
  _block,
  _block_params,
  _count,
  _num_params,
  _rms_norm,
  grad_bytes,
)


def _head(params, h, targets):
  logits = (_rms_norm(h, params["norm"]) @ params["embed"].T).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _outer(c: DecoderConfig, layers) -> dict:
  return {"embed": Leaf((c.vocab, c.dim), c.dtype, "normal", 0.02),
          "pos": Leaf((c.seq, c.dim), c.dtype, "normal", 0.02),
          "layers": layers, "norm": Leaf((c.dim,), c.dtype, "ones")}


def _embed(params, tokens):
  return params["embed"][tokens] + params["pos"][: tokens.shape[1]]


def _live(c: DecoderConfig):
  def live(params):
    outside = grad_bytes({k: v for k, v in params.items() if k != "layers"})
    return outside + grad_bytes(params["layers"]) // c.layers
  return live


def _model(name: str, c: DecoderConfig, params, loss, note: str) -> Model:
  tokens = Leaf((c.batch, c.seq), jnp.int32, "int", c.vocab)
  return Model(name, params, (tokens, tokens), loss, _live(c),
               f"{_count(_num_params(params))} params, {c.layers}L d{c.dim} ff{c.ff} "
               f"T{c.seq} B{c.batch}, {note}")


def bf16_policy(c: DecoderConfig) -> Model:
  """The whole params tree cast to bfloat16 before the model (float32 master params)."""
  def loss(params, tokens, targets):
    compute = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    h = _embed(compute, tokens)
    h, _ = jax.lax.scan(jax.checkpoint(lambda h, p: (_block(p, h, c.heads), None)), h,
                        compute["layers"])
    return _head(compute, h, targets)

  return _model("bf16_policy", c, _outer(c, _block_params(c, (c.layers,))), loss,
                "params cast to bf16 before the model, remat")


def _axis1(layers: dict) -> dict:
  """Stacked ``Leaf``s with the layer axis moved from first to second."""
  move = lambda x: Leaf((x.shape[1], x.shape[0], *x.shape[2:]), x.dtype, x.fill, x.scale)
  return jax.tree.map(move, layers, is_leaf=lambda x: isinstance(x, Leaf))


def moveaxis(c: DecoderConfig) -> Model:
  """Stacked params stored with the layer axis second, moved first before ``lax.scan``."""
  def loss(params, tokens, targets):
    layers = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), params["layers"])
    h, _ = jax.lax.scan(jax.checkpoint(lambda h, p: (_block(p, h, c.heads), None)),
                        _embed(params, tokens), layers)
    return _head(params, h, targets)

  return _model("moveaxis", c, _outer(c, _axis1(_block_params(c, (c.layers,)))), loss,
                "layer axis second + moveaxis, remat")


def outer_remat(c: DecoderConfig) -> Model:
  """``jax.checkpoint`` around the whole scanned stack; the body is not rematerialised."""
  @jax.checkpoint
  def stack(layers, h):
    h, _ = jax.lax.scan(lambda h, p: (_block(p, h, c.heads), None), h, layers)
    return h

  def loss(params, tokens, targets):
    return _head(params, stack(params["layers"], _embed(params, tokens)), targets)

  return _model("outer_remat", c, _outer(c, _block_params(c, (c.layers,))), loss,
                "jax.checkpoint around the scanned stack")


class _LinenLayer(nn.Module):
  """A pre-norm decoder layer as MaxText writes one: bf16 compute, float32 params."""

  dim: int
  heads: int
  ff: int

  @nn.compact
  def __call__(self, h, _):
    dense = lambda features, name: nn.Dense(features, use_bias=False, dtype=jnp.bfloat16,
                                            param_dtype=jnp.float32, name=name)
    b, t, d = h.shape
    x = nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32, name="norm1")(h)
    q, k, v = jnp.split(dense(3 * d, "qkv")(x), 3, axis=-1)
    q, k, v = (z.reshape(b, t, self.heads, d // self.heads) for z in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(d // self.heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(jnp.bfloat16)
    h = h + dense(d, "proj")(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d))
    x = nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32, name="norm2")(h)
    h = h + dense(d, "down")(jax.nn.gelu(dense(self.ff, "up")(x)))
    return h.astype(jnp.float32), None


class _LinenDecoder(nn.Module):
  c: DecoderConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.c
    embed = nn.Embed(c.vocab, c.dim, name="embed")
    h = embed(tokens) + self.param("pos", nn.initializers.normal(0.02), (c.seq, c.dim))
    layer = nn.remat(_LinenLayer, prevent_cse=False)
    h, _ = nn.scan(layer, variable_axes={"params": 1}, split_rngs={"params": True},
                   in_axes=(nn.broadcast,), length=c.layers)(c.dim, c.heads, c.ff,
                                                             name="layers")(h, None)
    h = nn.RMSNorm(name="norm")(h)
    return embed.attend(h).astype(jnp.float32)


def linen_axis1(c: DecoderConfig) -> Model:
  """MaxText's Linen form: ``nn.scan`` with the params' layer axis second, ``nn.remat``, bf16."""
  module = _LinenDecoder(c)
  tokens = jax.ShapeDtypeStruct((c.batch, c.seq), jnp.int32)
  shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), tokens)["params"]
  params = jax.tree.map(lambda s: Leaf(s.shape, s.dtype, "normal", 0.02), shapes)

  def loss(params, tokens, targets):
    logits = module.apply({"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return _model("linen_axis1", c, params, loss, "nn.scan params axis 1, nn.remat, bf16")


FORMS = {"linen_axis1": linen_axis1, "bf16_policy": bf16_policy, "moveaxis": moveaxis,
         "outer_remat": outer_remat}
