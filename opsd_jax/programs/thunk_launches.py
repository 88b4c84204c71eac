"""How many launches a compiled GPU program issues per iteration of its main loop, read from
the thunk sequence XLA:GPU runs (compile-only devices will do: opsd_jax/programs/gpu_target.py).

Why: a decode step moves a few GiB in about a thousand small kernels, so the host's cost of
launching them (a few microseconds each) and the wait on a data-dependent loop's predicate can
be as large as the HBM time. The HLO text does not show either: XLA:GPU turns the optimized
program into a sequence of thunks and then, in a thunk pass (CommandBufferConversionPass),
groups runs of them into command buffers (CUDA graphs) that launch as one. XLA dumps that final
sequence (`*.thunk_sequence_after_thunk_passes.txt`, with `thunk_metadata.txt` naming each
thunk's HLO instruction); hlo_stats.compile_and_read_all returns both.

The model, per iteration of the program's outermost while loop (a decode round's token loop):
  * a command buffer is one launch (a CUDA graph launch), whatever it holds;
  * every other kernel, library call, copy or collective is one launch; an async start counts
    the thunks it starts, a dynamic-slice fusion its one wrapped call, an async done nothing;
  * a nested loop outside a command buffer costs its condition and body per trip (XLA's known
    trip count, from the HLO); with a known count the host runs the body that many times
    without reading a predicate, otherwise each trip copies the predicate to the host and waits
    for it (a host sync), and the launch queue drains;
  * a loop inside a command buffer is a conditional node of the graph: no launch, no sync.
What it cannot say: how long each launch takes (bench/scale.py states the cost it assumes).
"""

from __future__ import annotations

import dataclasses
import re

from opsd_jax.programs import hlo_stats

# "  061: kCustomKernel [prev=060 (1) | next=063 (2)] filled_cache_attention grid: [2, 2, 3] ..."
_LINE = re.compile(r"^(\s*)(\d+): (k\w+)\s*(?:\[[^\]]*\])?\s*(.*)$")
_META = re.compile(r'profile_annotation:\s*"([^"]*)"\s*thunk_id:\s*(\d+)')
_GRID = re.compile(r"grid: \[(\d+), (\d+), (\d+)\]")
_NO_LAUNCH = {"kAsyncDone", "kWaitForStreams", "kRecordEvent"}  # stream events, no kernel
_CONTAINERS = {"kAsyncStart", "kDynamicSliceFusion", "kSequential"}  # count what they hold


@dataclasses.dataclass
class Thunk:
    thunk_id: int
    kind: str  # kCustomKernel, kCommandBuffer, kWhile, kCopy, ...
    text: str  # the rest of the line (a kernel's name and grid)
    children: list[Thunk] = dataclasses.field(default_factory=list)  # held thunks / loop body
    condition: list[Thunk] = dataclasses.field(default_factory=list)  # a while's condition

    @property
    def kernel_name(self) -> str:
        return self.text.split(" grid:")[0].strip() if "grid:" in self.text else ""

    @property
    def grid(self) -> tuple[int, int, int] | None:
        found = _GRID.search(self.text)
        return tuple(int(g) for g in found.groups()) if found else None


def parse(sequence: str) -> list[Thunk]:
    """The thunk tree of a dumped thunk sequence. Children are indented 4 spaces deeper than
    their parent; a while's `condition:` / `body:` lines switch where its children go."""
    root = Thunk(-1, "kRoot", "")
    stack: list[tuple[int, Thunk, list]] = [(-1, root, root.children)]
    for line in sequence.splitlines():
        stripped = line.strip()
        if stripped in ("condition:", "body:"):
            # Attach to the most recent while (the one these lines follow).
            loop = next(t for _, t, _ in reversed(stack) if t.kind == "kWhile")
            depth = next(d for d, t, _ in reversed(stack) if t is loop)
            while stack[-1][1] is not loop:
                stack.pop()
            target = loop.condition if stripped == "condition:" else loop.children
            stack[-1] = (depth, loop, target)
            continue
        found = _LINE.match(line)
        if not found:
            continue
        indent, thunk_id, kind, rest = found.groups()
        depth = len(indent)
        while len(stack) > 1 and stack[-1][0] >= depth:
            stack.pop()
        thunk = Thunk(int(thunk_id), kind, rest)
        stack[-1][2].append(thunk)
        stack.append((depth, thunk, thunk.children))
    return root.children


def annotations(metadata: str) -> dict[int, str]:
    """{thunk id: HLO instruction name} from a dumped thunk_metadata.txt."""
    return {int(i): name for name, i in _META.findall(metadata)}


@dataclasses.dataclass(frozen=True)
class Launches:
    """What one iteration of a loop issues: launches from the host, and kernels inside graphs."""

    launches: float  # kernel / library / copy / collective launches and graph launches
    graph_launches: float  # of which command buffers (CUDA graphs)
    graph_kernels: float  # kernels run inside those graphs (no host launch each)
    host_syncs: float  # predicate reads of data-dependent loops (device -> host, then wait)

    def __add__(self, other):
        return Launches(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def __mul__(self, times):
        return Launches(*(a * times for a in self.astuple()))

    def astuple(self) -> tuple:
        return dataclasses.astuple(self)


_NONE = Launches(0, 0, 0, 0)


def trip_counts(hlo_text: str) -> dict[str, int | None]:
    """{while instruction name: the trip count XLA knows (its `known_trip_count`), None for a
    data-dependent loop} of an optimized program. Only a known count spares the predicate read:
    a decode round's token loop (`step < max_steps & any(active)`) has none."""
    computations, _ = hlo_stats.parse_module(hlo_text)
    return {
        inst.name: hlo_stats.known_trip_count(inst)
        for insts in computations.values()
        for inst in insts
        if inst.opcode == "while"
    }


def _cost(thunks, names, trips, in_graph: bool) -> Launches:
    total = _NONE
    for thunk in thunks:
        if thunk.kind == "kCommandBuffer":
            total += Launches(1, 1, 0, 0) + _cost(thunk.children, names, trips, True)
        elif thunk.kind == "kWhile":
            count = trips.get(names.get(thunk.thunk_id, ""))
            if count is None:  # one trip counted: condition, body, the predicate's host sync
                total += _cost(thunk.condition + thunk.children, names, trips, in_graph)
                total += Launches(0, 0, 0, 0 if in_graph else 1)
            else:  # the body `count` times, no condition (in a graph: unrolled or a loop node)
                total += _cost(thunk.children, names, trips, in_graph) * count
        elif thunk.kind in _CONTAINERS:
            total += _cost(thunk.children, names, trips, in_graph)
        elif thunk.kind not in _NO_LAUNCH:
            total += Launches(0, 0, 1, 0) if in_graph else Launches(1, 0, 0, 0)
    return total


def main_loop(thunks: list[Thunk], inside: bool = False) -> tuple[Thunk | None, bool]:
    """(the outermost while loop of the program, whether a command buffer holds it: then it
    runs as part of one graph)."""
    for thunk in thunks:
        if thunk.kind == "kWhile":
            return thunk, inside
        if thunk.kind == "kCommandBuffer":
            loop, held = main_loop(thunk.children, True)
            if loop is not None:
                return loop, held
    return None, False


def per_iteration(sequence: str, metadata: str, hlo_text: str) -> Launches:
    """Launches, kernels in graphs and host syncs per iteration of the program's outermost
    while loop (one decode step of a decode round). A loop held by a command buffer launches
    nothing per iteration (its graph was launched once, before it); otherwise its condition and
    body are launched every iteration, and a data-dependent condition syncs with the host."""
    loop, in_graph = main_loop(parse(sequence))
    if loop is None:
        raise ValueError("the thunk sequence has no while loop")
    names, trips = annotations(metadata), trip_counts(hlo_text)
    step = _cost(loop.condition + loop.children, names, trips, in_graph)
    data_dependent = trips.get(names.get(loop.thunk_id, "")) is None
    return step + Launches(0, 0, 0, 1 if data_dependent and not in_graph else 0)


def kernels(thunks: list[Thunk], name: str) -> list[Thunk]:
    """Every kernel thunk called `name` (its grid says how many programs it runs)."""
    found = []
    for thunk in thunks:
        if thunk.kernel_name == name:
            found.append(thunk)
        found += kernels(thunk.condition + thunk.children, name)
    return found
