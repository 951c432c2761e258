"""Blockwise (FlashAttention) attention: equal to plain attention in value and gradient
(float64), its memory stays below the T x T footprint, and the GPT trains the same with it."""

import numpy as np
import pytest

from minidist.model import ops
from minidist.model.autograd import Tensor
from minidist.layout.model import ModelConfig
from minidist.model.nn import GPT
from minidist.model.ops import blockwise
from minidist.train.testing import traced_peak_bytes

RNG = np.random.default_rng(1)


def _run(fn, x0, g):
    x = Tensor(x0.copy(), requires_grad=True)
    y = fn(x)
    y.backward(g)
    return y.data, x.grad


@pytest.mark.parametrize("T,block", [(1, 1), (1, 4), (7, 1), (7, 2), (7, 3), (7, 7), (7, 64), (16, 4), (16, 5)])
@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_self_attention_equals_plain(T, block, causal):
    x0 = RNG.standard_normal((2, T, 24))
    g = RNG.standard_normal((2, T, 8))
    y_ref, dx_ref = _run(lambda x: ops.self_attention(x, 4, causal=causal), x0, g)
    y, dx = _run(lambda x: ops.blockwise_self_attention(x, 4, causal=causal, block=block), x0, g)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-11, atol=1e-13)


def test_blockwise_attention_cross_lengths_and_scale():
    """q and k of different lengths (top-left causal alignment, as plain attention) and a scale."""
    q, k, v = (RNG.standard_normal(s) for s in [(2, 3, 5, 4), (2, 3, 9, 4), (2, 3, 9, 4)])
    g = RNG.standard_normal((2, 3, 5, 4))
    for causal in (True, False):
        outs = []
        for fn in (lambda a, b, c: ops.attention(a, b, c, causal=causal, scale=0.7),
                   lambda a, b, c: ops.blockwise_attention(a, b, c, block=2, causal=causal, scale=0.7)):
            ts = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v)]
            y = fn(*ts)
            y.backward(g)
            outs.append([y.data] + [t.grad for t in ts])
        for a, b in zip(*outs):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)


def test_tiles_above_the_diagonal_are_skipped():
    """Causal T=16 in blocks of 4: 10 of the 16 tiles are computed (the lower triangle and
    the diagonal), so the work is 160 scores, not 256."""
    qs = RNG.standard_normal((1, 16, 2))
    state = blockwise.new_state((1,), 16, 2, qs.dtype)
    assert blockwise.forward_tiles(qs, qs, qs, 0, 0, state, 4, causal=True) == 10 * 16
    state = blockwise.new_state((1,), 16, 2, qs.dtype)
    assert blockwise.forward_tiles(qs, qs, qs, 0, 0, state, 4, causal=False) == 256
    # positions: queries 8..15 against keys 0..7 see every key; keys 8..15 against queries 0..7: none
    assert blockwise.tile_mask(8, 16, 0, 8, True, qs.dtype) is None
    assert blockwise.tile_mask(0, 8, 8, 16, True, qs.dtype) is blockwise.SKIP




def test_blockwise_peak_memory_below_the_t_by_t_footprint():
    """Traced bytes of one forward + backward of the attention op: plain holds at least the
    B*H*T*T probabilities, blockwise (block 32) stays under a quarter of that."""
    B, T, H, D = 1, 512, 2, 8
    x0 = RNG.standard_normal((B, T, 3 * H * D))
    g = RNG.standard_normal((B, T, H * D))
    footprint = B * H * T * T * 8

    def step(fn):
        return lambda: _run(fn, x0, g)

    plain = traced_peak_bytes(step(lambda x: ops.self_attention(x, H)))
    flash = traced_peak_bytes(step(lambda x: ops.blockwise_self_attention(x, H, block=32)))
    assert plain >= footprint, (plain, footprint)
    assert flash < 0.25 * footprint, (flash, footprint)


def test_gpt_with_blockwise_attention_equals_plain():
    """Loss and every parameter gradient of a small GPT, float64, block not dividing T."""
    ids = RNG.integers(0, 256, size=(2, 11))
    targets = RNG.integers(0, 256, size=(2, 11))
    grads = {}
    for name in ("plain", "blockwise"):
        model = GPT(ModelConfig(block_size=16, layers=2, heads=2, d_model=16, dtype="float64", seed=3,
                                attention=name, attention_block=4))
        loss = model(ids, targets)
        loss.backward()
        grads[name] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
    assert grads["plain"][0] == pytest.approx(grads["blockwise"][0], rel=1e-13)
    for n, g in grads["plain"][1].items():
        np.testing.assert_allclose(grads["blockwise"][1][n], g, rtol=1e-10, atol=1e-14, err_msg=n)


def test_bad_block_and_attention_names():
    x = Tensor(RNG.standard_normal((1, 4, 6)))
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match="block size must be a positive integer"):
            ops.blockwise_self_attention(x, 1, block=bad)
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        GPT(ModelConfig(attention="flash", block_size=8))
    with pytest.raises(ValueError, match="block size must be a positive integer, got 0"):
        GPT(ModelConfig(attention="blockwise", attention_block=0, block_size=8))
