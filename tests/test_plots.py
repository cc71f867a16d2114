"""End-of-run pictures: the expert-load heatmap's step axis follows the logged steps,
however they are spaced, and one logged step is enough."""

from __future__ import annotations

import numpy as np

from moe_jax.plots import _edges, plot_expert_load


def test_step_edges_lie_halfway_between_logged_steps():
    np.testing.assert_allclose(_edges([1, 2, 10, 50]), [0.5, 1.5, 6, 30, 70])
    np.testing.assert_allclose(_edges([7]), [6.5, 7.5])


def _rows(steps):
    rng = np.random.default_rng(0)
    load = rng.dirichlet(np.ones(4), size=(len(steps), 2))
    return [{"step": s, "expert_load": load[i].tolist()} for i, s in enumerate(steps)]


def test_expert_load_is_drawn_for_any_number_of_logged_steps(tmp_path):
    for steps in ([5], [1, 2, 10, 50]):
        path = tmp_path / f"load{len(steps)}.png"
        plot_expert_load(_rows(steps), path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
