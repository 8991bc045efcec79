"""Block quantization of the low-bit state, bit for bit against the anchors' published schemes.

The tables are written out here as the anchors publish them: bitsandbytes'
``create_dynamic_map(signed=True)`` and ``create_dynamic_map(signed=False)`` (8 bits), torchao's
4-bit AdamW maps (``create_dynamic_map(True, 3, 4)`` for the first moment, ``linspace(0, 1,
17)[1:]`` for the second). The references below restate, in numpy, bitsandbytes'
``quantize_blockwise`` / ``dequantize_blockwise`` (its PyTorch kernel: ``x * (1 / absmax)``
clamped to [-1, 1], ``torch.bucketize`` over the midpoints, ``code[q] * absmax``) and torchao's
``scale_tensor`` / ``quantize_4bit_with_qmap`` / ``dequant_with_qmap`` and its nibble packing.
Every comparison is exact: the schemes are float32 arithmetic done in the same order.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from optfuse._low_bit import _blocks, _maps, _search
from optfuse._targets import _backends

BNB_DYNAMIC_SIGNED = np.array([
    -0.992968738079071, -0.9789062738418579, -0.96484375, -0.9507812261581421,
    -0.936718761920929, -0.922656238079071, -0.9085937738418579, -0.89453125,
    -0.8804687261581421, -0.866406261920929, -0.852343738079071, -0.8382812738418579,
    -0.82421875, -0.8101562261581421, -0.796093761920929, -0.782031238079071,
    -0.7679687738418579, -0.75390625, -0.7398437261581421, -0.725781261920929,
    -0.7117187976837158, -0.6976562738418579, -0.68359375, -0.6695312261581421,
    -0.655468761920929, -0.6414062976837158, -0.6273437738418579, -0.61328125,
    -0.5992187261581421, -0.585156261920929, -0.5710937976837158, -0.5570312738418579,
    -0.54296875, -0.5289062261581421, -0.5148437023162842, -0.500781238079071,
    -0.48671871423721313, -0.47265625, -0.4585937261581421, -0.44453126192092896,
    -0.43046873807907104, -0.4164062440395355, -0.40234375, -0.3882812261581421,
    -0.37421876192092896, -0.36015623807907104, -0.3460937440395355, -0.33203125,
    -0.3179687261581421, -0.30390626192092896, -0.28984373807907104, -0.2757812738418579,
    -0.26171875, -0.24765624105930328, -0.23359374701976776, -0.21953125298023224,
    -0.20546874403953552, -0.19140625, -0.17734375596046448, -0.16328124701976776,
    -0.14921875298023224, -0.13515624403953552, -0.12109375, -0.10703125596046448,
    -0.09859374910593033, -0.09578125923871994, -0.09296875447034836, -0.09015624970197678,
    -0.08734375238418579, -0.08453124761581421, -0.08171875774860382, -0.07890625298023224,
    -0.07609374821186066, -0.07328125089406967, -0.07046874612569809, -0.0676562562584877,
    -0.06484375149011612, -0.062031250447034836, -0.05921875312924385, -0.05640624836087227,
    -0.053593751043081284, -0.05078125, -0.047968748956918716, -0.04515625163912773,
    -0.04234374687075615, -0.039531249552965164, -0.03671875223517418, -0.033906251192092896,
    -0.031093750149011612, -0.028281250968575478, -0.025468749925494194, -0.02265625074505806,
    -0.019843751564621925, -0.017031250521540642, -0.014218750409781933, -0.011406250298023224,
    -0.009718749672174454, -0.009156249463558197, -0.008593750186264515, -0.008031249977648258,
    -0.0074687497690320015, -0.006906250026077032, -0.006343749817460775, -0.005781250074505806,
    -0.0052187503315508366, -0.0046562496572732925, -0.004093749914318323, -0.0035312497057020664,
    -0.002968749962747097, -0.002406249986961484, -0.001843750011175871, -0.001281249918974936,
    -0.0009437500848434865, -0.0008312499849125743, -0.0007187500596046448, -0.0006062500760890543,
    -0.000493750034365803, -0.0003812500217463821, -0.0002687500382307917, -0.00015625001105945557,
    -8.874999912222847e-05, -6.625000241911039e-05, -4.374999844003469e-05, -2.1249998098937795e-05,
    -7.749999895168003e-06, -3.250000190746505e-06, -5.500000384017767e-07, 0.0,
    5.500000384017767e-07, 3.250000190746505e-06, 7.749999895168003e-06, 2.1249998098937795e-05,
    4.374999844003469e-05, 6.625000241911039e-05, 8.874999912222847e-05, 0.00015625001105945557,
    0.0002687500382307917, 0.0003812500217463821, 0.000493750034365803, 0.0006062500760890543,
    0.0007187500596046448, 0.0008312499849125743, 0.0009437500848434865, 0.001281249918974936,
    0.001843750011175871, 0.002406249986961484, 0.002968749962747097, 0.0035312497057020664,
    0.004093749914318323, 0.0046562496572732925, 0.0052187503315508366, 0.005781250074505806,
    0.006343749817460775, 0.006906250026077032, 0.0074687497690320015, 0.008031249977648258,
    0.008593750186264515, 0.009156249463558197, 0.009718749672174454, 0.011406250298023224,
    0.014218750409781933, 0.017031250521540642, 0.019843751564621925, 0.02265625074505806,
    0.025468749925494194, 0.028281250968575478, 0.031093750149011612, 0.033906251192092896,
    0.03671875223517418, 0.039531249552965164, 0.04234374687075615, 0.04515625163912773,
    0.047968748956918716, 0.05078125, 0.053593751043081284, 0.05640624836087227,
    0.05921875312924385, 0.062031250447034836, 0.06484375149011612, 0.0676562562584877,
    0.07046874612569809, 0.07328125089406967, 0.07609374821186066, 0.07890625298023224,
    0.08171875774860382, 0.08453124761581421, 0.08734375238418579, 0.09015624970197678,
    0.09296875447034836, 0.09578125923871994, 0.09859374910593033, 0.10703125596046448,
    0.12109375, 0.13515624403953552, 0.14921875298023224, 0.16328124701976776,
    0.17734375596046448, 0.19140625, 0.20546874403953552, 0.21953125298023224,
    0.23359374701976776, 0.24765624105930328, 0.26171875, 0.2757812738418579,
    0.28984373807907104, 0.30390626192092896, 0.3179687261581421, 0.33203125,
    0.3460937440395355, 0.36015623807907104, 0.37421876192092896, 0.3882812261581421,
    0.40234375, 0.4164062440395355, 0.43046873807907104, 0.44453126192092896,
    0.4585937261581421, 0.47265625, 0.48671871423721313, 0.500781238079071,
    0.5148437023162842, 0.5289062261581421, 0.54296875, 0.5570312738418579,
    0.5710937976837158, 0.585156261920929, 0.5992187261581421, 0.61328125,
    0.6273437738418579, 0.6414062976837158, 0.655468761920929, 0.6695312261581421,
    0.68359375, 0.6976562738418579, 0.7117187976837158, 0.725781261920929,
    0.7398437261581421, 0.75390625, 0.7679687738418579, 0.782031238079071,
    0.796093761920929, 0.8101562261581421, 0.82421875, 0.8382812738418579,
    0.852343738079071, 0.866406261920929, 0.8804687261581421, 0.89453125,
    0.9085937738418579, 0.922656238079071, 0.936718761920929, 0.9507812261581421,
    0.96484375, 0.9789062738418579, 0.992968738079071, 1.0,
], dtype=np.float32)

BNB_DYNAMIC_UNSIGNED = np.array([
    0.0, 3.2500003044333425e-07, 7.749999895168003e-07, 2.1249998098937795e-06,
    4.374999662104528e-06, 6.624999969062628e-06, 8.874999366526026e-06, 1.5624998923158273e-05,
    2.6875000912696123e-05, 3.8124999264255166e-05, 4.937499761581421e-05, 6.0625003243330866e-05,
    7.187500159488991e-05, 8.312499267049134e-05, 9.4374998298008e-05, 0.00012812500062864274,
    0.00018437500693835318, 0.00024062501324806362, 0.00029687501955777407, 0.0003531249822117388,
    0.00040937503217719495, 0.00046562502393499017, 0.0005218750447966158, 0.0005781250074505806,
    0.0006343750283122063, 0.0006906250491738319, 0.0007468750118277967, 0.0008031250908970833,
    0.000859375053551048, 0.0009156250162050128, 0.0009718750370666385, 0.0011406249832361937,
    0.0014218749711290002, 0.0017031249590218067, 0.001984375063329935, 0.0022656249348074198,
    0.0025468748062849045, 0.002828124910593033, 0.0031093747820705175, 0.0033906251192092896,
    0.0036718749906867743, 0.003953124862164259, 0.0042343745008111, 0.004515625070780516,
    0.004796874709427357, 0.005078124813735485, 0.0053593749180436134, 0.0056406245566904545,
    0.00592187512665987, 0.006203124765306711, 0.0064843748696148396, 0.006765625439584255,
    0.007046874612569809, 0.007328125182539225, 0.007609374355524778, 0.007890624925494194,
    0.008171875029802322, 0.008453124202787876, 0.008734375238418579, 0.009015624411404133,
    0.009296874515712261, 0.009578125551342964, 0.009859374724328518, 0.010703125968575478,
    0.012109375558793545, 0.013515624217689037, 0.014921875670552254, 0.016328124329447746,
    0.017734376713633537, 0.01914062537252903, 0.020546874031424522, 0.021953126415610313,
    0.023359375074505806, 0.0247656237334013, 0.02617187611758709, 0.02757812850177288,
    0.028984373435378075, 0.030390625819563866, 0.03179687261581421, 0.033203125,
    0.03460937365889549, 0.036015626043081284, 0.037421878427267075, 0.03882812336087227,
    0.04023437574505806, 0.04164062440395355, 0.043046873062849045, 0.044453125447034836,
    0.04585937410593033, 0.04726562649011612, 0.048671871423721313, 0.050078123807907104,
    0.0514843724668026, 0.05289062485098839, 0.05429687723517418, 0.05570312961935997,
    0.05710938200354576, 0.058515626937150955, 0.05992187187075615, 0.06132812425494194,
    0.06273438036441803, 0.06414063274860382, 0.06554687768220901, 0.06695312261581421,
    0.068359375, 0.06976562738418579, 0.07117187976837158, 0.07257812470197678,
    0.07398437708616257, 0.07539062947034836, 0.07679688185453415, 0.07820312678813934,
    0.07960937917232513, 0.08101562410593033, 0.08242187649011612, 0.08382812887430191,
    0.0852343738079071, 0.0866406261920929, 0.08804687112569809, 0.08945312350988388,
    0.09085937589406967, 0.09226562827825546, 0.09367188066244125, 0.09507812559604645,
    0.09648437798023224, 0.09789063036441803, 0.09929687529802322, 0.103515625,
    0.11054687201976776, 0.11757812649011612, 0.12460937350988388, 0.13164061307907104,
    0.138671875, 0.14570313692092896, 0.15273436903953552, 0.15976563096046448,
    0.16679686307907104, 0.173828125, 0.18085938692092896, 0.18789061903953552,
    0.19492188096046448, 0.20195311307907104, 0.208984375, 0.21601563692092896,
    0.22304686903953552, 0.23007813096046448, 0.23710936307907104, 0.244140625,
    0.25117185711860657, 0.2582031190395355, 0.2652343809604645, 0.27226561307907104,
    0.279296875, 0.28632813692092896, 0.2933593690395355, 0.3003906011581421,
    0.30742186307907104, 0.314453125, 0.32148438692092896, 0.3285156190395355,
    0.3355468511581421, 0.34257811307907104, 0.349609375, 0.35664063692092896,
    0.3636718690395355, 0.3707031011581421, 0.37773436307907104, 0.384765625,
    0.39179688692092896, 0.3988281190395355, 0.4058593511581421, 0.41289061307907104,
    0.419921875, 0.42695313692092896, 0.4339843690395355, 0.4410156011581421,
    0.44804686307907104, 0.455078125, 0.46210938692092896, 0.4691406190395355,
    0.4761718511581421, 0.48320311307907104, 0.490234375, 0.49726560711860657,
    0.5042968988418579, 0.5113281011581421, 0.518359363079071, 0.525390625,
    0.5324218273162842, 0.5394531488418579, 0.5464843511581421, 0.5535156726837158,
    0.560546875, 0.567578136920929, 0.5746093988418579, 0.5816406011581421,
    0.5886719226837158, 0.595703125, 0.602734386920929, 0.6097656488418579,
    0.6167968511581421, 0.6238281726837158, 0.630859375, 0.637890636920929,
    0.6449218988418579, 0.6519531011581421, 0.6589844226837158, 0.666015625,
    0.673046886920929, 0.6800781488418579, 0.6871093511581421, 0.6941406726837158,
    0.701171875, 0.708203136920929, 0.7152343988418579, 0.7222656011581421,
    0.7292969226837158, 0.736328125, 0.743359386920929, 0.7503906488418579,
    0.7574218511581421, 0.7644531726837158, 0.771484375, 0.7785155773162842,
    0.7855468988418579, 0.7925781011581421, 0.7996094226837158, 0.806640625,
    0.8136718273162842, 0.8207031488418579, 0.8277343511581421, 0.8347656726837158,
    0.841796875, 0.8488280773162842, 0.8558593988418579, 0.8628906011581421,
    0.8699219226837158, 0.876953125, 0.8839843273162842, 0.8910156488418579,
    0.8980468511581421, 0.9050781726837158, 0.912109375, 0.9191405773162842,
    0.9261718988418579, 0.9332031011581421, 0.9402344226837158, 0.947265625,
    0.9542968273162842, 0.9613281488418579, 0.9683593511581421, 0.9753906726837158,
    0.982421875, 0.9894530773162842, 0.9964843988418579, 1.0,
], dtype=np.float32)

TORCHAO_4BIT_SIGNED = np.array([
    -0.887499988079071, -0.6625000238418579, -0.4375, -0.21249999105930328,
    -0.07750000059604645, -0.0325000025331974, -0.005499999970197678, 0.0,
    0.005499999970197678, 0.0325000025331974, 0.07750000059604645, 0.21249999105930328,
    0.4375, 0.6625000238418579, 0.887499988079071, 1.0,
], dtype=np.float32)

TORCHAO_4BIT_UNSIGNED = np.array([
    0.0625, 0.125, 0.1875, 0.25, 0.3125, 0.375, 0.4375, 0.5,
    0.5625, 0.625, 0.6875, 0.75, 0.8125, 0.875, 0.9375, 1.0,
], dtype=np.float32)


MAPS = {(8, True): BNB_DYNAMIC_SIGNED, (8, False): BNB_DYNAMIC_UNSIGNED,
        (4, True): TORCHAO_4BIT_SIGNED, (4, False): TORCHAO_4BIT_UNSIGNED}


def _bnb_quantize_blockwise(a, code, block_size):
  """bitsandbytes' quantize_blockwise on whole blocks of the flattened array."""
  blocks = a.astype(np.float32).reshape(-1, block_size)
  absmax = np.abs(blocks).max(axis=-1)
  scaled = np.clip(blocks * (np.float32(1.0) / np.maximum(absmax, np.float32(1e-38)))[:, None],
                   -1, 1)
  bounds = (code[:-1] + code[1:]) / np.float32(2)
  q = np.searchsorted(bounds, scaled.reshape(-1), side="left")  # torch.bucketize(right=False)
  return q.astype(np.uint8), absmax


def _bnb_dequantize_blockwise(q, absmax, code, block_size):
  return (code[q.astype(np.int64)].reshape(-1, block_size) * absmax[:, None]).reshape(-1)


def _torchao_quantize_4bit(a, qmap, block_size):
  """torchao's scale_tensor, quantize_4bit_with_qmap and packing (first code in the high
  nibble)."""
  x = a.astype(np.float32).reshape(-1, block_size)
  scale = np.maximum(np.abs(x).max(axis=-1), np.float32(1e-12))
  x = (x / scale[:, None]).reshape(-1)
  codes = np.where(x >= qmap[8], 8, 0)
  for s in (4, 2, 1):
    codes += np.where(x >= qmap[codes + s], s, 0)
  up = np.minimum(codes + 1, 15)
  down_value, up_value = qmap[codes], qmap[up]
  codes = np.where(x - down_value >= (up_value - down_value) * np.float32(0.5), up, codes)
  return ((codes[::2] << 4) | codes[1::2]).astype(np.uint8), scale


def _torchao_dequantize_4bit(packed, scale, qmap, block_size):
  codes = np.stack([packed >> 4, packed & 0b1111], axis=-1).reshape(-1)
  return (qmap[codes.astype(np.int64)].reshape(-1, block_size) * scale[:, None]).reshape(-1)


def _as_bytes(words):
  """The packed codes as the anchors store them: bytes, little-endian."""
  return np.asarray(words).view(np.uint32).astype("<u4").view(np.uint8).reshape(-1)


def _slot(signed: bool, shape, seed: int):
  """Random values of a first moment (either sign) or a second moment (non-negative), over
  several magnitudes, with one all-zero block and one block holding its absmax and values on
  the map's midpoints (the rounding's ties)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32) * np.float32(10.0) ** rng.integers(
      -8, 2, shape[:-1] + (1,)).astype(np.float32)
  x = x if signed else x * x
  flat = x.reshape(-1)
  flat[:256] = 0.0
  return x, flat


@pytest.mark.parametrize("signed", [True, False])
def test_the_maps_are_the_published_tables(signed):
  for bits in (8, 4):
    np.testing.assert_array_equal(_maps.scheme(bits, signed).table, MAPS[bits, signed])
  np.testing.assert_array_equal(_maps.dynamic_map(signed), MAPS[8, signed])


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8_bit_quantization_is_bitsandbytes_quantize_blockwise_bit_for_bit(signed):
  code, block = BNB_DYNAMIC_SIGNED if signed else BNB_DYNAMIC_UNSIGNED, 256
  x, flat = _slot(signed, (6, 4 * block), seed=1)
  # Ties: a block whose absmax is 1 and whose other values are the midpoints exactly.
  mids = (code[:-1] + code[1:]) / np.float32(2)
  flat[block:2 * block] = np.concatenate([[1.0], mids[:block - 1]]).astype(np.float32)
  words, scales = _blocks.quantize(jnp.asarray(x), _maps.scheme(8, signed), block)
  want_q, want_absmax = _bnb_quantize_blockwise(x, code, block)
  np.testing.assert_array_equal(_as_bytes(words), want_q)
  np.testing.assert_array_equal(np.asarray(scales).reshape(-1), want_absmax)
  got = _blocks.dequantize(words, scales, _maps.scheme(8, signed), block, x.shape[-1])
  np.testing.assert_array_equal(np.asarray(got).reshape(-1),
                                _bnb_dequantize_blockwise(want_q, want_absmax, code, block))


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_4_bit_quantization_is_torchaos_4_bit_adamw_bit_for_bit(signed):
  qmap, block = TORCHAO_4BIT_SIGNED if signed else TORCHAO_4BIT_UNSIGNED, 128
  x, flat = _slot(signed, (6, 4 * block), seed=2)
  # Ties: values half way between entries, in a block whose absmax is 1.
  halves = (qmap[:-1] + qmap[1:]) / np.float32(2)
  flat[block:2 * block] = np.resize(np.concatenate([[1.0], halves]), block).astype(np.float32)
  words, scales = _blocks.quantize(jnp.asarray(x), _maps.scheme(4, signed), block)
  want_packed, want_scale = _torchao_quantize_4bit(x, qmap, block)
  np.testing.assert_array_equal(_as_bytes(words), want_packed)
  np.testing.assert_array_equal(np.asarray(scales).reshape(-1), want_scale)
  got = _blocks.dequantize(words, scales, _maps.scheme(4, signed), block, x.shape[-1])
  np.testing.assert_array_equal(np.asarray(got).reshape(-1),
                                _torchao_dequantize_4bit(want_packed, want_scale, qmap, block))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_last_axis_not_a_multiple_of_the_block_is_cut_into_equal_blocks(bits):
  """``2 * block + 37`` values a row are three blocks of equal length (a multiple of 8, at most
  ``block``), each quantized as its own values, padded with fewer than 8 zeros a block."""
  block = _maps.DEFAULT_BLOCK_SIZE[bits]
  scheme = _maps.scheme(bits, True)
  n = 2 * block + 37
  x = jax.random.normal(jax.random.key(0), (3, n))
  b = _blocks.leaf_block(n, block)
  assert b <= block and b % 8 == 0 and 0 <= 3 * b - n < 3 * 8
  words, scales = _blocks.quantize(x, scheme, block)
  assert words.shape == _blocks.words_shape(x.shape, bits, block) == (3, 3 * b * bits // 32)
  assert scales.shape == _blocks.scales_shape(x.shape, block) == (3, 3)
  padded = jnp.pad(x, ((0, 0), (0, 3 * b - n)))
  per_block = b * bits // 32
  for k in range(3):
    block_words, block_scales = _blocks.quantize(padded[:, k * b:(k + 1) * b], scheme, block)
    np.testing.assert_array_equal(scales[:, k:k + 1], block_scales)
    np.testing.assert_array_equal(words[:, k * per_block:(k + 1) * per_block], block_words)
  got = _blocks.dequantize(words, scales, scheme, block, n)
  assert got.shape == x.shape


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_shorter_than_the_block_is_one_block_of_its_own_length(bits):
  """A 64-wide row's codes take 64 codes' bytes, not a ``block`` padded with zeros."""
  block, scheme = _maps.DEFAULT_BLOCK_SIZE[bits], _maps.scheme(bits, False)
  x = jnp.abs(jax.random.normal(jax.random.key(1), (5, 64)))
  words, scales = _blocks.quantize(x, scheme, block)
  assert words.shape == (5, 64 * bits // 32) and scales.shape == (5, 1)
  np.testing.assert_array_equal(scales[:, 0], jnp.max(x, axis=-1))
  got = _blocks.dequantize(words, scales, scheme, block, 64)
  # Within a step of the map: 1/16 of the absmax for 4 bits' linear map, 1/128 for 8 bits'.
  step = jnp.max(x, axis=-1, keepdims=True) / (16 if bits == 4 else 128)
  assert bool(jnp.all(jnp.abs(got - x) <= step))


def _largest_value(jaxpr) -> int:
  """The most elements of any value an equation of ``jaxpr`` (or of its sub-jaxprs) makes."""
  sizes = [int(np.prod(v.aval.shape)) for eqn in jaxpr.eqns for v in eqn.outvars]
  sizes += [_largest_value(sub) for eqn in jaxpr.eqns
            for sub in jcore.jaxprs_in_params(eqn.params)]
  return max(sizes)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantizing_never_broadcasts_a_slot_against_its_map(bits):
  """The code lookup holds arrays of the slot's size: no intermediate has 256 (or 16)
  values per element of the slot, as an argmin over the map would."""
  x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
  scheme = _maps.scheme(bits, False)
  jaxpr = jax.make_jaxpr(lambda x: _blocks.dequantize(
      *_blocks.quantize(x, scheme, 256), scheme, 256, 1024))(x)
  assert _largest_value(jaxpr.jaxpr) == 64 * 1024


def _reference_codes(y, bits: int, signed: bool):
  """The anchors' rounding of normalized values, restated above: bitsandbytes' bucketize over
  the midpoints, torchao's search and half-way rule."""
  table = MAPS[bits, signed]
  if bits == 8:
    return np.searchsorted((table[:-1] + table[1:]) / np.float32(2), y, side="left")
  codes = np.where(y >= table[8], 8, 0)
  for s in (4, 2, 1):
    codes += np.where(y >= table[codes + s], s, 0)
  up = np.minimum(codes + 1, 15)
  return np.where(y - table[codes] >= (table[up] - table[codes]) * np.float32(0.5), up, codes)


@pytest.mark.parametrize("bits,method", [(8, "compact"), (8, "raw"), (4, "compact"), (4, "raw"),
                                         (4, "compare")])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_code_search_rounds_every_threshold_and_its_neighbours_as_the_anchors_do(
    bits, method, signed):
  """The code search (``_search``), by each method, against the anchors' rounding on the
  values where a code changes, three ulps either side, the entries, the midpoints, zeros and
  +-1 (negative values too for the unsigned maps, which take code 0)."""
  scheme = _maps.scheme(bits, signed)
  table = MAPS[bits, signed]
  points = np.concatenate([_search.thresholds(scheme), table, -table,
                           (table[:-1] + table[1:]) / np.float32(2), [0.0, -0.0]])
  values, up, down = [points], points, points
  for _ in range(3):
    up, down = np.nextafter(up, np.float32(2)), np.nextafter(down, np.float32(-2))
    values += [up, down]
  y = np.clip(np.concatenate(values), -1, 1).astype(np.float32)
  got = np.asarray(jax.jit(lambda y: _search.lookup(y, scheme, method))(y))
  np.testing.assert_array_equal(got, _reference_codes(y, bits, signed))
  assert got.min() == 0 and got.max() == 2 ** bits - 1


def _table_sizes(fn, *args) -> set[int]:
  """The sizes of the 1-D constants a traced ``fn`` gathers from."""
  jaxpr = jax.make_jaxpr(fn)(*args)
  return {int(np.size(c)) for c in jaxpr.consts if np.ndim(c) == 1}


def _gathers(fn, *args) -> int:
  return sum(e.primitive.name == "gather" for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns)


def test_each_platform_takes_its_code_search():
  """XLA:CPU looks 8-bit codes up by raw float bits (the signed map's tables: 24,513 entries)
  and compares 4-bit values with their map's 15 thresholds (no gather); a step traced for a
  TPU or GPU keeps the compact tables (2,945 and 81 entries)."""
  signed8, signed4 = _maps.scheme(8, True), _maps.scheme(4, True)
  y = jax.ShapeDtypeStruct((8, 256), jnp.float32)
  assert 24513 in _table_sizes(lambda y: _search.lookup(y, signed8), y)
  assert _gathers(lambda y: _search.lookup(y, signed4), y) == 0
  for platform in ("tpu", "cuda"):  # lowering_for reads a target's platform only, here
    with _backends.lowering_for(types.SimpleNamespace(platform=platform, devices=[None])):
      sizes8 = _table_sizes(lambda y: _search.lookup(y, signed8), y)
      sizes4 = _table_sizes(lambda y: _search.lookup(y, signed4), y)
    assert 2945 in sizes8 and 24513 not in sizes8
    assert 81 in sizes4


def test_comparing_is_only_for_16_entry_maps_and_a_method_must_exist():
  with pytest.raises(ValueError, match="16 entries"):
    _search.lookup(jnp.zeros(4), _maps.scheme(8, True), "compare")
  with pytest.raises(ValueError, match="one of"):
    _search.lookup(jnp.zeros(4), _maps.scheme(8, True), "binary")
