"""One optimizer step's micro-batches, for each training mode behind one interface.

train.py hands a step's samples (and, in OPSD, the student's sampled completions) to the mode's
`StepBatches`; it packs every micro-batch at the fixed shapes (opsd_jax/data/pack_shapes.py),
all of a step's in one length bucket that every process agrees on, stacks them and puts them
on the mesh. The same object gives the abstract batches the train step is compiled for.

- `OpsdBatches`: aligned student / teacher packs of each sampled completion;
- `SftBatches`: one CE pack (each sample in the student or, for `sft_vt_fraction` of them,
  the VT context);
- `OfflineBatches`: the text-only pack and the cached teacher at its loss entries.

Each process packs its own share of every micro-batch: samples [offset, offset + local) of it,
in `local_rows` rows (micro-batches are laid out process-major, see parallel/distributed.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from models.pack import Pack
from opsd_jax.data import sft_packs
from opsd_jax.data.opsd_packs import (
    build_training_packs,
    entry_sources,
    sampled_logprobs,
    shaped_pack,
)
from opsd_jax.parallel import distributed
from opsd_jax.training import step_flops
from opsd_jax.training.offline import views as offline_views
from opsd_jax.training.pack_memory import PackMemory, StepMemory


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """A step's micro-batches, ready for the compiled step of `bucket`."""

    bucket: int  # the length bucket (index into the config's pack shapes)
    batch: tuple  # one entry per pack: its micro-batches stacked [micro, rows, ...], on the mesh
    scalars: dict[str, float]  # what packing did: padding shares (means), cut / dropped (sums)
    tokens: int  # real tokens this process packed
    # What each pack's FLOPs depend on (step_flops.counts_of; None for a part that is no Pack,
    # the offline cache), over this process's micro-batches.
    counts: tuple = ()


class StepBatches:
    """What every mode shares: the bucket agreement, the stacking and the compile shapes."""

    pack_names: tuple[str, ...]
    # Whether `micro` packs into the memory it is given (`out`); only then is any prepared.
    packs_in_place = False

    def __init__(
        self,
        config,
        shapes: dict,
        encode,
        options,
        special,
        mesh,
        *,
        local_samples: int,
        local_rows: int,
        sample_offset: int,
    ):
        self.config, self.shapes, self.encode = config, shapes, encode
        self.options, self.special, self.mesh = options, special, mesh
        self.accum = config.gradient_accumulation_steps
        self.local_samples, self.local_rows = local_samples, local_rows
        self.sample_offset = sample_offset
        # Each step's host arrays, made on a background thread while the step before runs.
        self.memory = PackMemory(self.accum, self.empty_parts)

    def pack(
        self,
        step: int,
        samples: list,
        completions: list | None = None,
        logprobs: list | None = None,
    ) -> PackedStep:
        """Every micro-batch of the step in one length bucket (the first that fits all of them
        on every process: a micro-batch packed at a smaller one is packed again), on the mesh."""
        bucket, stacked, sums, tokens = self.host_pack(step, samples, completions, logprobs)
        batch = tuple(
            distributed.put_stacked_micro_batches(part, self.mesh, sample_offset=self.sample_offset)
            for part in stacked
        )
        if self.packs_in_place:  # the next step's memory, made while this step runs
            self.memory.prepare(bucket)
        counts = tuple(
            step_flops.counts_of(part) if isinstance(part, Pack) else None for part in stacked
        )
        return PackedStep(
            bucket=bucket, batch=batch, scalars=sums, tokens=sum(tokens), counts=counts
        )

    def host_pack(self, step: int, samples: list, completions: list | None = None, logprobs=None):
        """`pack` up to the device put: (bucket, each part's micro-batches stacked [micro, rows,
        ...] on the host, packing's scalars, tokens per micro-batch). Packs into the memory
        `self.memory` prepared, when there is some."""
        memory = self.memory.take()
        packed, buckets, sums, tokens = self._pack_all(
            step, samples, completions, logprobs, 0, memory
        )
        bucket = max(buckets)
        if self.config.pack_length_buckets > 1:
            bucket = int(distributed.all_processes(bucket).max())
            if any(b != bucket for b in buckets):
                packed, _, sums, tokens = self._pack_all(
                    step, samples, completions, logprobs, bucket, memory
                )
        stacked = [
            memory.stack(i, list(parts))
            if memory is not None
            else distributed.stack_micro_batches(list(parts))
            for i, parts in enumerate(zip(*packed))
        ]
        return bucket, stacked, sums, tokens

    def abstract_batch(self, bucket: int) -> tuple:
        """The global, sharded shapes of `pack`'s batch in `bucket` (to compile the step)."""
        return tuple(
            distributed.abstract_micro_batches(part, self.accum, self.mesh)
            for part in self.empty_parts(bucket)
        )

    def empty_parts(self, bucket: int) -> list:
        """One micro-batch's parts with nothing in them, at `bucket`'s shapes."""
        return [
            shaped_pack(
                [], self.shapes[name][bucket], self.local_rows, self.special, [], fixed=True
            )
            for name in self.pack_names
        ]

    def describe(self, bucket: int) -> str:
        """The sizes of `bucket`'s packs, for the compile line."""
        return ", ".join(
            f"{name} {self.shapes[name][bucket].row_length} tokens / "
            f"{self.shapes[name][bucket].patches} patches"
            for name in self.pack_names
        )

    def largest_shapes(self) -> dict:
        """Each pack's largest shape (the cut report names the sizes to raise)."""
        return {name: self.shapes[name][-1] for name in self.pack_names}

    def micro(
        self,
        step: int,
        micro: int,
        samples: list,
        completions: list | None,
        first_bucket: int,
        sums: dict,
        out: Callable[[int], list | None] | None = None,
        logprobs: list | None = None,
    ) -> tuple[tuple, int, int]:
        """One micro-batch -> (its parts, the bucket it fits, tokens); adds to `sums`. `out`:
        the bucket chosen (an index from `first_bucket`) -> empty arrays to pack each part
        into, or None (new ones). `logprobs`: each completion's tokens' log-probs as the
        rollout drew them (OPSD), or None."""
        raise NotImplementedError

    def _pack_all(
        self, step, samples, completions, logprobs, first_bucket, memory: StepMemory | None
    ):
        sums: dict[str, float] = {}
        packed, buckets, tokens = [], [], []
        for m in range(self.accum):
            chunk = slice(m * self.local_samples, (m + 1) * self.local_samples)
            parts, bucket, count = self.micro(
                step,
                m,
                samples[chunk],
                None if completions is None else completions[chunk],
                first_bucket,
                sums,
                None if memory is None else (lambda b, m=m: memory.views(m, first_bucket + b)),
                None if logprobs is None else logprobs[chunk],
            )
            packed.append(parts)
            buckets.append(bucket)
            tokens.append(count)
        return packed, buckets, sums, tokens

    def _add_mean(self, sums: dict, key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value / self.accum

    @staticmethod
    def _add(sums: dict, key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value


class OpsdBatches(StepBatches):
    """Visual-OPSD: the student's view and the teacher's (VT images before the completion), and
    the log-probs the rollout drew the completion tokens with, at the student's loss entries
    (opsd_packs.sampled_logprobs: the train step logs the rollout's mismatch with them). With
    teachers by data source (`sources`: the datasets' names, in the order the step's
    StepTeachers number them) a fourth part: each loss entry's source (opsd_packs.entry_sources)."""

    pack_names = ("student", "teacher")
    packs_in_place = True

    def __init__(self, *args, sources: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.source_index = {name: i for i, name in enumerate(sources)}

    def empty_parts(self, bucket):
        shape = (self.local_rows, self.shapes["student"][bucket].loss_entries)
        parts = super().empty_parts(bucket) + [np.full(shape, np.nan, np.float32)]
        return parts + ([np.full(shape, -1, np.int32)] if self.source_index else [])

    def micro(self, step, micro, samples, completions, first_bucket, sums, out=None, logprobs=None):
        del step, micro  # the packs depend only on the samples and their completions

        handed = {}  # the prepared array for the drawn log-probs, in the bucket chosen

        def given(bucket: int) -> dict | None:
            parts = None if out is None else out(bucket)
            if parts is None:
                return None
            handed["drawn"] = parts[len(self.pack_names)]
            if self.source_index:
                handed["sources"] = parts[len(self.pack_names) + 1]
            return dict(zip(self.pack_names, parts))

        packs = build_training_packs(
            samples,
            completions,
            self.encode,
            self.options,
            self.special,
            num_rows=self.local_rows,
            max_forward_tokens=self.config.max_forward_tokens,
            shapes={name: self.shapes[name][first_bucket:] for name in self.pack_names},
            out=given,
        )
        tokens = int((packs.student.segment_ids > 0).sum() + (packs.teacher.segment_ids > 0).sum())
        for name, fraction in packs.padding_fraction.items():
            self._add_mean(sums, f"pack/{name}_padding", fraction)
        self._add(sums, "pack/truncated", packs.num_truncated)
        self._add(sums, "pack/dropped", packs.num_dropped)
        parts = (
            packs.student,
            packs.teacher,
            sampled_logprobs(packs, logprobs, handed.get("drawn")),
        )
        if self.source_index:
            sources = handed.get("sources")
            packed = [samples[i] for i in packs.kept]
            parts += (entry_sources(packs.student, packed, self.source_index, out=sources),)
        return parts, first_bucket + packs.bucket, tokens


class SftBatches(StepBatches):
    """The SFT baseline: plain CE on the reference thought and answer."""

    pack_names = ("sft",)

    def micro(self, step, micro, samples, completions, first_bucket, sums, out=None, logprobs=None):
        del completions, out, logprobs  # SFT samples nothing; it packs into new arrays
        # Which samples train in the VT context: seeded by the micro-batch, so a resume agrees.
        use_vt = sft_packs.choose_vt(
            len(samples),
            self.config.sft_vt_fraction,
            self.config.global_seed,
            step * self.accum + micro,
        )
        packs = sft_packs.build_sft_packs(
            samples,
            self.encode,
            self.options,
            self.special,
            num_rows=self.local_rows,
            max_forward_tokens=self.config.max_forward_tokens,
            use_vt=use_vt,
            shapes=self.shapes["sft"][first_bucket:],
        )
        self._add_mean(sums, "pack/sft_padding", packs.padding_fraction)
        if packs.kept:  # (a micro-batch whose samples were all dropped has no context share)
            self._add_mean(sums, "pack/vt_context", sum(packs.with_vt) / len(packs.kept))
        self._add(sums, "pack/dropped", packs.num_dropped)
        return ((packs.pack,), first_bucket + packs.bucket, int((packs.pack.segment_ids > 0).sum()))


class OfflineBatches(StepBatches):
    """Offline Visual-OPSD: the text-only pack and the cached teacher (read here)."""

    pack_names = ("offline",)

    def __init__(self, *args, cache_reader: Any, sources: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.cache_reader = cache_reader
        # A cache collected per data source: each loss entry's source, a third part.
        self.source_index = {name: i for i, name in enumerate(sources)}

    def empty_parts(self, bucket):
        # The cached teacher at each loss entry: fixed [rows, entries, top-k] too.
        entries = self.shapes["offline"][bucket].loss_entries
        parts = super().empty_parts(bucket) + [
            offline_views.empty_cache(self.local_rows, entries, self.cache_reader.top_k)
        ]
        if self.source_index:
            parts.append(np.full((self.local_rows, entries), -1, np.int32))
        return parts

    def describe(self, bucket):
        return super().describe(bucket) + f", cached teacher top-{self.cache_reader.top_k}"

    def micro(self, step, micro, samples, completions, first_bucket, sums, out=None, logprobs=None):
        del step, micro, completions, out, logprobs  # nothing is sampled; it packs into new arrays
        batch = offline_views.offline_batch(
            samples,
            self.cache_reader,
            self.encode,
            self.options,
            self.special,
            num_rows=self.local_rows,
            max_forward_tokens=self.config.max_forward_tokens,
            shapes=self.shapes["offline"][first_bucket:],
        )
        self._add_mean(sums, "pack/offline_padding", batch.padding_fraction)
        self._add(sums, "pack/dropped", batch.num_dropped)
        parts = (batch.pack, batch.cache)
        if self.source_index:
            parts += (entry_sources(batch.pack, batch.packed, self.source_index),)
        return parts, first_bucket + batch.bucket, int((batch.pack.segment_ids > 0).sum())


def step_batches_for(
    mode: str, *args, cache_reader=None, sources: tuple[str, ...] = (), **kwargs
) -> StepBatches:
    """The mode's StepBatches (arguments: StepBatches'; offline also takes the cache; OPSD and
    offline the data sources the teachers are chosen by, each loss entry's source a part)."""
    if mode == "sft":
        return SftBatches(*args, **kwargs)
    if mode == "offline":
        return OfflineBatches(*args, cache_reader=cache_reader, sources=sources, **kwargs)
    return OpsdBatches(*args, sources=sources, **kwargs)
