"""The HBM bytes a compiled GPU program moves, read from its optimized HLO.

On a GPU each kernel of the final program (a fusion, a copy, a library call such as a cuBLAS
GEMM, a collective) reads its operands from HBM and writes its results there; what happens
inside a fusion stays in registers and shared memory. So summing each kernel's operand and
result bytes bounds the program's HBM traffic well: decode is memory-bound, and this sum
divided by the bandwidth is its time floor as the compiler built it (not the ideal one).

Refinements, so the count says what the kernel touches rather than what it could address:
  * an operand used inside the fusion only through (dynamic-)slices or gathers counts the bytes
    they select;
  * an operand that a dynamic-update-slice or scatter updates in place counts nothing read, and
    the result counts only the update's bytes (a KV-cache write is one token's key, not the
    cache);
  * bitcasts, tuples, parameters, constants and the `-done` halves of async ops move nothing,
    nor does a library call's scratch workspace (a flat s8 array in its result tuple).

`loop_traffic(text)` walks the body of the program's main while loop (nested loops counted by
their trip counts) and returns every kernel with its bytes per iteration; `data_movement`
picks those that only move data (copies, slices, pads, transposes: no arithmetic), which in a
decode loop are the per-token copies a layout bug makes. The program text must be the final
one (`compiled.as_text()`); opsd_jax/programs/hlo_stats.py parses it.
"""

from __future__ import annotations

import dataclasses
import re

from opsd_jax.programs import hlo_stats

# Ops that move nothing (views, bookkeeping, the second half of async pairs).
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "iota",
}
# Ops that only move or reshape data: a kernel made of these alone is a copy.
_MOVES = {
    "parameter",
    "constant",
    "bitcast",
    "copy",
    "transpose",
    "reshape",
    "dynamic-slice",
    "slice",
    "dynamic-update-slice",
    "pad",
    "concatenate",
    "broadcast",
    "tuple",
    "get-tuple-element",
}
_SLICES = {"dynamic-slice", "slice", "gather"}  # read only what they select
_IN_PLACE = {"dynamic-update-slice", "scatter"}  # operand 0 updated in place
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRITON = '"__gpu$xla.gpu.triton"'  # a Pallas kernel's custom-call target
_TRITON_NAME = re.compile(r'\bname = "([^"]*)"')  # its name, in the custom call's backend config


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of the program and the HBM bytes it touches per loop iteration."""

    name: str
    opcode: str  # fusion, copy, custom-call, all-reduce, ...
    computation: str
    read: int  # bytes read per execution
    written: int  # bytes written per execution
    count: int  # executions per iteration of the loop the traffic is counted for
    moves_only: bool  # no arithmetic: a copy, slice, pad or transpose
    result: str  # the result type text (for reports)
    kernel_name: str = ""  # a Pallas (Triton) custom call's kernel name, else ""

    @property
    def bytes(self) -> int:
        return (self.read + self.written) * self.count


def _bytes(type_text: str) -> int:
    return sum(s.bytes for s in hlo_stats.shapes_in(type_text))


def _is_workspace(type_text: str) -> bool:
    """A library call's scratch buffer (cuBLAS, cuDNN: a flat s8 / u8 array beside its result):
    allocated, not read or written as data."""
    return re.fullmatch(r"\s*[su]8\[\d+\](\{0\})?\s*", type_text) is not None


def _tuple_elements(type_text: str) -> list[str]:
    """The top-level elements of a tuple type text; [text] for a non-tuple."""
    text = re.sub(r"/\*.*?\*/", "", type_text).strip()
    if not text.startswith("("):
        return [text]
    elements, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            elements.append(text[start:i])
            start = i + 1
    return [e for e in elements if e.strip()]


class _Module:
    def __init__(self, text: str):
        self.computations, self.entry = hlo_stats.parse_module(text)
        self.types = {
            name: {i.name: i.result for i in insts} for name, insts in self.computations.items()
        }

    def operand_types(self, inst, computation) -> list[str]:
        return [hlo_stats.operand_type(o, self.types[computation]) for o in inst.operands]

    def fused_access(self, fused: str) -> tuple[list[int | None], int, bool]:
        """(bytes read of each parameter, None = the whole parameter; bytes written; whether the
        computation only moves data) of a fused computation."""
        insts = self.computations.get(fused, [])
        by_name = {i.name: i for i in insts}
        users: dict[str, list] = {}
        for i in insts:
            for o in i.operands:
                users.setdefault(o.split("#")[0], []).append(i)

        def view_users(name, seen=()):  # users, looking through bitcasts
            for user in users.get(name, []):
                if user.opcode == "bitcast" and user.name not in seen:
                    yield from view_users(user.name, seen + (user.name,))
                else:
                    yield name, user

        params = sorted(
            (i for i in insts if i.opcode == "parameter"), key=lambda i: int(i.operand_text or 0)
        )
        reads: list[int | None] = []
        for param in params:
            total, whole = 0, False
            for source, user in view_users(param.name):
                first = user.operands[0].split("#")[0] if user.operands else None
                if user.opcode in _SLICES and first == source:
                    total += _bytes(user.result)
                elif user.opcode in _IN_PLACE and first == source:
                    pass  # updated in place: not read
                else:
                    whole = True
            reads.append(None if whole else total)

        def written(inst) -> int:
            while inst.opcode == "bitcast" and inst.operands:
                inst = by_name.get(inst.operands[0], inst)
                if inst.opcode != "bitcast":
                    break
            if inst.opcode in _IN_PLACE and len(inst.operands) > 1:
                # The update: operand 1 of a dynamic-update-slice, the last of a scatter.
                update = inst.operands[1 if inst.opcode == "dynamic-update-slice" else -1]
                return _bytes(hlo_stats.operand_type(update, self.types[fused]))
            if inst.opcode == "tuple":
                return sum(
                    written(by_name[o])
                    for o in inst.operands
                    if o in by_name and not _is_workspace(by_name[o].result)
                )
            return sum(_bytes(e) for e in _tuple_elements(inst.result) if not _is_workspace(e))

        root = next((i for i in insts if i.is_root), insts[-1] if insts else None)
        moves_only = all(i.opcode in _MOVES for i in insts)
        return reads, (written(root) if root else 0), moves_only

    def kernels(self, computation: str, multiplier: int, depth: int = 0):
        """Every kernel reachable from `computation`, executed `multiplier` times."""
        if depth > 32:
            return
        for inst in self.computations.get(computation, []):
            op = inst.opcode
            if op in _FREE or op.endswith("-done"):
                continue
            if op == "while":
                body = _BODY.search(inst.attributes)
                trips = hlo_stats.trip_count(inst, self.computations) or 1
                if body:
                    yield from self.kernels(body.group(1), multiplier * trips, depth + 1)
                continue
            if op == "conditional":
                branches = _BRANCHES.search(inst.attributes)
                names = (
                    [b.strip().lstrip("%") for b in branches.group(1).split(",")]
                    if branches
                    else []
                )
                # The branch taken is data-dependent: count the one that moves the most.
                options = [list(self.kernels(b, multiplier, depth + 1)) for b in names]
                if options:
                    yield from max(options, key=lambda ks: sum(k.bytes for k in ks))
                continue
            if op == "call":
                callee = _CALLS.search(inst.attributes) or re.search(
                    r"to_apply=%?([\w.\-]+)", inst.attributes
                )
                if callee:
                    yield from self.kernels(callee.group(1), multiplier, depth + 1)
                continue
            yield self.kernel(inst, computation, multiplier)

    def kernel(self, inst, computation: str, multiplier: int) -> Kernel:
        operands = self.operand_types(inst, computation)
        result = inst.result
        if inst.opcode.endswith("-start"):
            # Async start: ((operands...), result, context...) -> the result is element 1.
            elements = _tuple_elements(result)
            result = elements[1] if len(elements) > 1 else result
        moves_only = inst.opcode in ("copy", "copy-start")
        callee = _CALLS.search(inst.attributes)
        if inst.opcode in ("fusion", "fusion-start") and callee:
            reads, written, moves_only = self.fused_access(callee.group(1))
            read = sum(_bytes(t) if r is None else r for t, r in zip(operands, reads))
        elif inst.opcode in _IN_PLACE:
            written = _bytes(operands[1 if inst.opcode == "dynamic-update-slice" else -1])
            read, moves_only = written, inst.opcode == "dynamic-update-slice"
        elif inst.opcode in _SLICES:
            read = written = _bytes(result)
            moves_only = True
        else:
            read = sum(_bytes(t) for t in operands)
            elements = _tuple_elements(result)
            if inst.opcode == "custom-call" and len(elements) > 1 and _is_workspace(elements[-1]):
                elements = elements[:-1]  # a library call's scratch workspace
            written = sum(_bytes(e) for e in elements)
        triton = _TRITON_NAME.search(inst.attributes) if _TRITON in inst.attributes else None
        return Kernel(
            inst.name,
            inst.opcode,
            computation,
            read,
            written,
            multiplier,
            moves_only,
            result.strip(),
            triton.group(1) if triton else "",
        )


def loop_traffic(text: str, loop: str | None = None) -> list[Kernel]:
    """The kernels of one iteration of a while loop of the entry computation, with their bytes
    (nested loops counted by their trip counts). `loop` names the while instruction; by default
    the entry's loop whose iteration moves the most bytes (a decode round's token loop)."""
    module = _Module(text)
    loops = [i for i in module.computations[module.entry] if i.opcode == "while"]
    if loop is not None:
        loops = [i for i in loops if i.name == loop]
    if not loops:
        raise ValueError(f"no while loop {loop or ''} in the entry computation")
    best: list[Kernel] = []
    for inst in loops:
        body = _BODY.search(inst.attributes)
        kernels = list(module.kernels(body.group(1), 1)) if body else []
        if sum(k.bytes for k in kernels) >= sum(k.bytes for k in best):
            best = kernels
    return best


def outside_loops(text: str) -> list[Kernel]:
    """The entry computation's kernels outside its while loops (once per call)."""
    module = _Module(text)
    return [
        module.kernel(i, module.entry, 1)
        for i in module.computations[module.entry]
        if i.opcode not in _FREE
        and not i.opcode.endswith("-done")
        and i.opcode not in ("while", "conditional", "call")
    ]


def with_reads(kernels: list[Kernel], kernel_name: str, read: int) -> list[Kernel]:
    """`kernels` with every Pallas kernel named `kernel_name` counted as reading `read` bytes
    per execution. A kernel whose loops stop at run-time bounds reads less than its operands
    (the sampler's decode attention takes the whole stacked cache and reads one layer up to each
    row's length), which the program text cannot tell: the caller states what it reads."""
    return [
        dataclasses.replace(k, read=read) if k.kernel_name == kernel_name else k for k in kernels
    ]


def pallas_kernels(text: str) -> list[str]:
    """The Pallas (Triton) kernels a compiled GPU program calls, by name, each once, sorted."""
    names = set()
    for line in text.splitlines():
        if _TRITON in line:
            found = _TRITON_NAME.search(line)
            names.add(found.group(1) if found else "unnamed")
    return sorted(names)


def total_bytes(kernels: list[Kernel]) -> int:
    return sum(k.bytes for k in kernels)


def data_movement(kernels: list[Kernel], min_bytes: int = 0) -> list[Kernel]:
    """The kernels that only move data and write at least `min_bytes` per execution."""
    return [k for k in kernels if k.moves_only and k.written >= min_bytes]


def describe(kernels: list[Kernel], top: int = 12) -> str:
    """The kernels that move the most, one line each (for reports and test messages)."""
    ordered = sorted(kernels, key=lambda k: -k.bytes)[:top]
    total = max(total_bytes(kernels), 1)
    return "\n".join(
        f"  {k.bytes / 2**20:10.3f} MiB {100 * k.bytes / total:5.1f}%  x{k.count:<4} {k.opcode:<12}"
        f" {'[moves only] ' if k.moves_only else ''}{k.kernel_name or k.name} -> {k.result[:80]}"
        for k in ordered
    ) + (f"\n  ... {len(kernels) - top} more" if len(kernels) > top else "")
