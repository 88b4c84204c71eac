"""Tests for models/layers.py's weight_einsum: autodiff's values, and XLA:CPU's layout."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers import weight_einsum

# (equation, x shape, weight shape): every projection form the models use.
EQUATIONS = [
    ("btd,df->btf", (2, 7, 6), (6, 10)),  # MLP gate / up, ViT fc1
    ("btf,fd->btd", (2, 7, 10), (10, 6)),  # MLP down
    ("btd,dhk->bthk", (2, 7, 6), (6, 3, 4)),  # q / k / v
    ("bthk,hkd->btd", (2, 7, 3, 4), (3, 4, 6)),  # o
    ("...i,io->...o", (3, 5), (5, 4)),  # connector
    ("...d,dv->...v", (2, 3, 6), (6, 11)),  # lm_head
]


@pytest.mark.parametrize("equation, x_shape, w_shape", EQUATIONS, ids=[e[0] for e in EQUATIONS])
def test_values_and_gradients_are_autodiffs(equation, x_shape, w_shape):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=w_shape), jnp.float32)
    out_shape = jnp.einsum(equation, x, w).shape
    cotangent = jnp.asarray(rng.normal(size=out_shape), jnp.float32)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(equation, x, w) * cotangent)

    got = jax.value_and_grad(loss(weight_einsum), argnums=(0, 1))(x, w)
    want = jax.value_and_grad(loss(jnp.einsum), argnums=(0, 1))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    # Gradients keep their operands' dtypes (a bf16 weight copy gets a bf16 gradient).
    grads = jax.grad(loss(weight_einsum), argnums=(0, 1))(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    )
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's layout choice")
def test_weight_gradient_transposes_no_output_gradient():
    """The MLP's weight gradient on XLA:CPU: autodiff's einsum copies the [tokens, features]
    output gradient into a [features, tokens] buffer; weight_einsum's backward must not (it
    may transpose the narrower input instead)."""
    tokens, d_in, features = 48, 32, 80
    x = jnp.ones((1, tokens, d_in))
    w = jnp.ones((d_in, features))
    c = jnp.ones((1, tokens, features))

    def compiled_grad(fn):
        def loss(x, w):
            return jnp.sum(jax.nn.silu(fn("btd,df->btf", x, w)) * c)

        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()

    transposed = re.compile(rf"= f32\[{features},{tokens}\]\{{1,0\}} fusion")
    assert transposed.search(compiled_grad(jnp.einsum)), "the layout this test guards is gone"
    assert not transposed.search(compiled_grad(weight_einsum))
