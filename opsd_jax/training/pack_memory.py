"""Host memory for a step's packs, made ready on a background thread before the step needs it.

A 7B step's packs are ~0.6 GB of host arrays per process (the ViT patches of 8 rows of 10,240
and 4,992 patches, two micro-batches). Written into new arrays, most of the packing time is the
kernel mapping those pages in on first touch (page faults), and stacking the micro-batches
[micro, rows, ...] copies all of it once more into another new array. Both sit on the step's
path: the packs are built after the rollout's completions reach the host and before the step
can be dispatched.

`PackMemory.prepare(bucket)` makes, on one background thread, the next step's arrays already
stacked: one [micro-batches, rows, ...] array per field of each pack, filled with an empty
pack's values (so every page is touched there, off the step's path). The packer writes each
micro-batch into its slice (`StepMemory.views`, handed out once each, so it is always empty),
and `StepMemory.stack` returns the stacked array itself when every micro-batch was written into
its slice, or stacks new arrays as before when not (a pack packed twice, a field a pack made
itself): the result is the same either way.

Every step gets new arrays and none is ever reused: on a CPU device the step's input arrays
may share the numpy memory they were made from, so memory the device may still read is never
written again.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable

import jax
import numpy as np


class StepMemory:
    """One step's stacked arrays for `bucket`: `parts[i]` is part i (a Pack, or a pytree of
    arrays) with every array [micro-batches, rows, ...]."""

    def __init__(self, bucket: int, parts: list):
        self.bucket = bucket
        self.parts = parts
        self._handed: dict[int, list] = {}  # micro-batch -> the views handed out for it

    def views(self, micro: int, bucket: int) -> list | None:
        """Micro-batch `micro`'s slice of every part, if this memory is `bucket`'s and the slice
        was never handed out; else None (the packer makes new arrays)."""
        if bucket != self.bucket or micro in self._handed:
            return None
        self._handed[micro] = [jax.tree.map(lambda x: x[micro], part) for part in self.parts]
        return self._handed[micro]

    def stack(self, index: int, micro_parts: list):
        """Part `index` of every micro-batch stacked [micro, rows, ...]: each array is the
        prepared one where every micro-batch's array is the slice handed out for it, else
        np.stack of the micro-batches' arrays."""
        flat = [jax.tree_util.tree_flatten_with_path(p) for p in micro_parts]
        treedef = flat[0][1]
        prepared, handed = {}, []
        if len(self._handed) == len(micro_parts) and index < len(self.parts):
            prepared = dict(jax.tree_util.tree_flatten_with_path(self.parts[index])[0])
            handed = [
                dict(jax.tree_util.tree_flatten_with_path(self._handed[m][index])[0])
                for m in range(len(micro_parts))
            ]
        leaves = []
        for position, (path, _) in enumerate(flat[0][0]):
            arrays = [leaves_m[position][1] for leaves_m, _ in flat]
            written_in_place = path in prepared and all(
                array is handed[m].get(path) for m, array in enumerate(arrays)
            )
            leaves.append(prepared[path] if written_in_place else np.stack(arrays))
        return jax.tree_util.tree_unflatten(treedef, leaves)


class PackMemory:
    """Makes each step's `StepMemory` on a background thread: `prepare(bucket)` after a step's
    packs are on their way, `take()` when the next step packs."""

    def __init__(self, num_micro: int, empty_parts: Callable[[int], list]):
        """`empty_parts(bucket)`: one micro-batch's parts at `bucket`'s shapes, holding nothing
        (StepBatches.empty_parts): the shapes, dtypes and empty values to fill in."""
        self.num_micro = num_micro
        self.empty_parts = empty_parts
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pack-memory")
        self._next: concurrent.futures.Future | None = None

    def prepare(self, bucket: int) -> None:
        """Start making the next step's memory for `bucket` (the one the last step used)."""
        self._next = self._thread.submit(self.make, bucket)

    def wait(self) -> None:
        """Block until the prepared memory is made (a benchmark times packing apart from it)."""
        if self._next is not None:
            self._next.result()

    def take(self) -> StepMemory | None:
        """The prepared memory (waiting for the thread if it is still at work), or None when
        nothing was prepared (the first step)."""
        if self._next is None:
            return None
        memory, self._next = self._next.result(), None
        return memory

    def make(self, bucket: int) -> StepMemory:
        """A StepMemory for `bucket`, every page written (numpy's copy releases the GIL, so
        the step's own host work goes on meanwhile)."""

        def stacked(empty: np.ndarray) -> np.ndarray:
            array = np.empty((self.num_micro, *empty.shape), empty.dtype)
            array[...] = empty  # an empty pack's values in every micro-batch slice
            return array

        return StepMemory(bucket, [jax.tree.map(stacked, p) for p in self.empty_parts(bucket)])
