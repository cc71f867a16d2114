"""A backward pass cut into its input-gradient half and its weight-gradient half.

Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism") run a
stage's backward as two items: B, the gradient of the stage's input, which the stage
before waits for, and W, the gradients of its weights, which nothing waits for and which
can fill ticks the stage would idle. JAX differentiates a function whole, so the cut is
made on its program: `split` traces `fn` (its outputs: the weights' gradients, then the
rest), keeps in the input half every equation the rest needs and in the weight half the
others the weights' gradients need, and passes from the first to the second, as a tree
of arrays (the stash), the values the weight half reads: mostly each weight GEMM's input
and output gradient. No block is written for it. The cut reaches into scans (a layer
scan becomes two: the first also emits, per layer, what the second reads), `jit` calls
and rematerialised regions; any other equation both halves need runs whole in the
input half, so the halves hold every layout's collectives and kernels as they are.

The weight half is given the weights again (they do not change within a step) and
reads nothing else of its caller: what it needs of the traced function's other inputs
and closed-over values travels in the stash.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax._src import source_info_util  # as `jax.core.eval_jaxpr`: keeps named scopes
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var

CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"})


def split(fn: Callable, weights, *rest) -> tuple[Callable, Callable]:
    """(input_half, weight_half) of `fn(weights, *rest) -> (weight_grads, other)`:
    `input_half(weights, *rest) -> (other, stash)` and `weight_half(weights, stash) ->
    weight_grads`, together `fn`'s results. Traced once here at these arguments' types."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(weights, *rest)
    w_shape, b_shape = shape
    n_w, n_b = len(jax.tree.leaves(w_shape)), len(jax.tree.leaves(b_shape))
    n_p = len(jax.tree.leaves(weights))
    jaxpr = closed.jaxpr
    readable = [False] * len(jaxpr.constvars) + [True] * n_p
    readable += [False] * (len(jaxpr.invars) - n_p)
    half = _analyse(jaxpr, [False] * n_w + [True] * n_b, [True] * n_w + [False] * n_b, readable)
    consts = list(closed.consts)

    def input_half(weights, *rest):
        args = consts + jax.tree.leaves((weights, rest))
        outs, stash = _input_half(half, args)
        return jax.tree.unflatten(jax.tree.structure(b_shape), outs[n_w:]), stash

    def weight_half(weights, stash):
        args = [None] * len(consts) + jax.tree.leaves(weights)
        args += [None] * (len(jaxpr.invars) - n_p)
        outs = _weight_half(half, args, stash)
        return jax.tree.unflatten(jax.tree.structure(w_shape), outs[:n_w])

    return input_half, weight_half


@dataclasses.dataclass
class _Half:
    """How one jaxpr (a level: the function, or the body of a call or scan in it) is cut."""

    jaxpr: Jaxpr
    consts: list
    b_out: list[bool]  # outputs the input half gives
    w_out: list[bool]  # outputs the weight half gives
    kinds: list[str | None]  # per equation: "B", "W", "S" (cut in two) or None (dead)
    subs: dict[int, _Half]  # the cut of each "S" equation's body
    stash: list[Var]  # this level's values the weight half reads from the input half
    reads: list[bool]  # inputs (constvars, then invars) the weight half reads directly
    carry_b: list[bool] | None = None  # a scan's carries the input half runs
    carry_w: list[bool] | None = None  # and those the weight half runs


def _analyse(jaxpr: Jaxpr, b_out, w_out, readable, consts=()) -> _Half:
    """The cut of `jaxpr`: its `b_out` outputs by the input half, its `w_out` ones by the
    weight half, which may read the inputs (constvars, invars) marked `readable`."""
    per_b, _ = _live(jaxpr, b_out)
    need = {v for v, u in zip(jaxpr.outvars, w_out, strict=True) if u and isinstance(v, Var)}
    eqns = jaxpr.eqns
    kinds: list[str | None] = [None] * len(eqns)
    subs: dict[int, _Half] = {}
    from_b: list[Var] = []
    for i in reversed(range(len(eqns))):
        e = eqns[i]
        w_used = [isinstance(o, Var) and o in need for o in e.outvars]
        b_used = per_b.get(i)
        if b_used is None:
            if any(w_used):
                kinds[i] = "W"
                need.update(_vars(e.invars))
            continue
        if _kind(e) == "other":
            kinds[i] = "B"
            from_b += [o for o, w in zip(e.outvars, w_used, strict=True) if w]
            continue
        kinds[i] = "S"
        only_w = [w and not b for w, b in zip(w_used, b_used, strict=True)]
        sub = subs[i] = _analyse_eqn(e, b_used, only_w)
        need.update(_vars(v for v, r in zip(e.invars, _outer_reads(e, sub), strict=True) if r))
        # what the input half gives (a scan's carries it runs too), the weight half reads
        from_b += [o for o, w, b in zip(e.outvars, w_used, sub.b_out, strict=True) if w and b]
    inputs = [*jaxpr.constvars, *jaxpr.invars]
    stash = [v for v, r in zip(inputs, readable, strict=True) if v in need and not r]
    stash += [v for v in _defined_in_order(eqns) if v in set(from_b)]
    reads = [v in need and r for v, r in zip(inputs, readable, strict=True)]
    return _Half(jaxpr, list(consts), b_out, w_out, kinds, subs, stash, reads)


def _analyse_eqn(e: JaxprEqn, b_used, only_w) -> _Half:
    body, consts = _body(e)
    if _kind(e) == "call":
        readable = [True] * (len(body.constvars) + len(body.invars))
        return _analyse(body, b_used, only_w, readable, consts)
    n_c, n_k = _scan_counts(e)
    carry_b, _ = _scan_live(e, b_used)
    carry_w = [w and not b for w, b in zip(only_w[:n_k], carry_b, strict=True)]
    while True:  # a carry the weight half reads that the input half does not run: its own
        readable = [True] * (len(body.constvars) + n_c) + carry_w
        readable += [True] * (len(body.invars) - n_c - n_k)
        b_body = carry_b + list(b_used[n_k:])
        w_body = carry_w + list(only_w[n_k:])
        sub = _analyse(body, b_body, w_body, readable, consts)
        stashed = set(sub.stash)
        wanted = [v in stashed for v in body.invars]
        grown = [
            w or (n and not b)
            for w, n, b in zip(carry_w, wanted[n_c : n_c + n_k], carry_b, strict=True)
        ]
        if grown == carry_w:
            sub.carry_b, sub.carry_w = carry_b, carry_w
            return sub
        carry_w = grown


def _outer_reads(e: JaxprEqn, sub: _Half) -> list[bool]:
    """The operands of a cut equation its weight half reads."""
    body, _ = _body(e)
    reads = sub.reads[len(body.constvars) :]
    if _kind(e) == "call":
        return reads
    n_c, n_k = _scan_counts(e)
    return [*reads[:n_c], *sub.carry_w, *reads[n_c + n_k :]]


def _live(jaxpr: Jaxpr, used_out) -> tuple[dict[int, list[bool]], list[bool]]:
    """(each live equation's used outputs, the invars used) for the outputs `used_out`."""
    live = {v for v, u in zip(jaxpr.outvars, used_out, strict=True) if u and isinstance(v, Var)}
    per: dict[int, list[bool]] = {}
    for i in reversed(range(len(jaxpr.eqns))):
        e = jaxpr.eqns[i]
        used = [isinstance(o, Var) and o in live for o in e.outvars]
        if not any(used) and not e.effects:
            continue
        per[i] = used
        live.update(_vars(v for v, u in zip(e.invars, _inputs(e, used), strict=True) if u))
    return per, [v in live for v in jaxpr.invars]


def _inputs(e: JaxprEqn, used) -> list[bool]:
    """The operands equation `e` needs for its outputs `used` (all, unless a call or scan)."""
    kind = _kind(e)
    if kind == "call":
        return _live(_body(e)[0], used)[1]
    if kind == "scan":
        return _scan_live(e, used)[1]
    return [isinstance(v, Var) for v in e.invars]


def _scan_live(e: JaxprEqn, used) -> tuple[list[bool], list[bool]]:
    """(the carries a scan runs for its outputs `used`, the operands it needs)."""
    body, _ = _body(e)
    n_c, n_k = _scan_counts(e)
    carry, ys = list(used[:n_k]), list(used[n_k:])
    while True:
        _, ins = _live(body, carry + ys)
        grown = [c or i for c, i in zip(carry, ins[n_c : n_c + n_k], strict=True)]
        if grown == carry:
            return carry, [*ins[:n_c], *carry, *ins[n_c + n_k :]]
        carry = grown


# --- running the halves -------------------------------------------------------------


def _input_half(h: _Half, args: list) -> tuple[list, Any]:
    """(the outputs `h.b_out` marks, None elsewhere; the stash) from `args` (constvars
    then invars; None where the input half needs none)."""
    env: dict[Var, Any] = {}
    inputs = [*h.jaxpr.constvars, *h.jaxpr.invars]
    env.update((v, a) for v, a in zip(inputs, [*h.consts, *args], strict=True) if a is not None)
    subs = []
    for i, e in enumerate(h.jaxpr.eqns):
        if h.kinds[i] == "B":
            _write(env, e.outvars, _bind(e, [_read(env, v) for v in e.invars]))
        elif h.kinds[i] == "S":
            operands = [_read(env, v, None) for v in e.invars]
            outs, stash = _run_cut(e, h.subs[i], operands)
            _write(env, e.outvars, outs)
            subs.append(stash)
    outs = [_read(env, v) if b else None for v, b in zip(h.jaxpr.outvars, h.b_out, strict=True)]
    return outs, ([env[v] for v in h.stash], subs)


def _weight_half(h: _Half, args: list, stash) -> list:
    """The outputs `h.w_out` marks (None elsewhere) from the inputs it reads and `stash`."""
    level, subs = stash
    env: dict[Var, Any] = dict(zip(h.stash, level, strict=True))
    inputs = [*h.jaxpr.constvars, *h.jaxpr.invars]
    env.update((v, a) for v, a, r in zip(inputs, [*h.consts, *args], h.reads, strict=True) if r)
    cut = iter(subs)
    for i, e in enumerate(h.jaxpr.eqns):
        if h.kinds[i] == "W":
            _write(env, e.outvars, _bind(e, [_read(env, v) for v in e.invars]))
        elif h.kinds[i] == "S":
            sub, sub_stash = h.subs[i], next(cut)
            if any(sub.w_out):
                operands = [_read(env, v, None) for v in e.invars]
                outs, _ = _run_cut(e, sub, operands, sub_stash)
                _write(env, e.outvars, outs)
    return [_read(env, v) if w else None for v, w in zip(h.jaxpr.outvars, h.w_out, strict=True)]


def _run_cut(e: JaxprEqn, sub: _Half, operands: list, stash=None) -> tuple[list, Any]:
    """The input half of a cut equation (`stash` None: its outputs and stash) or its
    weight half (from `stash`: its outputs, None): a call's body inline; a scan as a
    scan of the half over the carries it runs, the input half's stash stacked per
    iteration and read back per iteration by the weight half."""
    weight = stash is not None
    if _kind(e) == "call":
        return (_weight_half(sub, operands, stash), None) if weight else _input_half(sub, operands)
    n_c, n_k = _scan_counts(e)
    carried = sub.carry_w if weight else sub.carry_b
    ys_out = (sub.w_out if weight else sub.b_out)[n_k:]
    consts, init, xs = operands[:n_c], operands[n_c : n_c + n_k], operands[n_c + n_k :]

    def body(carry, x):
        xs_now, stash_now = x
        it = iter(carry)
        full = [*consts, *(next(it) if c else None for c in carried), *xs_now]
        if weight:
            outs, stash_now = _weight_half(sub, full, stash_now), None
        else:
            outs, stash_now = _input_half(sub, full)
        new = [o for o, c in zip(outs[:n_k], carried, strict=True) if c]
        ys = [o for o, y in zip(outs[n_k:], ys_out, strict=True) if y]
        return new, (ys, stash_now)

    init = [a for a, c in zip(init, carried, strict=True) if c]
    last, (ys, stacked) = jax.lax.scan(
        body,
        init,
        (xs, stash),
        length=e.params["length"],
        reverse=e.params["reverse"],
        unroll=e.params["unroll"],
    )
    outs: list = [None] * len(e.outvars)
    slots = [k for k, c in enumerate(carried) if c] + [n_k + j for j, y in enumerate(ys_out) if y]
    for k, value in zip(slots, [*last, *ys], strict=True):
        outs[k] = value
    return outs, stacked


# --- jaxpr helpers ------------------------------------------------------------------


def _kind(e: JaxprEqn) -> str:
    name = e.primitive.name
    return "scan" if name == "scan" else "call" if name in CALLS else "other"


def _body(e: JaxprEqn) -> tuple[Jaxpr, list]:
    j = e.params["jaxpr"] if "jaxpr" in e.params else e.params["call_jaxpr"]
    return (j.jaxpr, list(j.consts)) if hasattr(j, "consts") else (j, [])


def _scan_counts(e: JaxprEqn) -> tuple[int, int]:
    """(constants, carries) of a scan (jax 0.11 names them; later ones keep a flat tree)."""
    if "num_consts" in e.params:
        return e.params["num_consts"], e.params["num_carry"]
    consts, carry, _ = e.params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


def _vars(atoms) -> list[Var]:
    return [v for v in atoms if isinstance(v, Var)]


def _defined_in_order(eqns) -> list[Var]:
    return [o for e in eqns for o in e.outvars if isinstance(o, Var)]


def _read(env, v, default=...):
    if isinstance(v, Literal):
        return v.val
    return env[v] if default is ... else env.get(v, default)


def _write(env, outvars, values) -> None:
    for v, x in zip(outvars, values, strict=True):
        if x is not None and isinstance(v, Var):
            env[v] = x


def _bind(e: JaxprEqn, invals: list) -> list:
    """`e` applied to `invals`, under its source's names (as `jax.core.eval_jaxpr`)."""
    params = e.primitive.get_bind_params(e.params)  # jax 0.11: (subfuns, params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    names = source_info_util.current_name_stack() + e.source_info.name_stack
    with source_info_util.user_context(e.source_info.traceback, name_stack=names), e.ctx.manager:
        out = e.primitive.bind(*subfuns, *invals, **params)
    return out if e.primitive.multiple_results else [out]
