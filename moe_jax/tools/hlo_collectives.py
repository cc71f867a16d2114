"""The collectives of a compiled XLA program, read from its HLO text, with the bytes they move.

Why from compiled HLO: only there do the collectives XLA adds on its own appear
(gradient all-reduces, ZeRO gathers), combined into tuples, inside loops, with
their real group sizes. Nothing here knows mesh axis names.

Byte convention: `bytes` is what ONE device SENDS for one execution of the
collective over a group of g devices, with S the byte size of its per-device buffer:

    all-gather          S = result size               sent = S·(g-1)/g
    reduce-scatter      S = operand size (= result·g) sent = S·(g-1)/g
    all-to-all          S = operand size (all parts)  sent = S·(g-1)/g
    all-reduce          S = operand size              sent = 2·S·(g-1)/g  (ring)
    collective-permute  S = operand size              sent = S
    ragged-all-to-all   S = input buffer              sent = S·(g-1)/g  (a full buffer
                        routed uniformly; the rows really sent are known only at run time)

`count` is how often it runs per step: a collective inside a `while` body
counts the loop's known trip count, multiplied along the chain of calling
computations. `role` is 'activation' when the op's `op_name` metadata holds
one of the named scopes the layouts put around their exchanges
(`moe_jax.parallel.scopes.TAGS`: `token_exchange`, `router_stats`, `loss_exchange`, and
the pipeline's `stage_send`),
else 'param_grad'. `pass_` is 'backward'
when `op_name` holds `transpose(` (JAX's mark of the VJP), else 'forward'.

XLA combines independent collectives into one tuple-shaped op; each tuple
element keeps its own origin (in the metadata of the `get-tuple-element`
that reads it, or in the combined `prefix/(a:b:c)` op_name), so a combined op
is split into one row per (tag, pass, dtype).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterable
from fractions import Fraction

from moe_jax.parallel.scopes import CHUNK, RING, TAGS

KINDS = (
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "all-reduce",
    "collective-permute",
    "ragged-all-to-all",
)
DTYPE_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

_HEADER = re.compile(r"^(ENTRY\s+)?%(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="(?P<name>(?:[^"\\]|\\.)*)"')
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(?P<n>\d+)"')
_CALLED = re.compile(
    r"\b(?P<attr>body|condition|calls|to_apply|true_computation|false_computation)="
    r"(?P<names>%[\w.\-]+(?:,\s*%[\w.\-]+)*)"
)
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")
_GTE = re.compile(r"^%(?P<source>[^\s),]+)\),\s*index=(?P<index>\d+)")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(?P<groups>(?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<dims>[\d,\s]+)\]<=\[")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<names>[^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>(?:\{\d+,\d+\},?)*)\}")
_CHUNK = re.compile(rf"/{CHUNK}(?P<c>\d+)/")  # the expert block's chunks (parallel.overlap_chunks)
_RING = re.compile(
    rf"/{RING}(?P<r>\d+)/"
)  # a collective matmul's steps (parallel.collective_matmul)
_MODULE_SIZE = re.compile(r"\b(?P<key>num_partitions|replica_count)=(?P<value>\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective (or the part of a combined one with one origin)."""

    kind: str  # one of KINDS
    group_size: int
    dtype: str
    bytes: int  # sent by one device per execution (see the module docstring)
    count: int  # executions per step
    role: str  # 'activation' or 'param_grad'
    pass_: str  # 'forward' or 'backward'
    tag: str = ""  # the named scope that made it an activation exchange, if any
    op_name: str = ""
    count_known: bool = True  # False when a loop on its call chain had no known trip count
    chunk: int | None = None  # the `parallel.overlap_chunks` chunk it belongs to, if any
    ring: int | None = None  # the `parallel.collective_matmul` ring step, if any
    size: int = 0  # S: bytes of its per-device buffer (see the module docstring)
    # The dtype XLA compiled it in, where that differs from `dtype`, the one the program
    # sends it in (`moe_jax.tools.lowered_dtypes`: XLA:CPU widens bf16 and f8).
    compiled_dtype: str = ""

    @property
    def total(self) -> int:
        return self.bytes * self.count

    def as_dict(self) -> dict:
        row = dataclasses.asdict(self)
        row["pass"] = row.pop("pass_")
        return row


@dataclasses.dataclass
class Instruction:
    """One HLO instruction, as written in the program text (in program order)."""

    name: str
    computation: str
    shape: str
    opcode: str
    attrs: str  # everything after `opcode(`: the operands, then the attributes

    @property
    def operands(self) -> set[str]:
        """Names of the instructions it reads."""
        return set(re.findall(r"%([\w.\-]+)", self.attrs[: _closing("(" + self.attrs, 0)]))

    @property
    def called(self) -> set[str]:
        """Names of the computations it calls (a fusion's body, a loop's, ...)."""
        return {name for _, name in _called(self.attrs)}

    @property
    def op_name(self) -> str:
        """The JAX op_name of its metadata (named scopes, `transpose(` in the backward)."""
        match = _OP_NAME.search(self.attrs)
        return match["name"] if match else ""

    @property
    def chunk(self) -> int | None:
        """The `parallel.overlap_chunks` chunk it belongs to, if any."""
        return chunk_of(self.op_name)

    @property
    def ring(self) -> int | None:
        """The `parallel.collective_matmul` ring step it belongs to, if any."""
        return ring_of(self.op_name)


def chunk_of(op_name: str) -> int | None:
    """The chunk an op_name's scope names (`.../chunk<c>/...`), or None."""
    match = _CHUNK.search(op_name)
    return int(match["c"]) if match else None


def ring_of(op_name: str) -> int | None:
    """The ring step an op_name's scope names (`.../ring<i>/...`), or None."""
    match = _RING.search(op_name)
    return int(match["r"]) if match else None


def parse(hlo_text: str) -> list[Collective]:
    """Every collective the program executes, with its per-step count (unexecuted
    computations are left out)."""
    devices = _module_devices(hlo_text)
    instructions, entry = _instructions(hlo_text)
    counts = _counts(instructions, entry)
    element_names = _element_op_names(instructions)
    shapes = {ins.name: ins.shape for ins in instructions}
    result = []
    for ins in instructions:
        kind = _kind(ins.opcode)
        count, known = counts.get(ins.computation, (0, True))
        if kind is None or count == 0:
            continue
        group = _group_size(kind, ins.attrs, devices)
        parts = _parts(ins, kind, group, element_names, shapes)
        for (tag, pass_, dtype, chunk, ring), (size, op_name) in parts.items():
            result.append(
                Collective(
                    kind=kind,
                    group_size=group,
                    dtype=dtype,
                    bytes=_sent(kind, size, group),
                    count=count,
                    role="activation" if tag else "param_grad",
                    pass_=pass_,
                    tag=tag,
                    op_name=op_name,
                    count_known=known,
                    chunk=chunk,
                    ring=ring,
                    size=size,
                )
            )
    return result


def aggregate(collectives: Iterable[Collective]) -> list[Collective]:
    """Rows identical in (kind, group_size, dtype, bytes, role, pass, tag, chunk, ring)
    merged, counts summed; the first row's op_name stands for the group. Largest total
    first."""
    merged: dict[tuple, Collective] = {}
    for c in collectives:
        key = (c.kind, c.group_size, c.dtype, c.bytes, c.role, c.pass_, c.tag, c.chunk, c.ring)
        if key in merged:
            old = merged[key]
            c = dataclasses.replace(
                old, count=old.count + c.count, count_known=old.count_known and c.count_known
            )
        merged[key] = c
    step = lambda i: -1 if i is None else i
    order = lambda c: (c.role, c.pass_, -c.total, c.kind, step(c.chunk), step(c.ring))
    return sorted(merged.values(), key=order)


def _module_devices(text: str) -> int:
    header = text.split("\n", 1)[0]
    sizes = {m["key"]: int(m["value"]) for m in _MODULE_SIZE.finditer(header)}
    return sizes.get("num_partitions", 1) * sizes.get("replica_count", 1)


def instructions(text: str) -> list[Instruction]:
    """Every instruction of the program, each with its computation's name, in order."""
    return _instructions(text)[0]


def _instructions(text: str) -> tuple[list[Instruction], str]:
    """All instructions, each with its computation's name, and the entry computation."""
    instructions, computation, entry = [], "", ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            computation = header["name"]
            entry = computation if header.group(1) else entry
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        shape, rest = _split_shape(match["rest"])
        opcode = _OPCODE.match(rest)
        if opcode:
            attrs = rest[opcode.end() :]
            instructions.append(
                Instruction(match["name"], computation, shape, opcode["opcode"], attrs)
            )
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return instructions, entry


def _split_shape(rest: str) -> tuple[str, str]:
    """('(f32[2]{0}, s32[])', ' all-reduce(...)...') from an instruction's right-hand side."""
    if rest.startswith("("):
        end = _closing(rest, 0)
        return rest[: end + 1], rest[end + 1 :]
    shape, _, tail = rest.partition(" ")
    return shape, " " + tail


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start`."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    depth = 0
    for i in range(start, len(text)):
        if text[i] in pairs:
            depth += 1
        elif text[i] in pairs.values():
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in {text[:80]!r}")


def _top_level(shape: str) -> list[str]:
    """Top-level elements of a tuple shape; an array shape is its own single element."""
    if not shape.startswith("("):
        return [shape]
    inner = re.sub(r"/\*[^*]*\*/", "", shape[1:-1])
    parts, depth, start = [], 0, 0
    for i, char in enumerate(inner):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return [p for p in parts if p]


def _arrays(shape: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of every array in a (possibly nested tuple) shape."""
    result = []
    for match in _ARRAY.finditer(re.sub(r"\{[^{}]*\}", "", shape)):
        dtype = match["dtype"]
        if dtype not in DTYPE_BYTES and not dtype.startswith("f8"):
            continue
        dims = [int(d.replace("<=", "")) for d in match["dims"].split(",") if d.strip()]
        result.append((dtype, math.prod(dims) * DTYPE_BYTES.get(dtype, 1)))
    return result


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


def _group_size(kind: str, attrs: str, devices: int) -> int:
    """Devices in one replica group (collective-permute: devices it connects)."""
    if kind == "collective-permute":
        pairs = _PAIRS.search(attrs)
        if not pairs:
            return 2
        return max(2, len(set(re.findall(r"\d+", pairs["pairs"]))))
    mesh = _MESH_GROUPS.search(attrs)
    if mesh:
        sizes = {
            name.strip().strip("'\""): int(size)
            for name, size in re.findall(r"([^,=\s]+)\s*=\s*(\d+)", mesh["axes"])
        }
        group = 1
        for entry in (n.strip() for n in mesh["names"].split(",") if n.strip()):
            # an axis ('tensor'), or a sub-axis of it: 'tensor':(k)m, m of its devices
            part = re.fullmatch(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?", entry)
            if not part or part[1] not in sizes:
                raise ValueError(f"replica_groups name axes {entry!r} the mesh does not have")
            group *= int(part[3]) if part[3] else sizes[part[1]]
        return group
    iota = _IOTA_GROUPS.search(attrs)
    if iota:
        return int(iota["dims"].split(",")[-1])
    explicit = _EXPLICIT_GROUPS.search(attrs)
    if explicit and explicit["groups"].strip():
        first = re.search(r"\{([\d,\s]*)\}", explicit["groups"])
        return len([d for d in first.group(1).split(",") if d.strip()])
    return devices  # no groups, or `{}`: every device


def _buffer_elements(ins: Instruction, kind: str, shapes: dict[str, str]) -> list[str]:
    """Shapes whose bytes are S, one per tuple element that has its own origin."""
    if kind == "ragged-all-to-all":  # result = the receive buffer; S is the input, operand 0
        first = re.match(r"\s*%([^\s,)]+)", ins.attrs)
        return [shapes.get(first.group(1), ins.shape) if first else ins.shape]
    elements = _top_level(ins.shape)
    if not ins.opcode.endswith("-start"):
        return elements
    if kind == "all-gather" and len(elements) >= 2:
        return [elements[-1]]  # (operands, results)
    if kind == "collective-permute":
        return [elements[0]]  # (operand, result, contexts...)
    return [ins.shape]


def _parts(
    ins: Instruction,
    kind: str,
    group: int,
    element_names: dict[tuple[str, int], str],
    shapes: dict[str, str],
) -> dict[tuple[str, str, str, int | None, int | None], tuple[int, str]]:
    """(S in bytes, an op_name) per (tag, pass, dtype, chunk, ring step) of the
    instruction's elements."""
    own = ins.op_name
    elements = _buffer_elements(ins, kind, shapes)
    combined = _split_combined(own, len(elements))
    parts: dict[tuple[str, str, str, int | None, int | None], tuple[int, str]] = {}
    for index, element in enumerate(elements):
        arrays = _arrays(element)
        if not arrays:
            continue
        name = element_names.get((ins.name, index)) or (combined[index] if combined else own)
        tag = next((t for t in TAGS if t in name), "")
        pass_ = "backward" if "transpose(" in name else "forward"
        size = sum(b for _, b in arrays) * (group if kind == "reduce-scatter" else 1)
        key = (tag, pass_, arrays[0][0], chunk_of(name), ring_of(name))
        before, first_name = parts.get(key, (0, name))
        parts[key] = (before + size, first_name)
    return parts


def _sent(kind: str, size: int, group: int) -> int:
    if kind == "collective-permute":
        return size
    share = Fraction(size * (group - 1), group)
    return round(2 * share if kind == "all-reduce" else share)


def _split_combined(op_name: str, elements: int) -> list[str] | None:
    """`prefix/(a:b:c)`, the op_name XLA gives a combined op, as [prefix/a, prefix/b, ...]
    when it names exactly `elements` origins."""
    if elements < 2 or not op_name.endswith(")"):
        return None
    depth = 0
    for start in range(len(op_name) - 1, -1, -1):
        depth += op_name[start] == ")"
        depth -= op_name[start] == "("
        if depth == 0:
            break
    if start == 0 or op_name[start - 1] != "/":
        return None
    inner, names, depth, begin = op_name[start + 1 : -1], [], 0, 0
    for i, char in enumerate(inner):
        depth += char == "("
        depth -= char == ")"
        if char == ":" and depth == 0:
            names.append(inner[begin:i])
            begin = i + 1
    names.append(inner[begin:])
    return [op_name[:start] + n for n in names] if len(names) == elements else None


def _element_op_names(instructions: list[Instruction]) -> dict[tuple[str, int], str]:
    """op_name of each tuple element, from the get-tuple-element that reads it."""
    names = {}
    for ins in instructions:
        if ins.opcode != "get-tuple-element":
            continue
        gte = _GTE.match(ins.attrs)
        name = ins.op_name
        if gte and name:
            names[(gte["source"], int(gte["index"]))] = name
    return names


def _counts(instructions: list[Instruction], entry: str) -> dict[str, tuple[int, bool]]:
    """Executions per step of each computation reachable from the entry, and whether
    every loop on the way had a known trip count."""
    callers: dict[str, list[tuple[str, int, bool]]] = collections.defaultdict(list)
    for ins in instructions:
        if ins.opcode.endswith(("-done", "-update")):
            continue  # the matching -start already called the computation
        trips = _TRIP_COUNT.search(ins.attrs)
        for attr, name in _called(ins.attrs):
            times, known = 1, True
            if attr in ("body", "condition"):
                known = trips is not None
                times = int(trips["n"]) if known else 1
                times += attr == "condition" and known
            callers[name].append((ins.computation, times, known))
    memo: dict[str, tuple[int, bool]] = {entry: (1, True)}

    def count(name: str) -> tuple[int, bool]:
        if name not in memo:
            total, known = 0, True
            for caller, times, edge_known in callers.get(name, []):
                caller_count, caller_known = count(caller)
                total += caller_count * times
                known = known and (caller_count == 0 or (edge_known and caller_known))
            memo[name] = (total, known)
        return memo[name]

    computations = {ins.computation for ins in instructions}
    return {name: count(name) for name in computations}


def _called(attrs: str) -> list[tuple[str, str]]:
    called = [
        (m["attr"], name.strip().lstrip("%"))
        for m in _CALLED.finditer(attrs)
        for name in m["names"].split(",")
    ]
    for m in _CALLED_LIST.finditer(attrs):
        called += [("branch", n.strip().lstrip("%")) for n in m["names"].split(",") if n.strip()]
    return called
