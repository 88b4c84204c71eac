"""The continuous-batching engine (opsd_jax/sampling/engine.py) against `sampler.sample`: the same
completions for any pool size and arrival order, image-skip rounds in their slot, fewer decode
steps than static batches when lengths differ, and a bounded set of compiled shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampler import (
    SKIP_ID,
    SPECIAL,
    VOCAB_LIMIT,
    ScriptedModel,
    prompt_pack,
    prompts,
    scripted_pack,
    scripted_settings,
)

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.data.packing import Text
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.programs import gpu_target
from opsd_jax.run_config import preflight_sampling
from opsd_jax.sampling import decode_copy, pool_programs, sampler
from opsd_jax.sampling import engine as engine_lib
from opsd_jax.sampling.row_placement import own_slots, placed_rows

from flax import nnx  # isort: skip

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return Bagel(BagelConfig.tiny(llm=dict(compute_dtype="float32")), rngs=nnx.Rngs(0))


def run_engine(model, pack, *, pool_size, row_ids=None, **kwargs):
    settings = dict(
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=NEW_TOKENS,
        cache_dtype="float32",
        prompt_length=pack.row_length,
    )
    settings.update(kwargs)
    engine = engine_lib.Engine(model, pool_size=pool_size, chunk_steps=4, **settings)
    return engine, engine.run(pack, jax.random.key(3), row_ids=row_ids)


@pytest.mark.parametrize("do_sample", [False, True])
def test_completions_equal_the_sampler_for_any_pool_and_arrival_order(model, do_sample):
    samples = prompts(0) + prompts(1)  # 6 prompts, with and without images
    want = sampler.sample(
        model,
        prompt_pack(samples),
        jax.random.key(3),
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=NEW_TOKENS,
        do_sample=do_sample,
        cache_dtype="float32",
    )
    order = np.array([4, 1, 5, 0, 3, 2])  # the second arrival order
    for pool_size in (1, 3, 8):
        for arrival in (np.arange(6), order):
            pack = prompt_pack([samples[i] for i in arrival])
            _, got = run_engine(
                model, pack, pool_size=pool_size, row_ids=arrival, do_sample=do_sample
            )
            for row, sample in enumerate(arrival):
                where = f"pool {pool_size}, arrival {arrival.tolist()}, sample {sample}"
                assert got.row(row) == want.row(sample), where
                np.testing.assert_allclose(
                    got.logprobs[row, : got.lengths[row]],
                    want.logprobs[sample, : want.lengths[sample]],
                    atol=1e-5,
                    err_msg=where,
                )
                assert got.finished[row] == want.finished[sample], where
                assert got.rounds[row] == want.rounds[sample], where


def test_prompts_prefilled_in_groups_sample_what_one_prefill_samples(model, monkeypatch):
    """rollout_prefill_rows: 6 prompts into 8 slots, prefilled 2 at a time, are the sampler's
    completions; every group after the first is inserted into the pool, no prefill holds more
    than 2 rows, and all of them are in the pool before the first decode chunk."""
    samples = prompts(0) + prompts(1)
    pack = prompt_pack(samples)
    settings = dict(special=SPECIAL, vocab_limit=VOCAB_LIMIT, max_new_tokens=NEW_TOKENS)
    want = sampler.sample(model, pack, jax.random.key(3), cache_dtype="float32", **settings)
    programs = record_programs(monkeypatch)
    engine, got = run_engine(model, pack, pool_size=8, prefill_rows=2)
    for row in range(6):
        assert got.row(row) == want.row(row), row
        np.testing.assert_allclose(
            got.logprobs[row, : got.lengths[row]],
            want.logprobs[row, : want.lengths[row]],
            atol=1e-5,
        )
    assert {rows for rows, _, _ in engine.shapes} == {2}, engine.shapes
    first_chunk = programs.index("decode_chunk")
    assert programs[:first_chunk].count("prefill_rows") == 3, programs
    assert programs[:first_chunk].count("insert_rows") == 3 and "pool_of_rows" not in programs
    with pytest.raises(ValueError, match="prefill_rows must be >= 1"):
        run_engine(model, pack, pool_size=8, prefill_rows=0)


def test_each_row_is_dealt_to_the_share_that_holds_its_slot():
    """placed_rows with the pool's 4 slots in 2 shares (slots 0-1, 2-3) and a prefill of R
    rows in 2 shares (rows 0 .. R/2 - 1, then the rest): every row's slot lies in its row's
    share, each free slot taken at most once, padding rows dropped (slot 4)."""
    # slot 0 busy: share 0 has slot 1 free, share 1 both; three prompts
    assert placed_rows([1, 2, 3], 3, 2, 4) == [(0, 1), (None, 4), (1, 2), (2, 3)]
    # each row's slot within its share (slots 2, 3 are share 1's 0, 1; padding past it: 2)
    assert own_slots([(0, 1), (None, 4), (1, 2), (2, 3)], 2, 4) == [1, 2, 0, 1]
    assert placed_rows([0, 1, 2, 3], 4, 2, 4) == [(0, 0), (2, 1), (1, 2), (3, 3)]
    assert placed_rows([3], 1, 2, 4) == [(None, 4), (0, 3)]
    assert placed_rows([1, 3], 2, 1, 4) == [(0, 1), (1, 3)]  # one share: in order
    for free, count in (([0, 2, 3], 2), ([1, 2, 3], 3), ([2, 3], 2), ([0, 1, 2, 3], 3)):
        rows = placed_rows(free, count, 2, 4)
        per_share = len(rows) // 2
        real = [(r, place, slot) for r, (place, slot) in enumerate(rows) if place is not None]
        assert sorted(place for _, place, _ in real) == list(range(count))
        assert all(slot in free and slot // 2 == r // per_share for r, _, slot in real)
        assert len({slot for _, _, slot in real}) == count


def test_rows_split_over_devices_are_written_where_they_were_prefilled(monkeypatch):
    """The pool's 4 slots over 2 devices (a 'replicated' decode copy: slots 0-1 on one, 2-3 on
    the other) and 8 prompts of the scripted model (which reads its tokens from its own
    cache), their lengths such that the rows freeing slots at once are both on one device:
    the next two prompts are both dealt to that device, with two padding rows on the other,
    each device writes its rows into its own slots (insert_rows' `local_slots`), and the
    completions equal one device's sampler's."""
    eos = SPECIAL.im_end
    scripts = [[7, 8, eos], [9, 10, 11, 12, 13, eos], [15, 16, eos], [17, 18, 19, 20, 21, eos]]
    scripts += [[22, 23, 24, 25, 26, 27, 28, eos], [29, 30, 31, 32, 33, 34, 35, eos]]
    scripts += [[36, 37, eos], [38, eos]]
    settings = scripted_settings(8, 0)
    want = sampler.sample(ScriptedModel(scripts), scripted_pack(8), jax.random.key(0), **settings)
    graphdef, state = nnx.split(ScriptedModel(scripts))
    copy = decode_copy.make_decode_copy(
        graphdef,
        state,
        layout="replicated",
        mesh=mesh_lib.make_mesh(devices=jax.devices()[:2]),
        dtype=jnp.float32,
    )
    inserts = []
    insert_rows = pool_programs.insert_rows

    def recorded(pool, rows, slots, *args):
        inserts.append((np.asarray(slots).tolist(), np.asarray(args[-1]).tolist()))
        return insert_rows(pool, rows, slots, *args)

    monkeypatch.setattr(pool_programs, "insert_rows", recorded)
    del settings["do_sample"]
    engine = engine_lib.Engine(copy, pool_size=4, chunk_steps=2, prompt_length=4, **settings)
    got = engine.run(scripted_pack(8), jax.random.key(0))
    # The empty pool's dealing: prompts 0, 1, 2, 3 in slots 0, 2, 1, 3. Prompts 0 and 2 end
    # first: 4 and 5 go to slots 0 and 1, the first device's, as rows 0 and 1 of 4; then 1
    # and 3 end: 6 and 7 go to slots 2 and 3, the second device's slots 0 and 1.
    assert inserts == [([0, 1, 4, 4], [0, 1, 2, 2]), ([4, 4, 2, 3], [2, 2, 0, 1])], inserts
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)


def test_lazy_prompts_grow_the_pool_under_a_decoding_row(monkeypatch):
    """Prompts packed on demand and no prompt_length: two short prompts fill the pool's two
    slots; the second ends after one token, and the long prompt that takes its slot grows the
    cache from the 16-token bucket's slots (128) to the 128-token bucket's (256) while the
    first row still decodes. Every completion is still the sampler's, and on_done sees each
    row once, when it is written."""
    eos = SPECIAL.im_end
    scripts = [[9] * 10 + [eos], [7, eos], [8, 8, eos]]
    prompt_tokens = [[0], [1], [2] + [3] * 119]  # the script's id first, then filler
    samples = [[Text(tokens)] for tokens in prompt_tokens]
    model = ScriptedModel(scripts)
    settings = scripted_settings(max_new_tokens=12, max_image_skips=0)
    want = sampler.sample(model, prompt_pack(samples, 128), jax.random.key(0), **settings)
    asked, done, active_when_grown = [], [], []

    def pack_rows(rows):
        asked.append(list(rows))
        return prompt_pack([samples[i] for i in rows], row_length=128)

    def on_done(index, out):
        assert out.row(index) == want.row(index)  # written before the call
        done.append(index)

    programs = record_programs(monkeypatch)
    grown = pool_programs.grown

    def spy(pool, *args):
        active_when_grown.append(np.asarray(pool.decode.active).tolist())
        return grown(pool, *args)

    monkeypatch.setattr(pool_programs, "grown", spy)
    engine = engine_lib.Engine(model, pool_size=2, chunk_steps=4, **settings)
    got = engine.run(engine_lib.Prompts(3, pack_rows), jax.random.key(0), on_done=on_done)
    assert [got.row(r) for r in range(3)] == [want.row(r) for r in range(3)]
    assert got.row(0) == [9] * 10 and got.row(2) == [8, 8]  # the scripts, as a check
    assert sorted(done) == [0, 1, 2] and sorted(sum(asked, [])) == [0, 1, 2]
    assert active_when_grown == [[True, False]], active_when_grown
    # The pool grows before the long prompt's prefill, so that the old pool, the grown one and
    # the prefilled rows' cache are never on the device at once.
    assert "grown" in programs
    assert programs[programs.index("grown") + 1] == "prefill_rows", programs
    unaccounted = set(programs) - set(preflight_sampling.ENGINE_PROGRAMS)
    assert not unaccounted, f"the preflight does not count {unaccounted}"
    assert engine.pool_shapes == {sampler.cache_slots_for(16, 12), sampler.cache_slots_for(128, 12)}
    assert engine.pool_shapes == {128, 256}


def record_programs(monkeypatch, arguments: list | None = None) -> list[str]:
    """The names of the jitted programs of the engine's modules, in the order they are called
    from now on (each wrapped, under monkeypatch, to append its name); with `arguments`, each
    call's (name, program, positional arguments) are appended there too."""
    calls = []
    for module in (pool_programs, sampler):
        for name, program in list(vars(module).items()):
            if callable(program) and hasattr(program, "lower"):

                def spy(*args, _program=program, _name=name, **kwargs):
                    calls.append(_name)
                    if arguments is not None:
                        arguments.append((_name, _program, args))
                    return _program(*args, **kwargs)

                monkeypatch.setattr(module, name, spy)
    return calls


def run_scripted(scripts, pool_size, max_new_tokens, max_image_skips=0):
    settings = scripted_settings(max_new_tokens, max_image_skips)
    pack = scripted_pack(len(scripts))
    model = ScriptedModel(scripts)
    engine = engine_lib.Engine(
        model, pool_size=pool_size, prompt_length=pack.row_length, chunk_steps=8, **settings
    )
    got = engine.run(pack, jax.random.key(0))
    want = sampler.sample(model, pack, jax.random.key(0), **settings)
    return engine, got, want


@pytest.mark.parametrize("pool_size", [1, 2, 4])
def test_image_skip_rounds_continue_in_their_slot(pool_size):
    eos = SPECIAL.im_end
    scripts = [
        [7, SKIP_ID, eos, 11, 12, eos],  # skip: <image_start> then EOS -> a second round
        [7, 8, eos],  # no <image_start>: no skip
        [SKIP_ID, eos, 13, 13, 13, 13, 13, 13],  # skip, then the budget runs out mid-round
        [7, SKIP_ID, eos, SKIP_ID, eos, 14, eos],  # a second skip exceeds max_image_skips=1
    ]
    _, got, want = run_scripted(scripts, pool_size, max_new_tokens=6, max_image_skips=1)
    assert got.row(0) == [7, SKIP_ID, 11, 12] and got.rounds[0] == 2  # the sampler's, as tested
    for row in range(len(scripts)):
        assert got.row(row) == want.row(row), row
        assert (got.finished[row], got.rounds[row]) == (want.finished[row], want.rounds[row])


def test_every_program_the_engine_runs_is_one_the_preflight_counts(monkeypatch):
    """Three prompts with an image skip, in two slots and in four: the engine fills an empty
    pool, refills a slot, inserts into an empty pool, decodes and starts a next round;
    train.py --compile_only must count each program's memory (preflight_sampling.ENGINE_PROGRAMS),
    so a new engine program fails here until it does."""
    eos = SPECIAL.im_end
    scripts = [[7, SKIP_ID, eos, 11, eos], [7, 8, eos], [9, eos]]
    settings = scripted_settings(max_new_tokens=6, max_image_skips=1)
    pack = scripted_pack(len(scripts))
    programs = record_programs(monkeypatch)
    # Two slots: the first two prompts fill the empty pool, the third takes a freed slot. Four:
    # three prompts and a padding row go into an empty pool.
    for pool_size in (2, 4):
        engine = engine_lib.Engine(
            ScriptedModel(scripts),
            pool_size=pool_size,
            prompt_length=pack.row_length,
            chunk_steps=8,
            **settings,
        )
        got = engine.run(pack, jax.random.key(0))
        assert got.row(0) == [7, SKIP_ID, 11] and got.rounds[0] == 2  # the skip happened
    wanted = {"prefill_rows", "pool_of_rows", "empty_pool", "insert_rows", "decode_chunk"}
    assert wanted | {"next_round"} <= set(programs), programs
    unaccounted = set(programs) - set(preflight_sampling.ENGINE_PROGRAMS)
    assert not unaccounted, f"the preflight does not count {unaccounted}"


class ScriptedModelWithIdleWeights(ScriptedModel):
    """ScriptedModel with a weight no program reads, as the decode round never reads the ViT."""

    def __init__(self, scripts):
        super().__init__(scripts)
        self.idle = nnx.Param(jnp.ones((64, 64), jnp.float32))


def test_programs_given_the_weights_keep_all_of_them_as_arguments(monkeypatch):
    """jit drops an argument its program does not read, and the program's peak then leaves out
    weights that are on the device all the same (the 7B prefill does not read the copy's
    lm_head, the decode chunk not the ViT): the preflight's figure would be short by them. Each
    engine program that takes the weights is compiled here with the arguments of its call and
    must count every weight byte among its arguments (the prefill reads no weight at all here)."""
    eos = SPECIAL.im_end
    model = ScriptedModelWithIdleWeights([[7, SKIP_ID, eos, 11, eos], [7, 8, eos]])
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    calls = []
    record_programs(monkeypatch, calls)
    pack = scripted_pack(2)
    settings = scripted_settings(max_new_tokens=6, max_image_skips=1)
    engine = engine_lib.Engine(model, pool_size=2, prompt_length=pack.row_length, **settings)
    assert engine.run(pack, jax.random.key(0)).rounds[0] == 2  # the skip happened
    given_weights = {}
    for name, program, args in calls:
        if len(args) > 1 and args[1] is engine.params:
            kept = program.lower(*args).compile().memory_analysis().argument_size_in_bytes
            given_weights[name] = kept
    assert {"prefill_rows", "decode_chunk", "next_round"} <= set(given_weights), calls
    short = {name: kept for name, kept in given_weights.items() if kept < weights}
    assert not short, f"arguments of fewer bytes than the {weights} bytes of weights: {short}"


def test_rows_are_written_into_the_pools_cache_as_jaxs_scatter_writes_them():
    """pool_programs.write_rows against `cache.at[:, slots].set(rows, mode="drop")`: padding
    rows (slot == pool size) are dropped, whatever slot 0 holds."""
    rng = np.random.default_rng(0)
    cache = rng.normal(size=(3, 6, 5, 2)).astype(np.float32)  # [L, B, S, ...], slot 0 busy
    rows = rng.normal(size=(3, 4, 5, 2)).astype(np.float32)
    for slots in ([2, 5, 6, 6], [0, 1, 2, 3], [4, 6, 6, 6]):
        slots = np.array(slots, np.int32)
        want = jnp.asarray(cache).at[:, slots].set(rows, mode="drop")
        got = jax.jit(pool_programs.write_rows)(cache, rows, slots)
        np.testing.assert_array_equal(got, want, err_msg=str(slots))


def test_rows_that_fill_an_empty_pool_make_the_pool_an_insert_makes():
    """pool_of_rows (the rows' state becomes the pool's) against empty_pool then insert_rows
    into every slot in order: the same pool, field by field."""
    rng = np.random.default_rng(1)
    rows, slots, new_tokens = 4, 6, 3

    def prefilled():
        ints = lambda *shape: jnp.asarray(rng.integers(0, 9, shape), jnp.int32)  # noqa: E731
        return sampler.DecodeState(
            cache=jnp.asarray(rng.normal(size=(2, rows, slots, 2, 1, 4)), jnp.float32),
            kv_length=ints(rows),
            rope=ints(rows),
            tokens=ints(rows, new_tokens),
            logprobs=jnp.asarray(rng.normal(size=(rows, new_tokens)), jnp.float32),
            length=ints(rows),
            budget=ints(rows),
            active=jnp.asarray(rng.integers(0, 2, rows), bool),
            finished=jnp.asarray(rng.integers(0, 2, rows), bool),
        )

    state = prefilled()
    ids = np.array([5, 2, 7, 1], np.int32)
    key = np.array([3, 4], np.uint32)
    empty = pool_programs.empty_pool(rows, state.cache.shape, new_tokens, jnp.float32, key.shape)
    want = pool_programs.insert_rows(empty, state, np.arange(rows, dtype=np.int32), ids, key, 1)
    copy = jax.tree.map(jnp.copy, state)  # pool_of_rows donates its rows
    got = pool_programs.pool_of_rows(copy, ids, key, 1)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_compiled_for_a_gpu_the_insert_writes_the_pools_cache_in_place():
    """jax 0.12's XLA:GPU makes the scatter along the cache's row axis two transposes of the
    whole cache with a cache-sized temp between them (0.11.2's does not); write_rows writes
    each row in place under both."""
    mesh = gpu_target.make_mesh("h100", 1)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    cache = jax.ShapeDtypeStruct((4, 8, 1024, 2, 4, 128), jnp.bfloat16, sharding=replicated)
    slots = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=replicated)
    size = 4 * 8 * 1024 * 2 * 4 * 128 * 2

    def temp(write):
        lowered = jax.jit(write, donate_argnums=0).lower(cache, cache, slots)
        return gpu_target.compile(lowered, mesh).memory_analysis().temp_size_in_bytes

    if jax.__version_info__ >= (0, 12):
        assert temp(lambda c, r, s: c.at[:, s].set(r, mode="drop")) >= size  # the old insert
    assert temp(pool_programs.write_rows) < size // 100


def test_compiled_for_8_gpus_each_device_writes_its_own_rows_into_its_own_slots():
    """The paper recipe's pool in its 'tensor' decode layout on 8 H100s (rows over 2 shares,
    kv heads over 4; 2 of its 28 layers): with the rows placed on their slots' devices
    (`local_slots`), the insert gathers no cache row and has no temp; the scatter it replaces
    gathers the rows first (a temp of 4 devices' shares of the cache)."""
    from models.sharding import logical_spec

    rows, slots, layers = 16, 7296, 2
    view = mesh_lib.decode_mesh(gpu_target.make_mesh("h100", 8), "tensor", 4)
    rules = mesh_lib.DECODE_RULES

    def laid_out(shape, names):
        return jax.sharding.NamedSharding(view, logical_spec(shape, names, view, rules))

    state = sampler.abstract_decode_state(
        sampler.cache_shape_for(layers, rows, slots, 4, 128), 8, laid_out, jnp.bfloat16
    )
    pool = pool_programs.abstract_pool(state, laid_out)
    whole = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=laid_out(shape, (None,)))  # noqa: E731
    own = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=laid_out((rows,), ("act_batch",)))
    share = layers * (rows // 2) * slots * 2 * 128 * 2  # a device's share of the cache, bytes

    def compiled(local):
        """(the insert's temp bytes, its all-gathers of cache rows)"""
        with mesh_lib.use_mesh(view, rules):
            lowered = pool_programs.insert_rows.lower(
                pool, state, whole(rows), whole(rows), whole(2), 1, rules, local
            )
        program = gpu_target.compile(lowered, view)
        text = program.as_text().splitlines()
        gathers = [line for line in text if "all-gather-start" in line and f",{slots}," in line]
        return program.memory_analysis().temp_size_in_bytes, gathers

    temp, gathers = compiled(own)
    assert temp < share // 100 and not gathers, gathers
    temp, gathers = compiled(None)
    assert temp >= share and gathers


def test_a_freed_slot_is_refilled_before_the_longest_row_ends():
    """Rows of 1 and 11 tokens, two slots: static batches of two decode 12 steps each (the
    longer row and its <|im_start|>), the engine refills the short rows' slot as they end."""
    eos = SPECIAL.im_end
    short, long = [7, eos], [9] * 11 + [eos]
    scripts = [short, long, short, long, short, long]
    engine, got, want = run_scripted(scripts, pool_size=2, max_new_tokens=12)
    assert [got.row(r) for r in range(6)] == [want.row(r) for r in range(6)]
    static_steps = 3 * 12
    assert engine.decode_steps < 0.75 * static_steps, engine.decode_steps


def test_compiled_prompt_shapes_are_bounded(model):
    samples = prompts(0) + prompts(1) + prompts(2)
    engine, _ = run_engine(model, prompt_pack(samples, row_length=32), pool_size=4)
    groups = {rows for rows, _, _ in engine.shapes}
    lengths = {length for _, length, _ in engine.shapes}
    assert groups <= {1, 2, 4}, engine.shapes  # powers of two up to the pool
    assert lengths <= {16, 32}, engine.shapes  # powers of two: the default buckets


def test_bad_arguments_are_refused(model):
    pack = prompt_pack(prompts())
    with pytest.raises(ValueError, match="longer than the engine's prompt_length"):
        run_engine(model, pack, pool_size=2, prompt_length=4)
    with pytest.raises(ValueError, match="pool_size"):
        run_engine(model, pack, pool_size=0)
    with pytest.raises(ValueError, match="decode_text"):
        run_engine(model, pack, pool_size=2, max_image_skips=1)


def test_a_later_batch_fills_freed_slots_pauses_and_resumes_with_the_next_version():
    """Lookahead across `finish` calls: batch B's first row takes the slot batch A's short row
    frees, is paused when A is done and resumes under the next version; every completion is
    still the sampler's, and each token carries the version it was drawn with."""
    eos = SPECIAL.im_end
    scripts = [[7, eos], [9] * 10 + [eos], [8] * 11 + [eos], [6, 6, eos]]
    model = ScriptedModel(scripts)
    settings = scripted_settings(max_new_tokens=12, max_image_skips=0)
    packs = [scripted_pack(4), scripted_pack(4)]
    a_rows, b_rows = [0, 1], [2, 3]
    want = sampler.sample(model, scripted_pack(4), jax.random.key(0), **settings)
    engine = engine_lib.Engine(model, pool_size=2, chunk_steps=4, **settings)
    rows_of = lambda pack, rows: engine_lib.Prompts(  # noqa: E731
        len(rows), lambda i: jax.tree.map(lambda x: x[np.asarray(rows)[i]], pack)
    )
    a = engine.submit(rows_of(packs[0], a_rows), jax.random.key(0), row_ids=np.array(a_rows))
    b = engine.submit(rows_of(packs[1], b_rows), jax.random.key(0), row_ids=np.array(b_rows))
    engine.finish(a, version=0)
    assert a.done and not b.done and engine.busy_slots == 1  # B's first row, paused
    engine.swap(model)  # the next weights (the same script here)
    engine.finish(b, version=1)
    assert b.done and engine.busy_slots == 0 and engine._pool is None  # its cache freed
    for batch, rows in ((a, a_rows), (b, b_rows)):
        for j, r in enumerate(rows):
            assert batch.out.row(j) == want.row(r), r
    for j in range(2):  # A: all version 0; nothing past a completion's end
        assert (a.versions[j, : a.out.lengths[j]] == 0).all()
        assert (a.versions[j, a.out.lengths[j] :] == -1).all()
    first = b.versions[0, : b.out.lengths[0]].tolist()  # begun under 0, resumed under 1
    paused_at = first.count(0)
    assert 0 < paused_at < len(first) and first == [0] * paused_at + [1] * (len(first) - paused_at)
    assert (b.versions[1, : b.out.lengths[1]] == 1).all()  # inserted after the swap


def test_a_finish_returns_when_its_last_row_ends_not_at_the_chunks_end():
    """Nothing waits and a later batch's row shares the pool: the chunk returns at the step the
    finishing batch's last row ends (11 draws), not after `chunk_steps`, so the paused row has
    drawn exactly the tokens of those steps with the finishing version."""
    eos = SPECIAL.im_end
    scripts = [[7, eos], [9] * 10 + [eos], [8] * 14 + [eos]]
    model = ScriptedModel(scripts)
    settings = scripted_settings(max_new_tokens=16, max_image_skips=0)
    pack = scripted_pack(3)
    engine = engine_lib.Engine(model, pool_size=2, chunk_steps=64, **settings)
    rows_of = lambda rows: engine_lib.Prompts(  # noqa: E731
        len(rows), lambda i: jax.tree.map(lambda x: x[np.asarray(rows)[i]], pack)
    )
    a = engine.submit(rows_of([0, 1]), jax.random.key(0), row_ids=np.array([0, 1]))
    b = engine.submit(rows_of([2]), jax.random.key(0), row_ids=np.array([2]))
    engine.finish(a, version=0)
    # Row 0 drew 2 (7, then its end), row 1 eleven; row 2 entered after step 2: 9 draws.
    assert engine.decode_steps == 11, engine.decode_steps
    engine.finish(b, version=1)
    assert b.out.row(0) == [8] * 14
    assert b.versions[0, :14].tolist() == [0] * 9 + [1] * 5
