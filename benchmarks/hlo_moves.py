"""Large data movement in an optimised HLO module, placed by while-loop depth.

A generate program should stream its weights into the matmuls; if XLA instead copies or
reassembles an array as large as a weight matrix inside the decoding loops (the dot merger's
concatenated wk|wv, a layout transpose, a dtype convert), every step pays for it. This module
reads the text of `jax.stages.Compiled.as_text()` and lists such instructions with the
while-loop depth they run at: 0 outside every loop (once per call), 1 inside one loop body,
2 inside a loop nested in that (for `generate`: per block, then per step).

What counts as a move: an instruction whose opcode is in `MOVE_OPS`, or a fusion whose fused
computation contains one, when the largest array of its result holds at least `min_bytes`
bytes. A fusion counts once however many moves it fuses, and only when its result is that
large (a weight-sized slice fused into a smaller result is never written out). Not counted:
bitcasts, broadcasts and arithmetic. An in-place dynamic-update-slice into a large buffer
(a KV cache) is listed too: the text does not say which updates XLA performs in place, so the
listed shape is what tells a cache write from a weight copy. Large activations count as well,
so choose `min_bytes` above the activations of the run (batch 1: the smallest weight matrix).

Under tensor parallelism the same listing with `ops=COLLECTIVE_OPS` finds collectives as
large as a weight shard: an all-gather or all-to-all of a weight (a layout the partitioner
has to repair) where only activation-sized all-reduces belong. Shapes in a partitioned module
are per device, so compare them with the weights' per-device shards.
"""

from __future__ import annotations

import dataclasses
import re

MOVE_OPS = frozenset({
    "copy", "copy-start", "concatenate", "transpose", "reshape", "convert", "bitcast-convert",
    "dynamic-update-slice", "dynamic-slice", "slice", "pad", "reverse", "gather", "scatter",
})

# Collectives as printed before and after XLA splits them into async pairs (`*-start` carries
# the result; its `*-done` would count the same transfer twice).
COLLECTIVE_OPS = frozenset({
    "all-gather", "all-gather-start", "all-to-all", "all-reduce", "all-reduce-start",
    "collective-permute", "collective-permute-start", "reduce-scatter", "ragged-all-to-all",
    "collective-broadcast",
})

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_ONE_CALLEE = re.compile(
    r"\b(condition|body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_MANY_CALLEES = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Move:
    depth: int          # while-loop nesting depth of the computation it runs in
    opcode: str         # e.g. "concatenate", or "fusion[concatenate]" for a fused one
    type: str           # result type as printed, e.g. "bf16[4096,8192]{1,0}"
    nbytes: int         # bytes of the largest array in the result
    name: str
    computation: str


@dataclasses.dataclass(frozen=True)
class MoveReport:
    moves: list[Move]
    loop_depth: int     # deepest while-loop nesting in the module (0: no loops)

    def count(self, depth: int) -> int:
        return sum(m.depth == depth for m in self.moves)

    def by_depth(self) -> dict[int, int]:
        return {d: self.count(d) for d in range(self.loop_depth + 1)}


@dataclasses.dataclass
class _Instr:
    name: str
    type: str
    opcode: str
    callees: list[tuple[str, str]]  # (attribute, computation name)


def array_bytes(type_str: str) -> int:
    """Bytes of the largest array in an HLO type: `bf16[4096,8192]{1,0}` -> 67108864; a
    tuple type gives its largest element; `token[]` and unknown dtypes give 0."""
    best = 0
    for dtype, dims in _ARRAY.findall(type_str):
        width = re.search(r"\d+", dtype)
        bits = 8 if dtype == "pred" else int(width.group()) if width else 0
        n = 1
        for d in dims.split(","):
            d = re.sub(r"\D", "", d)
            if d:
                n *= int(d)
        best = max(best, n * bits // 8)
    return best


def _split_type(rest: str) -> tuple[str, str]:
    """(result type, remainder) of the text after `name = `; tuple types nest parentheses."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i + 1], rest[i + 1:]
    return rest, ""


def parse_module(hlo_text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """({computation name: instructions}, entry computation name) of an HLO module's text."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        type_str, tail = _split_type(m.group(2))
        op = _OPCODE.match(tail)
        if not op:
            continue
        callees = [(k, v) for k, v in _ONE_CALLEE.findall(tail)]
        for k, names in _MANY_CALLEES.findall(tail):
            callees += [(k, n.strip().lstrip("%")) for n in names.split(",") if n.strip()]
        comps[current].append(_Instr(m.group(1), type_str, op.group(1), callees))
    return comps, entry


def _loop_depths(comps: dict[str, list[_Instr]], entry: str) -> dict[str, int]:
    """Depth of every computation reachable from `entry` other than fusion bodies: a while's
    condition and body sit one deeper than the while; other callees at the caller's depth.
    A computation reached along several paths gets the deepest."""
    depths: dict[str, int] = {}
    stack = [(entry, 0)]
    while stack:
        comp, d = stack.pop()
        if depths.get(comp, -1) >= d or comp not in comps:
            continue
        depths[comp] = d
        for ins in comps[comp]:
            if ins.opcode == "fusion":
                continue
            for attr, callee in ins.callees:
                deeper = ins.opcode == "while" and attr in ("condition", "body")
                stack.append((callee, d + 1 if deeper else d))
    return depths


def _fused_moves(comps: dict[str, list[_Instr]], comp: str, min_bytes: int,
                 ops: frozenset[str] = MOVE_OPS) -> set[str]:
    """Opcodes in `ops` of at least `min_bytes` inside a fused computation (and the fusions
    nested in it)."""
    found: set[str] = set()
    for ins in comps.get(comp, []):
        if ins.opcode in ops and array_bytes(ins.type) >= min_bytes:
            found.add(ins.opcode)
        if ins.opcode == "fusion":
            for _, callee in ins.callees:
                found |= _fused_moves(comps, callee, min_bytes, ops)
    return found


def weight_sized_moves(hlo_text: str, min_bytes: int,
                       ops: frozenset[str] = MOVE_OPS) -> MoveReport:
    """Every move (module docstring) whose result holds at least `min_bytes` bytes, with the
    while-loop depth it runs at; `ops=COLLECTIVE_OPS` lists collectives instead."""
    if min_bytes <= 0:
        raise ValueError(f"min_bytes must be positive, got {min_bytes}")
    comps, entry = parse_module(hlo_text)
    if entry is None:
        raise ValueError("hlo_text has no ENTRY computation: pass Compiled.as_text()")
    depths = _loop_depths(comps, entry)
    moves = []
    for comp, d in depths.items():
        for ins in comps[comp]:
            nbytes = array_bytes(ins.type)
            if nbytes < min_bytes:
                continue
            if ins.opcode in ops:
                opcode = ins.opcode
            elif ins.opcode == "fusion":
                fused = set().union(*(_fused_moves(comps, c, min_bytes, ops)
                                      for a, c in ins.callees if a == "calls"))
                if not fused:
                    continue
                opcode = f"fusion[{','.join(sorted(fused))}]"
            else:
                continue
            moves.append(Move(d, opcode, ins.type, nbytes, ins.name, comp))
    return MoveReport(sorted(moves, key=lambda m: (m.depth, m.computation, m.name)),
                      max(depths.values(), default=0))
