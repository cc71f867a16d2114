"""The dtype each collective is sent in, read from the program before XLA optimises it.

Why: XLA:CPU widens bf16 collectives to f32 and f8 ones to f16 when it compiles
(the CPU backend has neither), so a compiled CPU program overstates what a GPU sends;
XLA:GPU moves bf16 as bf16 and f8 (or its uint8 bitcast) as raw bytes. The lowered
StableHLO keeps the dtypes the program asked for. A compiled collective is matched to
the lowered ones of its kind and buffer size (in elements); where its compiled dtype
is a widened float and the lowered program holds exactly one narrower dtype for that
kind and size, and not the compiled one, it is reported in the narrower dtype. Printed
with debug_info=True, the lowered program also names each op's scope path, and a
compiled collective is then matched only to the lowered ones its op_name ends with (a
bf16 gradient all-to-all beside a float32 token all-to-all of the same size).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from moe_jax.tools.hlo_collectives import DTYPE_BYTES, Collective

_OP = re.compile(
    r'"stablehlo\.(?P<kind>all_to_all|all_gather|reduce_scatter|all_reduce|collective_permute)"'
)
_SIGNATURE = re.compile(r":\s*\((?P<ins>[^()]*)\)\s*->\s*(?P<outs>.*)$")
_TENSOR = re.compile(r"tensor<(?P<dims>(?:\d+x)*)(?P<dtype>[a-zA-Z0-9]+)>")
# StableHLO element types -> HLO's names.
_DTYPES = {
    "bf16": "bf16",
    "f16": "f16",
    "f32": "f32",
    "f64": "f64",
    "ui8": "u8",
    "i8": "s8",
    "ui32": "u32",
    "i32": "s32",
    "i64": "s64",
    "i1": "pred",
    "f8E4M3FN": "f8e4m3fn",
    "f8E5M2": "f8e5m2",
}
# Compiled dtype -> the narrower ones XLA:CPU widens into it.
WIDENED = {"f32": ("bf16",), "f16": ("f8e4m3fn", "f8e5m2", "u8")}


_LOC_USE = re.compile(r"loc\((#loc\d+)\)\s*$")
_LOC_DEF = re.compile(r'^(#loc\d+) = loc\("(?P<name>[^"]*)"')


def _locations(lines: list[str]) -> dict[str, str]:
    """#locN -> its name (the op's named-scope path), from a program printed with
    debug_info=True; empty without it."""
    return {m[1]: m["name"] for m in map(_LOC_DEF.match, lines) if m}


def lowered_collectives(text: str) -> dict[tuple[str, int], collections.Counter]:
    """(kind as HLO names it, elements of the buffer S) -> dtypes of the lowered
    collectives of that kind and size (S: the result for all-gather, else the operand),
    each dtype counted under its scope path too when the text has debug info:
    key (kind, S, path)."""
    lines = text.splitlines()
    names = _locations(lines)
    found: dict[tuple, collections.Counter] = {}
    for start, line in enumerate(lines):
        op = _OP.search(line)
        if op is None:
            continue
        window = lines[start : start + 200]
        end = next((i for i, m in enumerate(map(_SIGNATURE.search, window)) if m), None)
        if end is None:
            continue
        signature = _SIGNATURE.search(window[end])
        use = _LOC_USE.search(window[end])
        name = names.get(use[1], "") if use else ""
        kind = op["kind"].replace("_", "-")
        side = signature["outs"] if kind == "all-gather" else signature["ins"]
        for tensor in _TENSOR.finditer(side):
            dims = [int(d) for d in tensor["dims"].split("x") if d]
            dtype = _DTYPES.get(tensor["dtype"], tensor["dtype"])
            found.setdefault((kind, math.prod(dims)), collections.Counter())[dtype] += 1
            if name:
                found.setdefault((kind, math.prod(dims), name), collections.Counter())[dtype] += 1
    return found


def _candidates(lowered: dict, c: Collective, elements: int) -> collections.Counter:
    """The lowered dtypes `c` may have been: those of its kind and size, narrowed to the
    ones under the scope path its compiled op_name ends with, where the text says."""
    scoped = collections.Counter()
    for key, dtypes in lowered.items():
        if len(key) == 3 and key[:2] == (c.kind, elements) and c.op_name.endswith(key[2]):
            scoped.update(dtypes)
    return scoped or lowered.get((c.kind, elements), collections.Counter())


def as_sent(collectives: list[Collective], lowered_text: str) -> list[Collective]:
    """`collectives` (parsed from a compiled program) in the dtypes the lowered program
    sends them in, bytes scaled to match (see the module docstring)."""
    lowered = lowered_collectives(lowered_text)
    result = []
    for c in collectives:
        narrower = WIDENED.get(c.dtype, ())
        width = DTYPE_BYTES.get(c.dtype, 1)
        candidates = _candidates(lowered, c, c.size // width)
        options = [d for d in narrower if candidates[d]]
        if narrower and c.size and not candidates[c.dtype] and len(options) == 1:
            sent = DTYPE_BYTES.get(options[0], 1)
            c = dataclasses.replace(
                c,
                dtype=options[0],
                bytes=c.bytes * sent // width,
                size=c.size * sent // width,
                compiled_dtype=c.dtype,
            )
        result.append(c)
    return result
