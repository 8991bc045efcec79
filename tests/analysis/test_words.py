"""``_words.word_readers``: each rule of the walk over a compiled program, on small programs
whose argument ``w`` holds words (the fused low-bit steps are checked in
tests/low_bit/test_low_bit_words.py)."""

import jax
import jax.numpy as jnp
from jax import lax

from optfuse._analysis import _hlo, _words

W = jnp.zeros((4, 8), jnp.float32)


def _walk(fn, *args) -> _words.WordWalk:
  hlo = jax.jit(fn).lower(W, *args).compile().as_text()
  return _words.word_readers(hlo, lambda path: path == "w")


def _codes(w):
  return lax.bitcast_convert_type(w, jnp.uint32)


def test_words_bitcast_to_integers_are_codes_and_nothing_reads_them():
  walk = _walk(lambda w: (_codes(w) >> 8) & 0xFF)
  assert walk.sources and walk.to_integer and not walk.reads and not walk.outputs


def test_an_add_a_multiply_or_a_convert_on_the_words_is_a_read():
  for fn, opcode in ((lambda w, z: w + z, "add"), (lambda w, z: w * (1 + z), "multiply"),
                     (lambda w, z: w.astype(jnp.int32) + z.astype(jnp.int32), "convert")):
    walk = _walk(fn, jnp.zeros((4, 8), jnp.float32))
    assert opcode in {r.opcode for r in walk.reads}, (opcode, walk.reads)


def test_words_moved_through_slices_tuples_and_a_loop_then_returned_are_outputs_only():
  def fn(w):
    def body(_, carry):
      words, acc = carry
      row = lax.dynamic_slice_in_dim(words, 1, 1)
      return lax.dynamic_update_slice_in_dim(words, row, 0, 0), acc + _codes(row).sum()
    return lax.fori_loop(0, 3, body, (jnp.transpose(w).T, jnp.uint32(0)))

  walk = _walk(fn)
  assert not walk.reads and walk.outputs == [(0,)] and walk.to_integer


def test_words_made_from_integers_are_followed_to_the_outputs():
  walk = _walk(lambda w, c: (w, lax.bitcast_convert_type(c << 1, jnp.float32) * 2),
               jnp.zeros((4, 8), jnp.uint32))
  assert [r.opcode for r in walk.reads] == ["multiply"]


def test_a_select_of_words_moves_them_and_one_against_a_non_word_is_listed():
  walk = _walk(lambda w, p: jnp.where(p, w, 0.0), jnp.ones((4, 8), bool))
  assert not walk.reads and walk.outputs == [()] and len(walk.mixed_selects) == 1
  walk = _walk(lambda w, p: jnp.where(p, w, w[::-1]), jnp.ones((4, 8), bool))
  assert not walk.reads and not walk.mixed_selects


def test_hlo_text_parses_tuple_types_commented_operands_and_the_root():
  line = ("  ROOT %t = (f32[4]{0}, (s32[], u32[2]{0})) tuple(%a, /*index=1*/%b), "
          'metadata={op_name="x"}')
  i = _hlo.parse_instruction(line)
  assert i.root and i.opcode == "tuple" and i.operands == ("a", "b") and i.op_name() == "x"
  assert i.type == ("f32[4]{0}", ("s32[]", "u32[2]{0}"))
  assert _hlo.dtype(i.type[1][1]) == "u32"
