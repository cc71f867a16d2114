"""Router losses against hand-computed values on a tiny fixed routing.

Example: T=4 tokens (2 sequences of 2 tokens), E=3 experts, k=2 choices.
The expected numbers below are worked out by hand from the formulas in
`moe_jax/moe/losses.py`, not by calling the library.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.moe.losses import load_balancing_loss, router_z_loss, sequence_balancing_loss
from moe_jax.moe.routing import Routing

E = 3
PROBS = np.array(
    [
        [0.5, 0.3, 0.2],
        [0.1, 0.6, 0.3],
        [0.2, 0.2, 0.6],
        [0.4, 0.4, 0.2],
    ],
    np.float32,
)
INDEX_K2 = np.array([[0, 1], [1, 2], [2, 0], [0, 1]], np.int32)
INDEX_K1 = np.array([[0], [1], [1], [2]], np.int32)
# logits = log(probs) + c_t, so softmax(logits) == probs and logsumexp(logits)_t == c_t.
SHIFT = np.array([0.0, 1.0, -2.0, 3.0], np.float32)
LOGITS = np.log(PROBS) + SHIFT[:, None]


def _routing(index, probs=PROBS, logits=LOGITS) -> Routing:
    index = jnp.asarray(index, jnp.int32)
    k = index.shape[-1]
    return Routing(
        expert_index=index,
        weights=jnp.full(index.shape, 1.0 / k, jnp.float32),
        keep=jnp.ones(index.shape, bool),
        logits=jnp.asarray(logits, jnp.float32),
        probs=jnp.asarray(probs, jnp.float32),
    )


def test_load_balancing_loss_by_hand_k2():
    """aux = E * sum_i f_i P_i with f counted over T*k assignments."""
    # Assignments per expert: e0 <- tokens 0,2,3; e1 <- tokens 0,1,3; e2 <- tokens 1,2.
    f = [3 / 8, 3 / 8, 2 / 8]
    # Mean probability per expert (column means of PROBS).
    p = [(0.5 + 0.1 + 0.2 + 0.4) / 4, (0.3 + 0.6 + 0.2 + 0.4) / 4, (0.2 + 0.3 + 0.6 + 0.2) / 4]
    assert p == pytest.approx([0.3, 0.375, 0.325])
    expected = 3 * (f[0] * p[0] + f[1] * p[1] + f[2] * p[2])
    assert expected == pytest.approx(1.003125)
    got = float(load_balancing_loss(_routing(INDEX_K2)))
    assert got == pytest.approx(expected, rel=1e-6)


def test_load_balancing_loss_by_hand_k1():
    """With k=1 the fraction is simply the share of tokens per expert."""
    f = [1 / 4, 2 / 4, 1 / 4]
    p = [0.3, 0.375, 0.325]
    expected = 3 * (f[0] * p[0] + f[1] * p[1] + f[2] * p[2])
    assert expected == pytest.approx(1.03125)
    got = float(load_balancing_loss(_routing(INDEX_K1)))
    assert got == pytest.approx(expected, rel=1e-6)


def test_sequence_balancing_loss_by_hand():
    """seq_aux balances each sequence on its own, then averages over sequences."""
    # Sequence 0 = tokens 0,1: assignments e0:1, e1:2, e2:1 of 4.
    f0 = [1 / 4, 2 / 4, 1 / 4]
    p0 = [(0.5 + 0.1) / 2, (0.3 + 0.6) / 2, (0.2 + 0.3) / 2]  # 0.3, 0.45, 0.25
    aux0 = 3 * (f0[0] * p0[0] + f0[1] * p0[1] + f0[2] * p0[2])  # 3 * 0.3625 = 1.0875
    # Sequence 1 = tokens 2,3: assignments e0:2, e1:1, e2:1 of 4.
    f1 = [2 / 4, 1 / 4, 1 / 4]
    p1 = [(0.2 + 0.4) / 2, (0.2 + 0.4) / 2, (0.6 + 0.2) / 2]  # 0.3, 0.3, 0.4
    aux1 = 3 * (f1[0] * p1[0] + f1[1] * p1[1] + f1[2] * p1[2])  # 3 * 0.325 = 0.975
    expected = (aux0 + aux1) / 2
    assert (aux0, aux1, expected) == pytest.approx((1.0875, 0.975, 1.03125))
    got = float(sequence_balancing_loss(_routing(INDEX_K2), batch_size=2))
    assert got == pytest.approx(expected, rel=1e-6)
    # One sequence of all four tokens is the batch-level loss.
    one = float(sequence_balancing_loss(_routing(INDEX_K2), batch_size=1))
    assert one == pytest.approx(1.003125, rel=1e-6)


def test_router_z_loss_by_hand():
    """z = mean_t logsumexp(logits_t)^2; here logsumexp_t is the shift c_t by construction."""
    expected = (0.0**2 + 1.0**2 + (-2.0) ** 2 + 3.0**2) / 4  # = 3.5
    got = float(router_z_loss(_routing(INDEX_K2)))
    assert got == pytest.approx(expected, rel=1e-5)


def test_router_z_loss_by_hand_plain_logits():
    """Same formula on arbitrary logits, with logsumexp written out in numpy."""
    logits = np.array([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [-1.0, 0.5, 0.0], [4.0, 0.0, -4.0]])
    lse = [
        np.log(3.0),
        np.log(np.e**1 + np.e**2 + np.e**3),
        np.log(np.exp(-1.0) + np.exp(0.5) + np.exp(0.0)),
        np.log(np.exp(4.0) + 1.0 + np.exp(-4.0)),
    ]
    expected = (lse[0] ** 2 + lse[1] ** 2 + lse[2] ** 2 + lse[3] ** 2) / 4
    got = float(router_z_loss(_routing(INDEX_K2, logits=logits)))
    assert got == pytest.approx(expected, rel=1e-5)


def test_balanced_routing_gives_exactly_one():
    """Uniform assignments and uniform probabilities give aux == 1.0 exactly."""
    index = np.array([[0, 1], [2, 3], [1, 0], [3, 2]], np.int32)  # each of 4 experts twice
    probs = np.full((4, 4), 0.25, np.float32)
    routing = _routing(index, probs=probs, logits=np.zeros((4, 4), np.float32))
    assert float(load_balancing_loss(routing)) == 1.0
    assert float(sequence_balancing_loss(routing, batch_size=2)) == 1.0


def test_uniform_assignment_gives_one_whatever_the_probs():
    """With f_i = 1/E, aux = sum_i P_i = 1 for any normalised probabilities."""
    index = np.array([[0, 1], [2, 0], [1, 2]], np.int32)  # each of 3 experts twice
    routing = _routing(index, probs=PROBS[:3], logits=LOGITS[:3])
    assert float(load_balancing_loss(routing)) == pytest.approx(1.0, abs=1e-6)


def test_balancing_gradient_flows_only_through_probs():
    """d aux / d probs[t, i] = E * f_i / T; logits and weights get no gradient."""
    index = jnp.asarray(INDEX_K2)

    def loss(probs, logits, weights):
        routing = Routing(index, weights, jnp.ones(index.shape, bool), logits, probs)
        return load_balancing_loss(routing)

    weights = jnp.full(index.shape, 0.5, jnp.float32)
    g_probs, g_logits, g_weights = jax.grad(loss, argnums=(0, 1, 2))(
        jnp.asarray(PROBS), jnp.asarray(LOGITS), weights
    )
    f = np.array([3 / 8, 3 / 8, 2 / 8])
    per_token = 3 * f / 4  # [9/32, 9/32, 6/32]
    np.testing.assert_allclose(per_token, [9 / 32, 9 / 32, 6 / 32])
    np.testing.assert_allclose(np.asarray(g_probs), np.tile(per_token, (4, 1)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(g_logits), 0.0)
    np.testing.assert_array_equal(np.asarray(g_weights), 0.0)


def test_sequence_balancing_gradient():
    """d seq_aux / d probs[t, i] = E * f_{s(t), i} / T_s / num_sequences."""
    index = jnp.asarray(INDEX_K2)

    def loss(probs):
        routing = Routing(
            index, jnp.ones(index.shape), jnp.ones(index.shape, bool), jnp.asarray(LOGITS), probs
        )
        return sequence_balancing_loss(routing, batch_size=2)

    g = np.asarray(jax.grad(loss)(jnp.asarray(PROBS)))
    seq0 = 3 * np.array([1 / 4, 2 / 4, 1 / 4]) / 2 / 2
    seq1 = 3 * np.array([2 / 4, 1 / 4, 1 / 4]) / 2 / 2
    np.testing.assert_allclose(g, np.stack([seq0, seq0, seq1, seq1]), rtol=1e-6)


def test_z_loss_gradient_by_hand():
    """d z / d logits[t, j] = 2 * lse_t * softmax(logits_t)_j / T."""
    routing_fn = lambda logits: router_z_loss(
        Routing(
            jnp.asarray(INDEX_K2),
            jnp.ones((4, 2)),
            jnp.ones((4, 2), bool),
            logits,
            jnp.asarray(PROBS),
        )
    )
    g = np.asarray(jax.grad(routing_fn)(jnp.asarray(LOGITS)))
    # softmax(LOGITS) == PROBS and lse == SHIFT by construction.
    expected = 2 * SHIFT[:, None] * PROBS / 4
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)


def _random_routing(seed: int, tokens: int, experts: int, k: int) -> Routing:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(tokens, experts)).astype(np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    index = np.argsort(-probs, axis=-1)[:, :k]
    return _routing(index, probs, logits)


def test_sharded_statistics_combine_into_the_whole_batch_in_one_all_reduce_per_dtype():
    """8 devices as (batch 2, seq 2, copy 2): each shard's statistics, combined, equal
    those of the whole batch (4 sequences of 8 tokens) computed on one device, and the
    combine lowers to one all-reduce per dtype (float statistics, integer load)."""
    from jax.sharding import PartitionSpec as P

    from moe_jax.moe.losses import router_stats

    batch, seq, experts, k = 4, 8, 5, 2
    routing = _random_routing(0, batch * seq, experts, k)
    whole = router_stats(routing, batch)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("b", "s", "c"))
    split = lambda a: a.reshape(batch, seq, *a.shape[1:])  # [B, S, ...] for the shards
    spec = P("b", "s")

    def shard(index, probs, logits):
        # each copy computed on its own device, as a dispatcher's copies are
        flat = lambda a: jax.lax.pcast(a.reshape(-1, *a.shape[2:]), "c", to="varying")
        local = _routing(flat(index), flat(probs), flat(logits))
        return router_stats(local, index.shape[0]).combine(("b",), ("s",), ("c",))

    combined = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=spec, out_specs=P()))
    args = (split(routing.expert_index), split(routing.probs), split(routing.logits))
    got = combined(*args)
    for name in ("fraction", "mean_prob", "seq_fraction", "seq_prob", "z_loss", "load"):
        np.testing.assert_allclose(getattr(got, name), getattr(whole, name), rtol=1e-6)
    hlo = combined.lower(*args).compile().as_text()
    assert len(re.findall(r" all-reduce\(", hlo)) == 2, hlo
