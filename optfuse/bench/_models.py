"""The benchmark models, in plain JAX: dict params, a loss function, and how to fill them.

* ``mlp``: an unrolled stack of dense layers (classification).
* ``scan_mlp_remat``: residual dense blocks with stacked params under ``jax.lax.scan`` and
  ``jax.checkpoint``: the scanned case at a fraction of a transformer's compile time.
* ``cnn``: strided convolutions, global average pooling and a dense head.
* ``transformer``: a GPT-style decoder whose blocks are a Python list (unrolled under jit).
* ``scan_transformer``: the same decoder with the blocks' params stacked on a leading layer axis
  and run by ``jax.lax.scan``; with ``remat`` the scan body is wrapped in ``jax.checkpoint``, as
  large JAX models are written.
* ``grad_accum``: the MLP trained on several microbatches per step with gradient accumulation
  (``fx.value_and_update(loss, microbatches=k)``; in mode "off" the optax accumulation loop).

Decoders tie the embedding table to the output projection (GPT-2 style), so the yardstick's
configuration (12 layers, d=1024, ff=4096, vocab 32000) has 184M parameters.

Params and batches are declared as trees of ``Leaf`` (shape, dtype, how to fill it): ``abstract``
turns them into ``jax.ShapeDtypeStruct``s for compile-only measurements of models that do not
fit anywhere, ``materialize`` fills them from a NumPy generator (no JAX random program to
compile, which costs seconds per model on CPU).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optfuse._base._leaves import nbytes as nbytes


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One array of a params or batch tree, before it exists.

  Attributes:
    shape: the array's shape.
    dtype: its dtype.
    fill: "normal" (scaled by ``scale``), "ones", "zeros" or "int" (uniform in ``[0, scale)``).
    scale: standard deviation for "normal", the bound for "int".
  """

  shape: tuple[int, ...]
  dtype: Any = jnp.float32
  fill: str = "normal"
  scale: float = 1.0


def _is_leaf(x) -> bool:
  return isinstance(x, Leaf)


def abstract(tree) -> Any:
  """The ``jax.ShapeDtypeStruct``s of a tree of ``Leaf``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree, is_leaf=_is_leaf)


def materialize(tree, seed: int) -> Any:
  """Device arrays for a tree of ``Leaf``, filled from ``numpy.random.default_rng(seed)``."""
  rng = np.random.default_rng(seed)

  def fill(x: Leaf):
    if x.fill == "normal":
      value = rng.standard_normal(x.shape, np.float32) * np.float32(x.scale)
    elif x.fill == "int":
      value = rng.integers(0, int(x.scale), x.shape)
    else:
      value = np.full(x.shape, 1 if x.fill == "ones" else 0)
    return jnp.asarray(value, x.dtype)

  return jax.tree.map(fill, tree, is_leaf=_is_leaf)


class Model(NamedTuple):
  """A benchmark model.

  Attributes:
    name: the row label, e.g. "scan_transformer_remat".
    params: the params as a tree of ``Leaf`` (dicts and lists).
    batch: the loss's arguments after params, a tuple of ``Leaf``.
    loss: ``loss(params, *batch) -> scalar``.
    live_grad_bytes: ``live_grad_bytes(params) -> int``: the gradient bytes that must exist at
      the same time even when every update is fused at the earliest point (the memory floor's
      part of the gradient; see ``optfuse._analysis._floor``).
    description: one line for the results.
    step_options: keyword arguments of ``fx.value_and_update`` (``microbatches``).
  """

  name: str
  params: Any
  batch: tuple[Leaf, ...]
  loss: Callable[..., jax.Array]
  live_grad_bytes: Callable[[Any], int]
  description: str
  step_options: dict[str, Any] = {}


def grad_bytes(params) -> int:
  """Bytes of the gradient of ``params``: one buffer per float leaf."""
  return sum(nbytes(p) for p in jax.tree.leaves(params, is_leaf=_is_leaf)
             if jnp.issubdtype(p.dtype, jnp.inexact))


def _largest_leaf(params) -> int:
  return max(nbytes(p) for p in jax.tree.leaves(params, is_leaf=_is_leaf))


def _dense(fan_in: int, fan_out: int, dtype, prefix: tuple[int, ...] = ()) -> Leaf:
  return Leaf((*prefix, fan_in, fan_out), dtype, "normal", 1 / math.sqrt(fan_in))


def _count(n: int) -> str:
  return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _num_params(params) -> int:
  return sum(math.prod(p.shape) for p in jax.tree.leaves(params, is_leaf=_is_leaf))


def param_count(params) -> str:
  """The number of params in a tree of ``Leaf``, rounded: "1.3B", "184M", "12k"."""
  return _count(_num_params(params))


def _classes(batch: tuple[int, ...], classes: int) -> Leaf:
  return Leaf(batch, jnp.int32, "int", classes)


# --- MLP ---------------------------------------------------------------------------------------


def _mlp_params(depth: int, width: int, inputs: int, classes: int, dtype) -> dict:
  sizes = [inputs] + [width] * depth + [classes]
  return {"layers": [{"w": _dense(a, b, dtype), "b": Leaf((b,), dtype, "zeros")}
                     for a, b in zip(sizes[:-1], sizes[1:], strict=True)]}


def _mlp_loss(params, x, y):
  *hidden, last = params["layers"]
  for layer in hidden:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  logits = (x @ last["w"] + last["b"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def mlp(depth: int = 4, width: int = 256, inputs: int = 128, classes: int = 10,
        batch: int = 64, dtype=jnp.float32) -> Model:
  """An unrolled MLP with tanh activations and a softmax cross-entropy loss."""
  params = _mlp_params(depth, width, inputs, classes, dtype)
  data = (Leaf((batch, inputs), dtype), _classes((batch,), classes))
  return Model("mlp", params, data, _mlp_loss, _largest_leaf,
               f"{_count(_num_params(params))} params, {depth}x{width} dense, batch {batch}")


def grad_accum(micro: int = 4, depth: int = 4, width: int = 256, inputs: int = 128,
               classes: int = 10, batch: int = 16, dtype=jnp.float32) -> Model:
  """The MLP on ``micro`` microbatches of ``batch`` examples per step, gradients accumulated."""
  params = _mlp_params(depth, width, inputs, classes, dtype)
  data = (Leaf((micro * batch, inputs), dtype), _classes((micro * batch,), classes))
  # The accumulated gradient is a whole gradient buffer that no fusion can remove.
  return Model("grad_accum", params, data, _mlp_loss, grad_bytes,
               f"{_count(_num_params(params))} params, {depth}x{width} dense, "
               f"{micro} microbatches of {batch}", {"microbatches": micro})


def scan_mlp(depth: int = 8, width: int = 256, inputs: int = 128, classes: int = 10,
             batch: int = 64, dtype=jnp.float32) -> Model:
  """Residual tanh blocks ``h + tanh(h @ w + b)``, stacked and scanned with remat."""
  params = {
      "inp": _dense(inputs, width, dtype),
      "layers": {"w": _dense(width, width, dtype, (depth,)),
                 "b": Leaf((depth, width), dtype, "zeros")},
      "out": _dense(width, classes, dtype),
  }

  def loss(params, x, y):
    body = lambda h, p: (h + jnp.tanh(h @ p["w"] + p["b"]), None)
    h, _ = jax.lax.scan(jax.checkpoint(body), jnp.tanh(x @ params["inp"]), params["layers"])
    logits = (h @ params["out"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def live(params):
    outside = grad_bytes({k: v for k, v in params.items() if k != "layers"})
    return outside + grad_bytes(params["layers"]) // depth

  data = (Leaf((batch, inputs), dtype), _classes((batch,), classes))
  return Model("scan_mlp_remat", params, data, loss, live,
               f"{_count(_num_params(params))} params, {depth}x{width} residual dense, "
               f"batch {batch}, remat")


# --- CNN ---------------------------------------------------------------------------------------


def cnn(channels: tuple[int, ...] = (16, 32), image: int = 32, classes: int = 10,
        batch: int = 16, dtype=jnp.float32) -> Model:
  """Strided 3x3 convolutions (NHWC), ReLU, global average pooling, a dense head."""
  chans = (3, *channels)
  params = {
      "convs": [{"w": Leaf((3, 3, a, b), dtype, "normal", 1 / math.sqrt(9 * a)),
                 "b": Leaf((b,), dtype, "zeros")} for a, b in zip(chans[:-1], chans[1:],
                                                                   strict=True)],
      "head": {"w": _dense(chans[-1], classes, dtype), "b": Leaf((classes,), dtype, "zeros")},
  }

  def loss(params, x, y):
    for conv in params["convs"]:
      x = jax.lax.conv_general_dilated(x, conv["w"], (2, 2), "SAME",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
      x = jax.nn.relu(x + conv["b"])
    logits = x.mean(axis=(1, 2)) @ params["head"]["w"] + params["head"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

  data = (Leaf((batch, image, image, 3), dtype), _classes((batch,), classes))
  return Model("cnn", params, data, loss, _largest_leaf,
               f"{_count(_num_params(params))} params, convs {'-'.join(map(str, channels))} "
               f"on {image}x{image}, batch {batch}")


# --- Decoders ----------------------------------------------------------------------------------


class DecoderConfig(NamedTuple):
  """A GPT-style decoder: pre-norm blocks (causal attention, GELU MLP), tied embedding.

  With ``attention=False`` each block's attention is a ``dim x dim`` projection of its normed
  input (no ``qkv``, no mixing over positions): the layers' params and activations without
  attention's, the FSDP promises' other case (docs' FSDP table).
  """

  layers: int = 2
  dim: int = 64
  heads: int = 4
  ff: int = 256
  vocab: int = 256
  seq: int = 32
  batch: int = 4
  dtype: Any = jnp.float32
  attention: bool = True


def _block_params(c: DecoderConfig, prefix: tuple[int, ...]) -> dict:
  qkv = {"qkv": _dense(c.dim, 3 * c.dim, c.dtype, prefix)} if c.attention else {}
  return {
      "norm1": Leaf((*prefix, c.dim), c.dtype, "ones"),
      **qkv,
      "proj": _dense(c.dim, c.dim, c.dtype, prefix),
      "norm2": Leaf((*prefix, c.dim), c.dtype, "ones"),
      "up": _dense(c.dim, c.ff, c.dtype, prefix),
      "down": _dense(c.ff, c.dim, c.dtype, prefix),
  }


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return x32.astype(x.dtype) * scale


def _block(p: dict, h: jax.Array, heads: int) -> jax.Array:
  if "qkv" not in p:  # DecoderConfig(attention=False)
    h = h + _rms_norm(h, p["norm1"]) @ p["proj"]
    return h + jax.nn.gelu(_rms_norm(h, p["norm2"]) @ p["up"]) @ p["down"]
  b, t, d = h.shape
  q, k, v = jnp.split(_rms_norm(h, p["norm1"]) @ p["qkv"], 3, axis=-1)
  q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(d // heads)
  causal = jnp.tril(jnp.ones((t, t), bool))
  weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(h.dtype)
  attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
  h = h + attn @ p["proj"]
  return h + jax.nn.gelu(_rms_norm(h, p["norm2"]) @ p["up"]) @ p["down"]


def _decoder_loss(params, tokens, targets, *, heads: int, scanned: bool, remat: bool):
  h = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
  if scanned:
    body = lambda h, p: (_block(p, h, heads), None)
    h, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, h, params["layers"])
  else:
    block = lambda p, h: _block(p, h, heads)
    block = jax.checkpoint(block) if remat else block
    for p in params["layers"]:
      h = block(p, h)
  logits = (_rms_norm(h, params["norm"]) @ params["embed"].T).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def decoder(c: DecoderConfig, scanned: bool, remat: bool, name: str | None = None) -> Model:
  """A decoder; ``scanned`` stacks the blocks under ``lax.scan``, ``remat`` checkpoints them.

  The gradient a fused step must still hold at once (``live_grad_bytes``): the leaves outside the
  blocks (the tied embedding's gradient is complete only at the end of the backward pass) plus
  one block's gradient: one layer's slice of the stacked leaves when scanned, the largest block
  leaf when unrolled.
  """
  name = name or ("scan_transformer" if scanned else "transformer") + ("_remat" if remat else "")
  layers = (_block_params(c, (c.layers,)) if scanned
            else [_block_params(c, ()) for _ in range(c.layers)])
  params = {
      "embed": Leaf((c.vocab, c.dim), c.dtype, "normal", 0.02),
      "pos": Leaf((c.seq, c.dim), c.dtype, "normal", 0.02),
      "layers": layers,
      "norm": Leaf((c.dim,), c.dtype, "ones"),
  }
  tokens = Leaf((c.batch, c.seq), jnp.int32, "int", c.vocab)

  def loss(params, tokens, targets):
    return _decoder_loss(params, tokens, targets, heads=c.heads, scanned=scanned, remat=remat)

  def live(params):
    outside = grad_bytes({k: v for k, v in params.items() if k != "layers"})
    if scanned:
      return outside + grad_bytes(params["layers"]) // c.layers
    return outside + _largest_leaf(params["layers"])

  return Model(name, params, (tokens, tokens), loss, live,
               f"{_count(_num_params(params))} params, {c.layers}L d{c.dim} ff{c.ff} "
               f"T{c.seq} B{c.batch}" + (", remat" if remat else ""))
