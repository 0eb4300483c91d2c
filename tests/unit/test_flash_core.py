"""The shared flash-attention pieces (layers.flash_core) against a dense softmax in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers import flash_core
from layers import masks

TOL = dict(rtol=1e-5, atol=1e-6)


def _softmax_reference(logits, v):
  """Dense softmax over the last axis, times v `[B, S, H]` (G query rows per batch entry)."""
  p = jax.nn.softmax(logits, axis=-1)  # [B, G, T, S]
  return jnp.einsum('BGTS,BSH->BGTH', p, v), jax.nn.logsumexp(logits, axis=-1)


def _logits_and_values(rng, b=2, g=3, t=5, s=12, h=4):
  logits = rng.standard_normal((b, g, t, s)).astype(np.float32) * 3
  # Hidden keys: a whole tile hidden from row 0 (its running max stays -inf over that tile) and
  # scattered entries elsewhere, as causality and segments leave them.
  logits[:, :, 0, :4] = -np.inf
  logits[:, :, 1:, :][rng.random((b, g, t - 1, s)) < 0.3] = -np.inf
  logits[:, :, 1:, 0] = 0.5  # every row keeps one visible key
  return jnp.asarray(logits), jnp.asarray(rng.standard_normal((b, s, h)), jnp.float32)


def _online(logits, v, tile, lanes=None):
  """Online softmax over key tiles of width `tile`; statistics `[..., T]` or `[..., T, lanes]`."""
  rows = logits.shape[:-1]
  m, l, acc = flash_core.init_carry(rows, v.shape[-1])
  if lanes:
    m, l = (jnp.broadcast_to(x[..., None], rows + (lanes,)) for x in (m, l))
  for j in range(0, logits.shape[-1], tile):
    m, l, acc = flash_core.online_update((m, l, acc), logits[..., j:j + tile], v[:, j:j + tile])
  return flash_core.finalize((m, l, acc))


@pytest.mark.parametrize('tile', [4, 12])
def test_online_update_over_tiles_equals_one_softmax(tile):
  logits, v = _logits_and_values(np.random.default_rng(0))
  out, lse = _online(logits, v, tile)
  want_out, want_lse = _softmax_reference(logits, v)
  np.testing.assert_allclose(out, want_out, **TOL)
  np.testing.assert_allclose(lse, want_lse, **TOL)


@pytest.mark.parametrize('h', [64, 128, 256], ids=['h64_sliced', 'h128', 'h256_tiled'])
def test_lane_replicated_statistics_give_the_same_softmax(h):
  """The Mosaic kernel's layout: statistics 128 lanes wide, key tiles of 256 (tiled to them) and
  head dims below, at and above 128 (sliced or tiled to them)."""
  logits, v = _logits_and_values(np.random.default_rng(1), b=1, g=1, t=8, s=512, h=h)
  out, lse = _online(logits, v, 256, lanes=128)
  want_out, want_lse = _softmax_reference(logits, v)
  np.testing.assert_allclose(out, want_out, **TOL)
  np.testing.assert_allclose(lse, np.broadcast_to(want_lse[..., None], lse.shape), **TOL)


def test_finalize_of_a_row_without_visible_keys_is_zeros_and_lse_inf():
  logits, v = _logits_and_values(np.random.default_rng(2))
  logits = logits.at[1, 2, 3].set(-jnp.inf)  # row 3 of batch 1, head 2 sees no key
  out, lse = _online(logits, v, 4)
  np.testing.assert_array_equal(out[1, 2, 3], np.zeros(v.shape[-1], np.float32))
  assert lse[1, 2, 3] == np.inf
  # +inf makes the backward's recomputed probabilities exact zeros on that row.
  np.testing.assert_array_equal(flash_core.probabilities(logits, lse)[1, 2, 3], np.zeros(12))
  # The other rows are unaffected.
  want_out, _ = _softmax_reference(logits, v)
  np.testing.assert_allclose(out[0], want_out[0], **TOL)


def test_ds_equals_the_gradient_of_the_softmax():
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.standard_normal((2, 5, 7)), jnp.float32)  # [B, T, S]
  v = jnp.asarray(rng.standard_normal((2, 7, 3)), jnp.float32)  # [B, S, H]
  d_out = jnp.asarray(rng.standard_normal((2, 5, 3)), jnp.float32)  # [B, T, H]
  attend = lambda x: jnp.einsum('BTS,BSH->BTH', jax.nn.softmax(x, axis=-1), v)
  want = jax.grad(lambda x: jnp.sum(attend(x) * d_out))(logits)
  lse = jax.nn.logsumexp(logits, axis=-1)
  p = flash_core.probabilities(logits, lse)
  dp = jnp.einsum('BTH,BSH->BTS', d_out, v)
  got = flash_core.ds(p, dp, flash_core.backward_delta(attend(logits), d_out))
  np.testing.assert_allclose(got, want, **TOL)


def test_tile_logits_against_explicit_arrays():
  """T = S = 4, causal with a window of one key to the left, key 3 past kv_len, and ALiBi."""
  qk = jnp.arange(16, dtype=jnp.float32).reshape(4, 4)
  pos = jnp.arange(4)
  got = flash_core.tile_logits(qk, pos[:, None], pos[None], scale=0.5, is_causal=True,
                               window=(1, 0), kv_len=3, slope=jnp.float32(0.25))
  ninf = -np.inf
  want = np.array([[0.0, ninf, ninf, ninf],
                   [2.0 - 0.25, 2.5, ninf, ninf],
                   [ninf, 4.5 - 0.25, 5.0, ninf],
                   [ninf, ninf, 7.0 - 0.25, ninf]], np.float32)  # key 3 is padding
  np.testing.assert_array_equal(got, want)


def test_tile_logits_biases_segments_and_mask_match_the_dense_definition():
  rng = np.random.default_rng(4)
  b, n, t, s = 2, 3, 6, 5
  qk = jnp.asarray(rng.standard_normal((b, n, t, s)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((1, n, t, s)), jnp.float32)
  pos_bias = jnp.asarray(rng.standard_normal((b, 1, t, s)), jnp.float32)
  mask = jnp.asarray(rng.random((b, 1, 1, s)) < 0.8)
  slopes = jnp.asarray([0.5, 0.25, 0.125], jnp.float32)
  seg = jnp.asarray([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]])
  q_pos, k_pos = jnp.arange(t)[:, None], jnp.arange(s)[None]
  got = flash_core.tile_logits(
      qk, q_pos, k_pos, scale=0.3, window=(2, 1), bias=bias, slope=slopes[:, None, None],
      position_bias=pos_bias, q_seg=seg[:, None, :, None], k_seg=seg[:, None, None, :s],
      mask=mask)
  want = qk * 0.3 + bias + masks.alibi_bias(slopes, q_pos, k_pos)[None] + pos_bias
  vis = masks.visible(q_pos, k_pos, window=(2, 1), q_seg=seg[:, :, None], k_seg=seg[:, None, :s])
  want = jnp.where(vis[:, None] & mask, want, -jnp.inf)
  np.testing.assert_allclose(got, want, **TOL)


def test_safe_max_and_pad_axis():
  np.testing.assert_array_equal(flash_core.safe_max(jnp.asarray([-jnp.inf, -1.0, 2.0])),
                                [0.0, -1.0, 2.0])
  x = jnp.ones((2, 3), jnp.int32)
  np.testing.assert_array_equal(flash_core.pad_axis(x, 1, 5, value=7),
                                [[1, 1, 1, 7, 7], [1, 1, 1, 7, 7]])
  assert flash_core.pad_axis(x, 0, 2) is x


def _dense_forward(scale, q, k, v, seg):
  """A one-tile 'kernel' for `flash_vjp`: (out, lse), seg hides keys of other segments."""
  logits = flash_core.tile_logits(q @ k.T, seg[:, None], seg[None], scale=scale, q_seg=seg[:, None],
                                  k_seg=seg[None])
  m, l, acc = flash_core.online_update(flash_core.init_carry(q.shape[:1], v.shape[-1]), logits,
                                       v)
  return flash_core.finalize((m, l, acc))


def _dense_backward(scale, args, out, lse, d_out):
  q, k, v, seg = args
  logits = flash_core.tile_logits(q @ k.T, seg[:, None], seg[None], scale=scale, q_seg=seg[:, None],
                                  k_seg=seg[None])
  p = flash_core.probabilities(logits, lse)
  ds = flash_core.ds(p, d_out @ v.T, flash_core.backward_delta(out, d_out))
  return scale * ds @ k, scale * ds.T @ q, p.T @ d_out, None


def test_flash_vjp_gradients_equal_autodiff_of_the_reference():
  rng = np.random.default_rng(5)
  q, k, v = (jnp.asarray(rng.standard_normal((6, 4)), jnp.float32) for _ in range(3))
  seg = jnp.asarray([0, 0, 1, 1, 1, 2])
  flash = flash_core.flash_vjp(_dense_forward, _dense_backward)
  w = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)

  def reference(q, k, v):
    logits = jnp.where(seg[:, None] == seg[None], 0.5 * q @ k.T, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1) @ v

  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w)
  got = jax.grad(loss(lambda q, k, v: flash(0.5, q, k, v, seg)), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(flash(0.5, q, k, v, seg), reference(q, k, v), **TOL)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, **TOL)


@pytest.mark.parametrize('is_causal,window,t,s,bq,bk', [
    (False, None, 300, 200, 64, 32),
    (True, None, 256, 256, 64, 64),
    (True, None, 200, 200, 128, 64),
    (True, (40, 0), 512, 512, 64, 64),
    (False, (30, 50), 300, 300, 32, 64),
])
def test_visited_tiles_are_the_bands_tiles_and_hold_every_visible_pair(is_causal, window, t, s,
                                                                       bq, bk):
  """The host count of the tiles a band-skipping kernel computes equals the sum of its bands
  (what the kernels iterate over), and those tiles hold every visible (query, key) pair."""
  cfg = flash_core.TileConfig(scale=1.0, is_causal=is_causal, window=window, q_len=t, kv_len=s,
                              block_q=bq, block_k=bk)
  nq, nk = -(-t // bq), -(-s // bk)
  bands = [tuple(int(x) for x in flash_core.key_block_band(i, cfg, nk)) for i in range(nq)]
  assert flash_core.visited_tiles(cfg, nq, nk) == sum(max(hi - lo, 0) for lo, hi in bands)
  visible = masks.visible(jnp.arange(t)[:, None], jnp.arange(s)[None, :], is_causal=is_causal,
                          window=window)
  visible = np.ones((t, s), bool) if visible is None else np.asarray(visible)  # None: all
  inside = np.zeros((t, s), bool)
  for i, (lo, hi) in enumerate(bands):
    inside[i * bq:(i + 1) * bq, lo * bk:hi * bk] = True
  assert not (visible & ~inside).any()
  if is_causal and window is None and nq == nk == 4:  # (4 + 1) / 2 of 4 rows: the saving
    assert flash_core.visited_tiles(cfg, nq, nk) == 10
