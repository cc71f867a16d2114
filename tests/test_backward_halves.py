"""`moe_jax.parallel.backward_halves`: a backward cut into its input-gradient half and its
weight-gradient half, against `jax.vjp` of the whole, on a stack like the model's (a layer
scan, each layer rematerialised, a `jit` head): together they give the same gradients, the
weight half runs exactly the weight GEMMs and the input half none of them. The cut of the
real pipeline stages in every layout: `tests/test_pipeline_1f1b.py` (zero-bubble)."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.parallel import backward_halves

L, D, F, T = 3, 8, 16, 5  # layers, width, hidden width, tokens


def _layer(w, x):
    h = jnp.tanh(x @ w["up"]) * w["scale"]
    return x + jax.nn.relu(h @ w["down"])


def _stage(w, x, k):
    def body(carry, wl):
        return jax.checkpoint(_layer)(wl, carry), (carry**2).sum()

    y, aux = jax.lax.scan(body, x, w["layers"])
    return jax.jit(lambda y: y @ w["head"])(y) * k, aux.sum()


def _grads(w, x, k, dy):
    """(the weights' gradients, the input's) of `_stage` for output cotangent `dy`."""
    (_y, aux), pull = jax.vjp(lambda w, x: _stage(w, x, k), w, x)
    return pull((dy, jnp.ones_like(aux)))


def _args():
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    layers = {
        "up": jax.random.normal(keys[0], (L, D, F)) / 4,
        "down": jax.random.normal(keys[1], (L, F, D)) / 4,
        "scale": jnp.linspace(0.5, 1.5, L * F).reshape(L, F),
    }
    w = {"layers": layers, "head": jax.random.normal(keys[2], (D, D))}
    x, dy = jax.random.normal(keys[3], (T, D)), jax.random.normal(keys[4], (T, D))
    return w, x, jnp.float32(1.5), dy


def primitives(fn, *args) -> collections.Counter:
    """The equations of `fn`'s program by primitive, a scan's (or call's) body once."""
    found = collections.Counter()

    def walk(jaxpr):
        for e in jaxpr.eqns:
            found[e.primitive.name] += 1
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _gemms(fn, *args) -> int:
    return primitives(fn, *args)["dot_general"]


def test_halves_give_the_whole_backward_and_split_its_gemms():
    w, x, k, dy = _args()
    input_half, weight_half = backward_halves.split(_grads, w, x, k, dy)
    dx, stash = jax.jit(input_half)(w, x, k, dy)
    dw = jax.jit(weight_half)(w, stash)
    want_dw, want_dx = _grads(w, x, k, dy)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(dw), jax.tree.leaves(want_dw), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the weight half: one GEMM per weight matrix (up, down, head), nothing recomputed;
    # the input half none of them: the forward scan's body 2, the backward's 2 recomputed
    # and 2 input gradients, the head's input gradient (the whole program also holds the
    # head's forward, whose result no gradient reads)
    assert _gemms(weight_half, w, stash) == 3
    assert _gemms(input_half, w, x, k, dy) == 2 + 2 + 2 + 1
    assert _gemms(_grads, w, x, k, dy) == 2 + 2 + 2 + 1 + 3 + 1
    # what waits for W: per layer what its GEMMs read, no weight, nothing of the head's
    # input beyond [T, D]
    sizes = sorted(a.size for a in jax.tree.leaves(stash))
    assert max(sizes) <= L * T * F and D * F not in sizes
