"""penzai 0.2.5's Llama-like transformer with its ``LayerStack``, as its users build it.

``build_llamalike_transformer`` with ``use_layer_stack=True`` stacks the decoder blocks' params
on a leading axis and runs them with ``jax.lax.scan(..., unroll=True)`` (penzai/nn/layer_stack.py),
without remat. Params are unbound with ``pz.unbind_params(model, freeze=True)`` and bound again
inside the loss with ``pz.bind_variables``, as penzai's training examples do. ``ISSUE`` is the
configuration of the penzai issue (12 blocks of d=512, 205 MB of float32 params); ``SMALL`` trains
in seconds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.models.transformer.variants import llamalike_common

ISSUE = dict(num_kv_heads=2, query_head_multiplier=2, embedding_dim=512, projection_dim=128,
             mlp_hidden_dim=2048, num_decoder_blocks=12, vocab_size=8000,
             mlp_variant="geglu_approx", tie_embedder_and_logits=True, use_layer_stack=True)
SMALL = {**ISSUE, "embedding_dim": 32, "projection_dim": 8, "mlp_hidden_dim": 64,
         "num_decoder_blocks": 4, "vocab_size": 64}


def build(config: dict, seed: int = 0):
  """``(loss_fn, params)``: next-token cross-entropy of the model, and its unbound params."""
  cfg = llamalike_common.LlamalikeTransformerConfig(**config)
  model = llamalike_common.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(seed))
  unbound, params = pz.unbind_params(model, freeze=True)

  def loss_fn(params, tokens):
    bound = pz.bind_variables(unbound, params)
    logits = bound(pz.nx.wrap(tokens).tag("batch", "seq"))
    logp = jax.nn.log_softmax(logits.untag("batch", "seq", "vocabulary").unwrap(), axis=-1)
    picked = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(picked)

  return loss_fn, params
