"""Continuous batching: a fixed pool of slots over one KV cache, refilled as rows finish.

`sampler.sample` decodes a batch until its longest row ends, so at ThinkMorph's completion
lengths (mean 452 tokens before Visual-OPSD, 201 after, capped at 1024) most rows of a batch
sit finished while one runs to the cap. The engine keeps B slots busy instead:

- `insert`: waiting prompts are prefilled (images through the ViT) in the prompt buckets, a
  group of rows at a time (a power of two up to the free slots), and their cache rows and
  per-row state are written into free slots only (`pool_programs.insert_rows`); where the
  pool's rows are split over devices, each row is prefilled on the devices that hold its slot
  (`row_placement.placed_rows`), which write it in place;
- a decode chunk (`pool_programs.decode_chunk`, one jitted while loop, a CUDA graph on the GPU as the
  sampler's rounds are) runs until `chunk_steps` tokens are done, every slot has stopped, or a
  slot has stopped while prompts wait;
- on the host, a stopped row either leaves with its tokens, log-probs and rounds, or, when it
  ended a round on `<|im_end|>` with `<image_start>` in the round's text, gets `<|im_end|>`
  appended and starts its next round in the same slot (BAGEL's image-skip rounds, as
  `sampler.sample` runs them).

Prompts come as a `Pack` (one prompt per row) or as `Prompts`, rows packed on demand when
slots are free: an evaluation over thousands of image prompts never holds more than a pool's
patches on the host. Without a `prompt_length` the pool's cache grows, in the prompt buckets,
to the longest prompt inserted so far.

Same draws as `sampler.sample`: a token of a sample is drawn with
`fold_in(fold_in(fold_in(rng, round), sample id), step within the round)`, so a sample's random
draws do not depend on its slot, its neighbours, the pool size or the order prompts arrive in
(tests/test_engine.py compares the two). Its logits can depend on how many rows decode at once
(XLA, cuBLAS on the GPU, pick a matmul kernel by shape), so a bf16 greedy completion can differ
between pool sizes (on the CPU one row differed from 2, 4 or 8, which agreed bit for bit).
Compiled shapes are fixed per run: the pool (B slots of `prompt_length + max_new_tokens + rounds` cache slots), the insert
groups (powers of two up to B, and B) and the prompt buckets.

This module is the host's bookkeeping (which prompt goes into which slot, when a row leaves or
starts its next round, which batch a chunk waits for); the device programs it calls are
pool_programs.py. One module of about 460 lines: the slots, the queue and the batches that
share them change together at every insert and retire.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd

from models.pack import Pack
from opsd_jax.data.opsd_packs import bucket, bucket_in
from opsd_jax.data.packing import SpecialTokens
from opsd_jax.parallel.distributed import to_host
from opsd_jax.sampling import pool_programs, sampler
from opsd_jax.sampling.decode_copy import DecodeCopy
from opsd_jax.sampling.row_placement import own_slots, placed_rows, row_shares
from opsd_jax.sampling.sampler import Completions


@dataclasses.dataclass(frozen=True)
class Prompts:
    """`count` prompt rows, packed on demand: `pack(indices)` is a Pack of those rows (one
    left-aligned prompt per row, lengths rounded up as the caller's buckets round them)."""

    count: int
    pack: Callable[[list[int]], Pack]

    @classmethod
    def of_pack(cls, prompt_pack: Pack) -> Prompts:
        """The rows of a prompt pack (brought to the host once)."""
        sampler.check_prompt_pack(prompt_pack)
        host = jax.tree.map(to_host, prompt_pack)
        return cls(host.num_rows, lambda rows: jax.tree.map(lambda x: x[np.asarray(rows)], host))


@dataclasses.dataclass
class Batch:
    """Prompts submitted together (a step's, an evaluation's): their completions as rows
    finish, and the policy version each completion token was drawn with."""

    prompts: Prompts
    key: np.ndarray  # the key data of the rng its rows draw from
    key_impl: str
    row_ids: np.ndarray  # each row's global sample id
    out: Completions
    versions: np.ndarray  # [rows, max_new_tokens] the version of each token, -1 past the end
    remaining: int  # rows not yet finished
    on_done: Callable[[int, Completions], None] | None = None

    @property
    def done(self) -> bool:
        return self.remaining == 0


@dataclasses.dataclass
class _Row:
    """A prompt row's progress on the host."""

    batch: Batch
    index: int  # its row in the batch's prompts (the order completions are returned in)
    round_start: int = 0  # completion tokens before its current round
    # (version, completion tokens before it): where each policy version's tokens begin.
    versions: list[tuple[int, int]] = dataclasses.field(default_factory=list)


# Decode steps a chunk runs at most before the host looks at the pool (rows to retire, prompts
# waiting for a slot).
CHUNK_STEPS = 64


class Engine:
    """B slots over one KV cache; `run(prompts, rng)` samples one completion per row.

    Across calls (the training rollout's lookahead): `submit` queues a batch, `finish(batch,
    version)` decodes until that batch is done; rows of batches submitted after it take the
    slots its rows free and, when it is done, stay in their slots, paused, until a later
    `finish` continues them, with the weights `swap` gave it by then."""

    def __init__(
        self,
        model: nnx.Module | DecodeCopy,
        *,
        pool_size: int,
        special: SpecialTokens,
        vocab_limit: int,
        max_new_tokens: int,
        prompt_length: int | None = None,
        temperature: float = 1.0,
        do_sample: bool = True,
        max_image_skips: int = 0,
        decode_text: Callable[[list[int]], str] | None = None,
        cache_dtype: str = "bfloat16",
        chunk_steps: int = CHUNK_STEPS,
        prompt_buckets: Sequence[int] | None = None,
        prefill_rows: int | None = None,
    ):
        """model: a `DecodeCopy` (run under its mesh and rules) or an nnx model (run as it is).
        prompt_length: the longest prompt row the pool takes (its cache has
        `sampler.cache_slots_for(prompt_length, max_new_tokens, max_image_skips)` slots a row);
        None: the cache grows to the longest (bucketed) prompt inserted so far.
        chunk_steps: decode steps per chunk at most (the host looks at the pool between chunks).
        prompt_buckets: row lengths a prefill group is cut to (default: powers of two).
        prefill_rows: prompts prefilled at once at most (None: as many as there are free
        slots); the groups after the first are inserted into the pool, whose cache is beside
        their prefill, so a smaller group lowers the largest prefill's activations."""
        sampler.check_settings(max_new_tokens, temperature, do_sample, max_image_skips, decode_text)
        if pool_size < 1 or chunk_steps < 1:
            raise ValueError(f"pool_size and chunk_steps must be >= 1: {pool_size}, {chunk_steps}")
        if prefill_rows is not None and prefill_rows < 1:
            raise ValueError(f"prefill_rows must be >= 1 (or None): {prefill_rows}")
        self.prefill_rows = prefill_rows
        self.swap(model)
        self.pool_size, self.special, self.chunk_steps = pool_size, special, chunk_steps
        self.max_new_tokens, self.max_image_skips = max_new_tokens, max_image_skips
        self.decode_text, self.cache_dtype = decode_text, jnp.dtype(cache_dtype)
        self.prompt_length = prompt_length
        self.cache_slots = (
            0
            if prompt_length is None
            else sampler.cache_slots_for(prompt_length, max_new_tokens, max_image_skips)
        )
        self.buckets = sorted(prompt_buckets) if prompt_buckets else None
        self.settings = sampler.round_settings(
            special, vocab_limit, max_new_tokens, temperature, do_sample
        )
        self.shapes: set[tuple] = set()  # (group rows, row length, patches) prefilled so far
        self.pool_shapes: set[int] = set()  # cache slots per row the pool has had
        self.decode_steps = 0  # decode steps run (each advances every active slot by a token)
        self.busy_slot_steps = 0  # of them, slot-steps that drew a token (occupied slots)
        self._pool = None  # made at an insert into an empty engine, dropped when it empties
        self._slots: list[_Row | None] = [None] * pool_size
        self._waiting: collections.deque[tuple[Batch, int]] = collections.deque()

    def swap(self, model: nnx.Module | DecodeCopy) -> None:
        """Decode with `model` from now on (new weights; rows in the pool keep their cache)."""
        self.graphdef, self.params, self._context = sampler.model_parts(model)

    @property
    def busy_slots(self) -> int:
        """Slots holding a row (decoding, or paused between `finish` calls)."""
        return sum(row is not None for row in self._slots)

    # ---- the host loop ---------------------------------------------------------------------

    def run(
        self,
        prompts: Pack | Prompts,
        rng: jax.Array,
        row_ids=None,
        on_done: Callable[[int, Completions], None] | None = None,
    ) -> Completions:
        """One completion per prompt row, in row order (the same as `sampler.sample`'s for the
        same rng and row ids; row_ids: each row's global sample id, default 0..R-1).
        on_done(index, completions): called as each row's completion is written into the
        returned `Completions` (rows finish in any order)."""
        return self.finish(self.submit(prompts, rng, row_ids, on_done)).out

    def submit(
        self,
        prompts: Pack | Prompts,
        rng: jax.Array,
        row_ids=None,
        on_done: Callable[[int, Completions], None] | None = None,
    ) -> Batch:
        """Queue `prompts` (after every batch submitted before); they decode in `finish`."""
        if isinstance(prompts, Pack):
            prompts = Prompts.of_pack(prompts)
        rows = prompts.count
        if rows < 1:
            raise ValueError("Engine.submit(): no prompts")
        row_ids = np.arange(rows) if row_ids is None else np.asarray(row_ids)
        if row_ids.shape != (rows,):
            raise ValueError(f"row_ids has shape {row_ids.shape}, expected ({rows},)")
        if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)  # a raw uint32 key (jax.random.PRNGKey)
        batch = Batch(
            prompts=prompts,
            key=np.asarray(jax.random.key_data(rng)),
            key_impl=str(jax.random.key_impl(rng)),
            row_ids=row_ids,
            out=Completions(
                tokens=np.zeros((rows, self.max_new_tokens), np.int32),
                lengths=np.zeros(rows, np.int32),
                logprobs=np.zeros((rows, self.max_new_tokens), np.float32),
                finished=np.zeros(rows, bool),
                rounds=np.ones(rows, np.int32),
            ),
            versions=np.full((rows, self.max_new_tokens), -1, np.int32),
            remaining=rows,
            on_done=on_done,
        )
        self._waiting.extend((batch, i) for i in range(rows))
        return batch

    def finish(self, batch: Batch, version: int = 0) -> Batch:
        """Decode until every row of `batch` has finished, with the current weights (policy
        `version`); rows queued after it fill the slots its rows free, and pause when it is done."""
        with self._context():
            rules = tuple(spmd.get_logical_axis_rules())
            self._continue_paused(version)
            while not batch.done:
                free = [s for s, row in enumerate(self._slots) if row is None]
                while self._waiting and free:
                    self._insert(free, version, rules)
                    if self.prefill_rows is None:
                        break  # one group a chunk: it took every free slot of its batch
                    free = [s for s, row in enumerate(self._slots) if row is None]
                self._pool, steps, busy = pool_programs.decode_chunk(
                    self.graphdef,
                    self.params,
                    self._pool,
                    batch.key_impl,
                    self.settings,
                    self.chunk_steps,
                    self._watched(batch),
                    rules,
                )
                self.decode_steps += int(to_host(steps))
                self.busy_slot_steps += int(to_host(busy))
                self._retire(rules)
            if not self.busy_slots:
                self._pool = None  # nothing paused: its cache is freed until the next insert
        return batch

    def _watched(self, batch: Batch) -> np.ndarray:
        """The slots whose row's end sends the chunk back to the host: any while a prompt waits
        for a slot; `batch`'s while later batches' rows share the pool (they pause when it is
        done); none when the pool holds `batch` alone (it ends when its rows have)."""
        if self._waiting:
            return np.ones(self.pool_size, bool)
        mine = np.array([row is not None and row.batch is batch for row in self._slots])
        others = any(row is not None and row.batch is not batch for row in self._slots)
        return mine if others else np.zeros(self.pool_size, bool)

    def _continue_paused(self, version: int) -> None:
        """Rows left in their slots by an earlier `finish`: their next tokens are `version`'s."""
        if not self.busy_slots:
            return
        lengths = to_host(self._pool.decode.length)
        for s, row in enumerate(self._slots):
            if row is not None and row.versions[-1][0] != version:
                row.versions.append((version, int(lengths[s])))

    def _check_length(self, longest: int) -> None:
        if self.prompt_length is not None and longest > self.prompt_length:
            raise ValueError(
                f"a prompt of {longest} tokens is longer than the engine's prompt_length "
                f"{self.prompt_length}"
            )

    def _insert(self, free, version: int, rules) -> None:
        """Prefill waiting prompts of one batch into free slots (placed_rows: a power of two
        of rows or the whole pool, each on the devices that hold its slot; padding rows repeat
        the first and are dropped), cut to the group's bucket."""
        batch = self._waiting[0][0]
        group = []
        most = min(len(free), self.prefill_rows or len(free))
        while self._waiting and self._waiting[0][0] is batch and len(group) < most:
            group.append(self._waiting.popleft()[1])
        shares = row_shares(self.pool_size)
        placed = placed_rows(free, len(group), shares, self.pool_size)
        local = None  # rows not on their slots' devices: the scatter, which XLA partitions
        if row_shares(len(placed)) == shares:  # the prefilled rows split as the pool's
            local = np.array(own_slots(placed, shares, self.pool_size), np.int32)
        else:
            placed = placed_rows(free, len(group), 1, self.pool_size)
        size = len(placed)
        slots = np.array([slot for _, slot in placed], np.int32)
        built = jax.tree.map(to_host, batch.prompts.pack(group))
        sampler.check_prompt_pack(built)
        pad = np.array([0 if place is None else place for place, _ in placed])
        sub = _cut_to_bucket(jax.tree.map(lambda x: x[pad], built), self.buckets)
        self._check_length(int((sub.segment_ids > 0).sum(axis=1).max()))
        self.shapes.add((size, sub.row_length, sub.vit_patches.shape[1] if sub.has_images else 0))
        needed = sampler.cache_slots_for(sub.row_length, self.max_new_tokens, self.max_image_skips)
        grow = self._pool is not None and needed > self.cache_slots
        self.cache_slots = max(self.cache_slots, needed)
        # The pool grows before the prefill, not after: the grown copy is made from the old
        # pool while neither holds the prefilled rows' cache beside them. Rows in the pool keep
        # their cache: a row reads its first kv_length slots.
        if grow:
            self._pool = pool_programs.grown(self._pool, self.cache_slots, rules)
        prefilled = sampler.prefill_rows(
            self.graphdef,
            self.params,
            sub,
            self.max_new_tokens,
            self.cache_slots,
            self.cache_dtype,
            rules,
        )
        self.pool_shapes.add(self.cache_slots)
        ids = batch.row_ids[np.asarray(group)[pad]].astype(np.int32)
        if self._pool is None and np.array_equal(slots, np.arange(self.pool_size)):
            # Every slot, in order (an empty pool's are free in order): the rows become the
            # pool, with no second cache beside them (a rollout's step without lookahead).
            self._pool = pool_programs.pool_of_rows(
                prefilled, ids, batch.key, self.special.im_start, rules
            )
        else:
            if self._pool is None:  # the cache's layout read from the prefilled rows'
                layers, _, cache_slots, two, kv_heads, head_dim = prefilled.cache.shape
                shape = (layers, self.pool_size, cache_slots, two, kv_heads, head_dim)
                self._pool = pool_programs.empty_pool(
                    self.pool_size,
                    shape,
                    self.max_new_tokens,
                    self.cache_dtype,
                    batch.key.shape,
                    rules,
                )
            self._pool = pool_programs.insert_rows(
                self._pool, prefilled, slots, ids, batch.key, self.special.im_start, rules, local
            )
        for place, slot in placed:
            if place is not None:
                self._slots[slot] = _Row(batch, group[place], versions=[(version, 0)])

    def _retire(self, rules) -> None:
        """Rows that stopped in the last chunk: the next image-skip round in their slot, or
        their completion out (with its tokens' versions) and the slot freed."""
        pool = self._pool
        decode = pool.decode
        active, finished, length, budget, rounds = map(
            to_host, (decode.active, decode.finished, decode.length, decode.budget, pool.round)
        )
        stopped = [s for s, row in enumerate(self._slots) if row is not None and not active[s]]
        if not stopped:
            return
        tokens, logprobs = to_host(decode.tokens), to_host(decode.logprobs)
        skip = np.zeros(self.pool_size, bool)
        for s in stopped:
            row = self._slots[s]
            if rounds[s] < self.max_image_skips and sampler.wants_image_skip(
                finished[s], budget[s], tokens[s, row.round_start : length[s]], self.decode_text
            ):
                skip[s] = True
                row.round_start = int(length[s])
                continue
            i, batch = row.index, row.batch
            out = batch.out
            out.tokens[i], out.logprobs[i] = tokens[s], logprobs[s]
            out.lengths[i], out.finished[i] = length[s], finished[s]
            out.rounds[i] = rounds[s] + 1
            for (version, begin), (_, end) in zip(row.versions, row.versions[1:] + [(0, None)]):
                batch.versions[i, begin : length[s] if end is None else end] = version
            batch.remaining -= 1
            self._slots[s] = None
            if batch.on_done is not None:
                batch.on_done(i, out)
        if skip.any():
            self._pool = pool_programs.next_round(
                self.graphdef, self.params, pool, skip, self.settings, rules
            )


def settings_for(
    tokenizer, max_new_tokens, do_sample, temperature, max_image_skips, cache_dtype
) -> dict:
    """The `Engine`'s sampling arguments for a `BagelTokenizer` (its special ids, its length as
    the vocabulary limit, its decode for image skips) and the given settings."""
    return {
        "special": tokenizer.special_tokens(),
        "vocab_limit": tokenizer.vocab_length,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "do_sample": do_sample,
        "max_image_skips": max_image_skips,
        "decode_text": tokenizer.decode,
        "cache_dtype": cache_dtype,
    }


def stream(
    model: nnx.Module | DecodeCopy,
    prompts: Pack | Prompts,
    rng: jax.Array,
    *,
    pool_size: int,
    row_ids=None,
    on_done: Callable[[int, Completions], None] | None = None,
    **settings,
) -> Completions:
    """A completion for every prompt through an engine of `pool_size` slots (fewer when there
    are fewer prompts); `settings`: the `Engine`'s other arguments. The evaluation's sampler."""
    count = prompts.num_rows if isinstance(prompts, Pack) else prompts.count
    engine = Engine(model, pool_size=max(1, min(pool_size, count)), **settings)
    return engine.run(prompts, rng, row_ids=row_ids, on_done=on_done)


def _cut_to_bucket(pack: Pack, buckets: Sequence[int] | None) -> Pack:
    """`pack` (left-aligned prompt rows) cut, as `prompt_pack_of` rounds prompts, to the least
    bucket that holds its longest row and its patches (never past the pack's own sizes)."""
    round_up = bucket if buckets is None else (lambda n: bucket_in(n, buckets))
    longest = int((pack.segment_ids > 0).sum(axis=1).max())
    length = min(round_up(longest), pack.row_length)
    pack = pack.replace(
        **{
            name: getattr(pack, name)[:, :length]
            for name in ("tokens", "positions", "segment_ids", "k_start", "k_end", "gen_mask")
            if getattr(pack, name) is not None
        }
    )
    if pack.has_images:
        patches = int((pack.vit_image_ids > 0).sum(axis=1).max())
        count = min(round_up(patches), pack.vit_patches.shape[1])
        pack = pack.replace(
            **{
                name: getattr(pack, name)[:, :count]
                for name in ("vit_patches", "vit_pos_ids", "vit_slots", "vit_image_ids")
            }
        )
    return pack
