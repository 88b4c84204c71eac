"""What a compiled XLA program moves between devices: its collectives, counted through loops.

`partitioned_hlo(jax.jit(f).lower(...))` is the per-device program right after SPMD
partitioning (see there why not the final one). `collectives(text)` lists every collective instruction in it with its operand and result shapes
and how many times it runs per call: the product of the trip counts of the while loops around
it (XLA writes `known_trip_count` on loops whose count it knows, e.g. a scan over layers; a loop
with a data-dependent count is counted once and flagged). `summarize` turns that into bytes per
device by kind. The layout tests and bench/scale.py both read programs through this module.

Bytes per device, for a group of n devices (ring algorithms, what each device receives):
  all-gather       result - operand               ((n-1)/n of the gathered array)
  reduce-scatter   operand - result               ((n-1)/n of the summed array)
  all-reduce       2 (n-1)/n x operand            (reduce-scatter + all-gather)
  all-to-all       (n-1)/n x operand
  collective-permute  operand

One module of over 400 lines: one reader of XLA's program text (ops, loops and their trip
counts) and the summaries made from it.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import math
import os
import re
import tempfile
from collections import defaultdict

import jax
from jax.experimental.compilation_cache import compilation_cache as persistent_cache

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

DTYPE_BYTES = {
    "pred": 1,
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
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s4": 1,
    "u4": 1,
}

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_OPERAND_NAME = re.compile(r"%([\w.\-]+(?:#\d+)?)")
_CALLEES = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CONSTANT = re.compile(r"^\s*(-?\d+)\s*$")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
# Ops that only move or relabel data between an all-reduce and the slice that makes it a
# reduce-scatter.
_PASSTHROUGH = {"transpose", "reshape", "bitcast", "copy", "convert", "get-tuple-element"}


@dataclasses.dataclass(frozen=True)
class Shape:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 4) * math.prod(self.dims)

    def __str__(self):
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    name: str
    computation: str
    operands: tuple[Shape, ...]
    results: tuple[Shape, ...]
    group_size: int  # devices taking part in one group (0 when the program does not say)
    count: int  # executions per call of the program (product of enclosing trip counts)
    in_unknown_loop: bool  # inside a loop whose trip count XLA does not know (count is a floor)

    @property
    def operand_bytes(self) -> int:
        return sum(s.bytes for s in self.operands)

    @property
    def result_bytes(self) -> int:
        return sum(s.bytes for s in self.results)

    @property
    def moved_bytes(self) -> float:
        """Bytes each device receives for one execution (see the module docstring)."""
        n = max(self.group_size, 1)
        if self.kind == "all-gather":
            return self.result_bytes - self.operand_bytes
        if self.kind == "reduce-scatter":
            return self.operand_bytes - self.result_bytes
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * self.operand_bytes
        if self.kind == "all-to-all":
            return (n - 1) / n * self.operand_bytes
        return float(self.operand_bytes)

    @property
    def dtypes(self) -> set[str]:
        return {s.dtype for s in self.operands + self.results}


def shapes_in(text: str) -> tuple[Shape, ...]:
    return tuple(
        Shape(dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _SHAPE.findall(text)
    )


def _split_operands(rest: str) -> str:
    """The text inside the instruction's argument parentheses (rest starts after '(')."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += ch in "({["
        depth -= ch in ")}]"
        if depth == 0:
            return rest[:i]
    return rest


def _kind(opcode: str) -> str | None:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    result: str  # the result type text
    operands: list[str]  # operand instruction names (a tuple element 'x#3' counts as 'x')
    operand_text: str
    attributes: str
    is_root: bool = False


def parse_module(text: str):
    """{computation: [Instruction]} and the entry computation's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        stripped = line.strip()
        if _COMPUTATION.match(stripped) and not _INSTRUCTION.match(stripped):
            current = _COMPUTATION.match(stripped).group(1)
            computations[current] = []
            if stripped.startswith("ENTRY"):
                entry = current
            continue
        inst = _INSTRUCTION.match(line) if current is not None else None
        if inst:
            name, result, opcode, rest = inst.groups()
            operand_text = _split_operands(rest)
            computations[current].append(
                Instruction(
                    name,
                    opcode,
                    result,
                    _OPERAND_NAME.findall(operand_text),
                    operand_text,
                    rest[len(operand_text) :],
                    stripped.startswith("ROOT"),
                )
            )
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def known_trip_count(loop: Instruction) -> int | None:
    """The trip count XLA annotated on a while loop (`known_trip_count`), else None."""
    found = _TRIP_COUNT.search(loop.attributes)
    return int(found.group(1)) if found else None


def trip_count(loop: Instruction, computations) -> int | None:
    """Iterations of a while loop: XLA's annotation when present, else a condition holding
    `counter < constant` (how jax writes scan / map loops; the counter starts at 0). A loop that
    can also stop early (`step < max_steps & any(active)`) is counted at its bound."""
    if known_trip_count(loop) is not None:
        return known_trip_count(loop)
    condition = re.search(r"condition=%?([\w.\-]+)", loop.attributes)
    body = computations.get(condition.group(1), []) if condition else []
    constants = {i.name: i.operand_text for i in body if i.opcode == "constant"}
    for inst in body:
        if inst.opcode == "compare" and "direction=LT" in inst.attributes and inst.operands:
            bound = constants.get(inst.operands[-1].split("#")[0])
            if bound is not None and _CONSTANT.match(bound):
                return int(bound)
    return None


def _group_size(attributes: str) -> int:
    mesh = _MESH_GROUPS.search(attributes)
    if mesh:  # replica_groups=mesh['data'=1,'fsdp'=8,'tensor'=1] {'fsdp'}
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        axes = re.findall(r"'([^']+)'", mesh.group(2))
        return math.prod(int(sizes[a]) for a in axes if a in sizes)
    groups = _GROUPS.search(attributes)
    if groups:
        return len(groups.group(1).split(","))
    iota = _GROUPS_IOTA.search(attributes)
    return int(iota.group(2)) if iota else 0


def operand_type(operand: str, results: dict[str, str]) -> str:
    """The type text of an operand; 'x#3' is element 3 of x's tuple type."""
    name, _, index = operand.partition("#")
    text = results.get(name, "")
    if not index or not text.startswith("("):
        return text
    text = re.sub(r"/\*.*?\*/", "", text[1:-1])
    elements, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            elements.append(text[start:i])
            start = i + 1
    elements.append(text[start:])
    return elements[int(index)] if int(index) < len(elements) else ""


def _slice_fraction(inst: Instruction, users: dict, results: dict) -> float | None:
    """The share of `inst`'s result that its uses keep, when every use (through data-movement
    ops) is a dynamic-slice of the same size; None otherwise. An all-reduce of which each device
    keeps 1/n, n its group size, is a reduce-scatter (XLA's GPU and TPU pipelines rewrite it into
    one; the CPU pipeline keeps the pair)."""
    pending, seen, sizes = [inst.name], set(), set()
    while pending:
        name = pending.pop()
        for user in users.get(name, ()):
            if user.name in seen:
                continue
            seen.add(user.name)
            if user.opcode == "dynamic-slice":
                sizes.add(math.prod(s for shape in shapes_in(user.result) for s in shape.dims))
            elif user.opcode in _PASSTHROUGH:
                pending.append(user.name)
            else:
                return None
    whole = math.prod(s for shape in shapes_in(inst.result) for s in shape.dims)
    return sizes.pop() / whole if len(sizes) == 1 and whole else None


def callees_of(inst: Instruction) -> list[str]:
    """The computations an instruction calls: a loop's body and condition, a call's or
    fusion's computation, a conditional's branches (in their order)."""
    callees = [c for _, c in _CALLEES.findall(inst.attributes)]
    for branches in _BRANCHES.findall(inst.attributes):
        callees += [b.strip().lstrip("%") for b in branches.split(",") if b.strip()]
    return callees


def reachable(computations, start: str) -> set[str]:
    """`start` and every computation it calls, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        todo += [c for inst in computations[name] for c in callees_of(inst)]
    return seen


def _multiplicities(computations, entry):
    """(executions per call, inside-an-unknown-loop) of every computation reachable from entry."""
    counts: dict[str, int] = defaultdict(int)
    unknown: dict[str, bool] = defaultdict(bool)

    def visit(computation: str, multiplier: int, in_unknown: bool, depth: int = 0):
        if depth > 64 or computation not in computations:
            return
        counts[computation] += multiplier
        unknown[computation] |= in_unknown
        for inst in computations[computation]:
            callees = callees_of(inst)
            if not callees:
                continue
            trips, loop_unknown = 1, False
            if inst.opcode == "while":
                trips = trip_count(inst, computations)
                trips, loop_unknown = (1, True) if trips is None else (trips, False)
            for callee in dict.fromkeys(callees):
                visit(callee, multiplier * trips, in_unknown or loop_unknown, depth + 1)

    visit(entry, 1, False)
    return counts, unknown


def dot_flops(text: str) -> tuple[float, float]:
    """(FLOPs of every dot per call, counted through loops; the part inside loops whose trip
    count is unknown, counted once per entry, so a floor). 2 x output elements x contraction."""
    computations, entry = parse_module(text)
    counts, unknown = _multiplicities(computations, entry)
    total = floor_part = 0.0
    for computation, instructions in computations.items():
        if not counts.get(computation):
            continue
        results = {i.name: i.result for i in instructions}
        for inst in instructions:
            if inst.opcode != "dot" or not inst.operands:
                continue
            lhs = shapes_in(operand_type(inst.operands[0], results))
            out = shapes_in(inst.result)
            contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", inst.attributes)
            if not lhs or not out or not contracting:
                continue
            dims = [int(d) for d in contracting.group(1).split(",") if d]
            flops = 2.0 * math.prod(out[0].dims) * math.prod(lhs[0].dims[d] for d in dims)
            total += flops * counts[computation]
            if unknown[computation]:
                floor_part += flops * counts[computation]
    return total, floor_part


def collectives(text: str) -> list[Collective]:
    """Every collective of an HLO module, with its per-call execution count."""
    computations, entry = parse_module(text)
    counts, unknown = _multiplicities(computations, entry)
    found: list[Collective] = []
    for computation, instructions in computations.items():
        if not counts.get(computation):
            continue
        results = {i.name: i.result for i in instructions}
        users: dict[str, list] = defaultdict(list)
        for i in instructions:
            for operand in i.operands:
                users[operand.split("#")[0]].append(i)
        for inst in instructions:
            kind = _kind(inst.opcode)
            if kind is None:
                continue
            group_size = _group_size(inst.attributes)
            if kind == "all-reduce" and group_size > 1:
                kept = _slice_fraction(inst, users, results)
                if kept is not None and abs(kept * group_size - 1) < 1e-9:
                    kind = "reduce-scatter"
            operand_types = " ".join(operand_type(o, results) for o in inst.operands)
            operands = shapes_in(operand_types or inst.operand_text)
            result_shapes = shapes_in(inst.result)
            if kind == "reduce-scatter" and inst.opcode.startswith("all-reduce"):
                # Reported as the reduce-scatter it becomes: each device keeps 1/n.
                n = max(group_size, 1)
                result_shapes = tuple(
                    Shape(r.dtype, (math.prod(r.dims) // n,)) for r in result_shapes
                )
            found.append(
                Collective(
                    kind=kind,
                    name=inst.name,
                    computation=computation,
                    operands=operands,
                    results=result_shapes,
                    group_size=group_size,
                    count=counts[computation],
                    in_unknown_loop=unknown[computation],
                )
            )
    return found


def summarize(found: list[Collective]) -> dict[str, dict[str, float]]:
    """{kind: {'count': executions per call, 'bytes': bytes received per device per call}}."""
    table = {kind: {"count": 0, "bytes": 0.0} for kind in KINDS}
    for c in found:
        table[c.kind]["count"] += c.count
        table[c.kind]["bytes"] += c.count * c.moved_bytes
    return table


def weight_shapes(weights) -> set[tuple[int, ...]]:
    """Every array's shape in a pytree of weights, also without the leading layer axis for the
    stacked ones (what one step of a layer scan moves)."""
    shapes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]:
        shapes.add(tuple(leaf.shape))
        if "layers" in jax.tree_util.keystr(path):
            shapes.add(tuple(leaf.shape[1:]))
    return shapes


def _is_weight_like(dims: tuple[int, ...], shapes: set[tuple[int, ...]], splits: set[int]) -> bool:
    """A weight's shape, possibly transposed, whole or split into one of `splits` parts (each
    split dimension and their product by a mesh-axis size: one device's shard)."""
    for shape in shapes:
        if len(shape) != len(dims):
            continue
        for order in set(itertools.permutations(dims)):
            if not all(d > 0 and w % d == 0 for w, d in zip(shape, order)):
                continue
            factors = [w // d for w, d in zip(shape, order)]
            if all(f in splits for f in factors) and math.prod(factors) in splits:
                return True
    return False


def activation_collectives(
    found: list[Collective], weights, splits: set[int], small: int = 64
) -> list[Collective]:
    """The collectives that move neither a weight nor a weight gradient (whole or one device's
    shard, `splits` = the ways the mesh splits a weight, e.g. {1, fsdp}) nor a small statistic
    (at most `small` elements): under FSDP and data parallelism that is an activation crossing
    devices, a layout bug. Reduce-scatters are judged by their operand (the result is reported
    flattened)."""
    shapes = weight_shapes(weights)
    splits = set(splits) | {1}
    bad = []
    for c in found:
        arrays = c.operands if c.kind == "reduce-scatter" else c.operands + c.results
        if all(math.prod(a.dims) <= small for a in arrays):
            continue
        if not all(_is_weight_like(a.dims, shapes, splits) for a in arrays):
            bad.append(c)
    return bad


def partitioned_hlo(lowered, options: dict | None = None) -> str:
    """The HLO of a lowered jax computation right after SPMD partitioning (see compile_and_read)."""
    return compile_and_read(lowered, options)[1]


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """A compiled executable and what XLA dumped while building it."""

    compiled: object
    partitioned: str  # the HLO right after SPMD partitioning
    thunk_sequence: str  # XLA:GPU's final thunk sequence ("" on other backends)
    thunk_metadata: str  # each thunk's id and HLO instruction ("" on other backends)


def compile_and_read(lowered, options: dict | None = None):
    """(the compiled executable, its HLO right after SPMD partitioning) for a lowered jax
    computation, compiled for the devices it was lowered for with the XLA `options` given
    (e.g. opsd_jax/programs/gpu_target.py's compiler_options for compile-only GPU devices).

    Why not `compile().as_text()`: that is the program after the backend's own passes, and the
    CPU backend widens bf16 collectives to f32 and never forms reduce-scatters; right after
    partitioning the program says what a GPU or TPU build would move (XLA dump of that pass).
    """
    program = compile_and_read_all(lowered, options)
    return program.compiled, program.partitioned


def _read_dump(folder: str, pattern: str) -> str:
    found = sorted(glob.glob(os.path.join(folder, pattern)))
    if not found:
        return ""
    with open(found[-1]) as f:
        return f.read()


def compile_and_read_all(lowered, options: dict | None = None) -> CompiledProgram:
    """compile_and_read, plus XLA:GPU's thunk sequence after its thunk passes (command buffers
    formed) and the thunks' metadata, from the same dump (opsd_jax/programs/thunk_launches.py
    reads them)."""
    # A persistent-cache hit would skip the passes, and with them the dump (the cache key
    # ignores dump options). jax decides once whether the cache is used; reset_cache makes it
    # read the setting again, before and after.
    cache_was_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    persistent_cache.reset_cache()
    try:
        with tempfile.TemporaryDirectory(prefix="opsd-hlo-") as folder:
            compiled = lowered.compile(
                compiler_options={
                    **(options or {}),
                    "xla_dump_to": folder,
                    "xla_dump_hlo_pass_re": "spmd-partitioning",
                }
            )
            partitioned = _read_dump(folder, "*after_spmd-partitioning*.txt")
            # One device: nothing to partition, the program as it came in.
            partitioned = partitioned or _read_dump(folder, "*before_optimizations.txt")
            if not partitioned:
                raise RuntimeError(
                    f"XLA wrote no after-spmd-partitioning dump in {folder}: "
                    f"{sorted(os.listdir(folder))[:20]}"
                )
            # Without thunk passes XLA writes only the sequence before them (the same thunks).
            thunks = _read_dump(folder, "*thunk_sequence_after_thunk_passes.txt")
            return CompiledProgram(
                compiled,
                partitioned,
                thunks or _read_dump(folder, "*thunk_sequence.txt"),
                _read_dump(folder, "*thunk_metadata.txt"),
            )
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was_on)
        persistent_cache.reset_cache()
