"""Whether every Pallas block of a traced function lies inside the array it tiles, at every
program of its grid: the check a kernel must pass to be correct on any jax's Triton lowering.

Why: a block that overhangs its array (a 16-row query block over 7 heads, a combine that reads
16 splits of an array of 10) is masked by some lowerings and not by others. jax 0.12's Triton
lowering adds a bounds mask to every block load and store; jax 0.11's does not, so there the
overhang reads and writes the neighbouring rows or past the end of the buffer. The Pallas
interpreter pads every operand to whole blocks, so no CPU run of a kernel can see it. Tracing
can: `jax.make_jaxpr` of the function (nothing runs, no GPU needed) holds each `pallas_call`
with its grid and block mappings, and each block mapping's index map is a small jaxpr that we
evaluate at every program id of the grid.

`overhangs(fn, *args)` names every block dimension that does not divide its array, and every
program whose block starts or ends outside it. An empty list means the kernel relies on no
lowering's masking. Index maps that read scalar-prefetch operands are refused (none of ours
do: the Triton backend has none).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core


@dataclasses.dataclass(frozen=True)
class PallasCall:
    """One traced pallas_call: its name, grid and (for inputs, then outputs) block mappings."""

    name: str
    grid: tuple[int, ...]
    block_mappings: tuple
    num_inputs: int


def pallas_calls(closed_jaxpr) -> list[PallasCall]:
    """Every pallas_call in a jaxpr, inside any nested jaxpr (jit, custom_vjp, loops, shard_map)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                mapping = eqn.params["grid_mapping"]
                found.append(
                    PallasCall(
                        name=str(eqn.params.get("name") or "pallas_call"),
                        grid=tuple(mapping.grid),
                        block_mappings=tuple(mapping.block_mappings),
                        num_inputs=mapping.num_inputs,
                    )
                )
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        walk(sub)

    walk(closed_jaxpr.jaxpr)
    return found


def _block_sizes(block_shape) -> list[int]:
    """Each dimension's block size: an int (Blocked) or 1 (Squeezed, a `None` in the BlockSpec,
    indexed by element). Other kinds (Element, BoundedSlice) are refused: their index maps
    return offsets of another meaning, and no kernel of ours uses them."""
    sizes = []
    for dim in block_shape:
        kind = type(dim).__name__
        if kind == "Squeezed":
            sizes.append(1)
        elif kind == "Blocked":
            sizes.append(int(dim.block_size))
        elif isinstance(dim, int):
            sizes.append(dim)
        else:
            raise ValueError(f"block dimension {dim!r} ({kind}): not checked here")
    return sizes


# Compiled index-map evaluators by the map's text: the kernels of one family share a few maps
# over grids of many sizes (the decode kernel at every cache length of a recipe), so each map
# compiles once per power-of-two program count instead of once per call and slot count.
# tests/test_pallas_blocks.py alone, one process on 2 cores (2026-12-07): 18.25 s -> 7.54 s.
_EVALUATORS: dict[tuple[str, int], Callable] = {}


def block_indices(index_map, program_ids: np.ndarray) -> np.ndarray:
    """[programs, dims]: the block index the closed jaxpr `index_map` gives at each program id."""

    def index_of(ids):
        block_index = jax.core.eval_jaxpr(index_map.jaxpr, index_map.consts, *ids)
        return jnp.stack([jnp.asarray(i, jnp.int32) for i in block_index])

    count = len(program_ids)
    padded = 1 << max(count - 1, 0).bit_length()  # rows of program 0 fill the rest
    if index_map.consts:  # values the map's text does not show: not shared
        evaluate = jax.jit(jax.vmap(index_of))
    else:
        evaluate = _EVALUATORS.setdefault((str(index_map), padded), jax.jit(jax.vmap(index_of)))
    rows = np.zeros((padded, program_ids.shape[1]), np.int32)
    rows[:count] = program_ids
    return np.asarray(evaluate(rows))[:count]


def call_overhangs(call: PallasCall) -> list[str]:
    """What overhangs in one pallas_call (empty: every block lies inside its array)."""
    problems = []
    program_ids = np.array(list(itertools.product(*(range(n) for n in call.grid))), np.int32)
    for i, mapping in enumerate(call.block_mappings):
        role = f"input {i}" if i < call.num_inputs else f"output {i - call.num_inputs}"
        where = f"{call.name} {role} {tuple(mapping.array_aval.shape)}"
        sizes = _block_sizes(mapping.block_shape)
        shape = mapping.array_aval.shape
        for d, (size, extent) in enumerate(zip(sizes, shape)):
            if extent % size:
                problems.append(f"{where}: dim {d} block {size} does not divide {extent}")
        jaxpr = mapping.index_map_jaxpr
        if len(jaxpr.jaxpr.invars) != len(call.grid):
            raise ValueError(f"{where}: its index map reads scalar-prefetch operands")

        indices = block_indices(jaxpr, program_ids)  # [programs, dims]
        starts = indices * np.array(sizes)
        ends = starts + np.array(sizes)
        outside = (starts < 0) | (ends > np.array(shape))
        for d in np.flatnonzero(outside.any(axis=0)):
            bad = program_ids[outside[:, d]]
            problems.append(
                f"{where}: dim {d} block {sizes[d]} reaches {int(ends[outside[:, d], d].max())} "
                f"of {shape[d]} at {len(bad)} of {len(program_ids)} programs "
                f"(first: program {tuple(int(x) for x in bad[0])})"
            )
    return problems


def overhangs(fn, *args) -> tuple[list[PallasCall], list[str]]:
    """(the pallas_calls `fn(*args)` traces, what overhangs in them). `args` may be
    jax.ShapeDtypeStruct: nothing is computed, and no GPU is needed."""
    calls = pallas_calls(jax.make_jaxpr(fn)(*args))
    return calls, [problem for call in calls for problem in call_overhangs(call)]
