"""Offline Visual-OPSD: the two views, the cache on disk (crash + resume, several processes,
refusal of another model / tokenizer), and the offline loss against the online one."""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import builders
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close_to_scale, assert_trees_close_to_scale, subprocess_env
from flax import nnx
from test_opsd_packs import IME, IMS, SPECIAL, VS, encode, vit

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.data.pack_shapes import PackShape
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.training import losses, train_step
from opsd_jax.training.offline import cache as offline_cache
from opsd_jax.training.offline import collect as offline_collect
from opsd_jax.training.offline import views as offline_views

# The interleaved target (ThinkMorph's output split at the VT images); TEXT_ONLY: the reference
# completion after the student prompt / the OPSD teacher context.
OPTIONS = builders.prompt_options(
    system_prompt="ab", reference_intro="c", transition_prompt="d", offline_target="interleaved"
)
TEXT_ONLY = dataclasses.replace(OPTIONS, offline_target="text_only")


def sample(pid, thoughts=("t0", "t1"), vts=((1, 1),), answer="A", question="q"):
    return types.SimpleNamespace(
        pid=pid,
        dataset="toy",
        question=question,
        answer=answer,
        problem_image=vit(1, 2, 0.5),
        vt_images=[vit(h, w, -0.5) for h, w in vts],
        thoughts=list(thoughts),
        full_text_only_thought="unused",
    )


def test_views_share_the_target_and_differ_by_the_vt_images():
    s = sample("a")
    # Written out by hand: ThinkMorph's output split at the VT image (docs/opsd_loss.md §c.2).
    segments = ["<think>t0</think><image_start>", "<image_end><think>t1</think><answer>A</answer>"]
    assert offline_views.target_segments(s, 8) == segments
    assert offline_views.target_segments(sample("b", thoughts=(), vts=()), 8) == [
        "<answer>A</answer>"
    ]
    packs = offline_views.build_offline_packs(
        [s, sample("b", vts=((1, 2),))],
        encode,
        OPTIONS,
        SPECIAL,
        num_rows=1,
        max_forward_tokens=256,
        with_teacher=True,
    )
    target = encode(segments[0]) + [IME] + encode(segments[1]) + [IME]
    for j in range(2):
        rows = {}
        for name, pack in (("student", packs.student), ("teacher", packs.teacher)):
            row, cols = offline_views.sample_entries(pack, j)
            rows[name] = pack.loss_rows[row, cols]
            if j == 0:
                assert pack.loss_targets[row, cols].tolist() == target
                assert pack.tokens[row, rows[name][0]] == IMS
            segment = pack.segment_ids[row, rows[name][0]]
            images = ((pack.tokens[row] == VS) & (pack.segment_ids[row] == segment)).sum()
            assert images == (2 if name == "teacher" else 1)  # the problem image (+ the VT)
        # The teacher's second block sits after the VT image block: later rows, same targets.
        assert (rows["teacher"] >= rows["student"]).all()
    # The longer (teacher) view decides what is dropped.
    packs = offline_views.build_offline_packs(
        [s], encode, OPTIONS, SPECIAL, num_rows=1, max_forward_tokens=60, with_teacher=True
    )
    assert packs.kept == [] and packs.dropped == [0]


def test_text_only_target_is_the_reference_completion_after_each_context():
    from opsd_jax.data.opsd_packs import prompt_items, teacher_context_items
    from opsd_jax.data.packing import Image, Text

    s = sample("a", thoughts=("t0", "t1"))
    s.full_text_only_thought = "all text"
    # Written out by hand: the text-only thought and the answer in ThinkMorph's output tags.
    target = encode("<think>all text</think><answer>A</answer>")
    student = offline_views.view_items(s, encode, TEXT_ONLY, with_vt=False)
    teacher = offline_views.view_items(s, encode, TEXT_ONLY, with_vt=True)
    for view, context in (
        (student, prompt_items(s, encode, TEXT_ONLY)),
        (teacher, teacher_context_items(s, encode, TEXT_ONLY)),
    ):
        assert len(view) == len(context) + 1
        assert isinstance(view[-1], Text) and view[-1].loss and view[-1].ids == target
        assert not any(isinstance(it, Text) and it.loss for it in view[:-1])
    # The teacher sees the VT image (and the intro / transition texts) before the completion.
    assert sum(isinstance(it, Image) for it in teacher) == 2
    assert sum(isinstance(it, Image) for it in student) == 1
    # A cache records its target: one made for the other target is refused, naming it.
    assert (
        offline_cache.prompt_settings(TEXT_ONLY)["target_format"]
        != (offline_cache.prompt_settings(OPTIONS)["target_format"])
    )
    with pytest.raises(ValueError, match="offline_target='nope'"):
        offline_views.view_items(
            s, encode, dataclasses.replace(OPTIONS, offline_target="nope"), with_vt=False
        )


# ---- the cache on disk: crash between a shard's rename and its listing, resume, 2 processes ---


class _Tokenizer:
    vocab_length = 128

    def __init__(self, vocab=128):
        self.hf = types.SimpleNamespace(get_vocab=lambda: {chr(i): i for i in range(vocab)})

    def encode(self, text):
        return [ord(c) % 120 for c in text]

    def special_tokens(self):
        return SPECIAL


def _fake_step(params, teacher, text):
    """A stand-in for the teacher forward (no compile): values derived from the targets."""
    targets = np.asarray(teacher.loss_targets, np.float32)
    top = np.stack([targets + i for i in range(4)], axis=-1)
    return -top / 100.0, top.astype(np.int32), targets / 10.0


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    from opsd_jax.toy import data as toy_data

    root = tmp_path_factory.mktemp("toy")
    rows = toy_data.make_rows("toy_count", "train", 14, seed=0)
    toy_data.write_parquet(rows, str(root / "count" / "data" / "train-0.parquet"))
    rows = toy_data.make_rows("toy_maze", "train", 9, seed=0)
    toy_data.write_parquet(rows, str(root / "maze" / "data" / "train-0.parquet"))
    config = builders.data_config(
        [dict(name="count", path=str(root / "count")), dict(name="maze", path=str(root / "maze"))],
        image_transform=dict(max_size=112, min_size=56, stride=14, max_pixels=112 * 112),
        heldout_fraction=0.0,
    )
    return config


def _collect(directory, data_config, process=0, count=1, samples_per_batch=2, made=None, **kwargs):
    """`made`: what else the manifest records (make_manifest's `data`, `teacher`)."""
    manifest = offline_cache.make_manifest(
        BagelConfig.tiny(),
        _Tokenizer(),
        OPTIONS,
        top_k=4,
        logprob_dtype="float16",
        max_forward_tokens=4096,
        **(made or {}),
    )
    mesh = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    return offline_collect.collect(
        collect_step=_fake_step,
        params=None,
        tokenizer=_Tokenizer(),
        data_config=data_config,
        options=OPTIONS,
        mesh=mesh,
        directory=str(directory),
        manifest=manifest,
        samples_per_batch=samples_per_batch,
        rows_per_batch=1,
        max_forward_tokens=4096,
        shard_samples=3,
        process_index=process,
        process_count=count,
        log=lambda line: None,
        **kwargs,
    )


def test_each_source_is_collected_by_its_teacher_in_batches_of_its_own(tmp_path, toy_data):
    """by_source: count's samples go through one teacher, maze's through another, never in one
    batch; two sources of one teacher share its batches."""
    calls = []

    def teacher(name, shift):
        def step(params, teacher_pack, text_pack):
            calls.append((name, int((teacher_pack.segment_ids > 0).any(axis=-1).sum())))
            top_logprobs, top_ids, kl = _fake_step(params, teacher_pack, text_pack)
            return top_logprobs + shift, top_ids, kl

        return step, None

    first, second = teacher("first", 0.0), teacher("second", -1000.0)
    summary = _collect(tmp_path / "two", toy_data, by_source={"count": first, "maze": second})
    assert summary.written == 23 and {name for name, _ in calls} == {"first", "second"}
    reader = offline_cache.CacheReader(str(tmp_path / "two"))
    for key in reader.keys():  # the shift tells which teacher wrote each sample
        top = reader.lookup(key).top_logprobs
        shifted = key.startswith("maze/")
        assert np.all(top < -500) if shifted else np.all(top > -500), key
    # Batches of 4: count's 14 samples and maze's 9 take 4 + 3 batches apart, 6 together.
    for name, maze_teacher, batches in (("apart", second, 7), ("shared", first, 6)):
        calls.clear()
        by_source = {"count": first, "maze": maze_teacher}
        _collect(tmp_path / name, toy_data, samples_per_batch=4, by_source=by_source)
        assert len(calls) == batches, name


def test_collection_resumes_after_a_crash_with_every_sample_exactly_once(tmp_path, toy_data):
    def crash(path):
        if path.endswith("-000001.parquet"):  # renamed, not yet listed: the worst moment
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        _collect(tmp_path, toy_data, process=0, count=2, on_commit=crash)
    open(tmp_path / "p0-000002.parquet.tmp", "w").close()  # a half-written shard
    assert len(offline_cache.CacheReader(str(tmp_path))) == 3  # only the listed shard counts
    first = _collect(tmp_path, toy_data, process=0, count=2)
    assert first.already_done == 3 and first.written == 12 - 3  # rows 0, 2, .., 22 of 23
    other = _collect(tmp_path, toy_data, process=1, count=2)
    assert other.written == 11
    reader = offline_cache.CacheReader(str(tmp_path))
    keys = reader.keys()
    assert len(keys) == len(set(keys)) == 23
    assert {k.split("/")[0] for k in keys} == {"count", "maze"}
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    listed = {
        s["file"]
        for p in (0, 1)
        for s in json.load(open(tmp_path / f"progress-p{p}.json"))["shards"]
    }
    assert listed == {f for f in os.listdir(tmp_path) if f.endswith(".parquet")}
    # A sample reads back as written (log-probs through float16).
    cached = reader.lookup(keys[0])
    assert cached.top_ids.shape == cached.top_logprobs.shape == (len(cached.target_ids), 4)
    np.testing.assert_array_equal(cached.top_ids[:, 1], cached.target_ids + 1)
    np.testing.assert_allclose(cached.top_logprobs[:, 0], -cached.target_ids / 100, rtol=1e-3)
    assert _collect(tmp_path, toy_data).written == 0  # all done: nothing collected twice
    # Another model config: the collector refuses to mix it into this cache.
    with pytest.raises(offline_cache.CacheError, match="model_config.llm.hidden_size"):
        offline_collect.collect(
            collect_step=_fake_step,
            params=None,
            tokenizer=_Tokenizer(),
            data_config=toy_data,
            options=OPTIONS,
            mesh=None,
            directory=str(tmp_path),
            samples_per_batch=2,
            manifest=offline_cache.make_manifest(
                BagelConfig.tiny(llm=dict(hidden_size=128)),
                _Tokenizer(),
                OPTIONS,
                top_k=4,
                logprob_dtype="float16",
                max_forward_tokens=4096,
            ),
            rows_per_batch=1,
            max_forward_tokens=4096,
            shard_samples=3,
            log=lambda line: None,
        )


def test_trainer_refuses_a_cache_of_another_tokenizer_or_model(tmp_path):
    manifest = offline_cache.make_manifest(
        BagelConfig.tiny(),
        _Tokenizer(),
        OPTIONS,
        top_k=4,
        logprob_dtype="float16",
        max_forward_tokens=64,
    )
    offline_cache.write_json_atomic(str(tmp_path / offline_cache.MANIFEST), manifest)
    runtime = dict(remat="none", unroll_layers=True, attention_block=128)
    offline_cache.check_manifest(
        str(tmp_path), BagelConfig.tiny(llm=runtime), _Tokenizer(), OPTIONS
    )  # runtime switches do not matter
    # ... not even when an older manifest recorded them.
    older = dict(
        manifest,
        model_config=dict(
            manifest["model_config"],
            llm=dict(manifest["model_config"]["llm"], unroll_layers=False, attention_block=512),
        ),
    )
    offline_cache.write_json_atomic(str(tmp_path / offline_cache.MANIFEST), older)
    offline_cache.check_manifest(
        str(tmp_path), BagelConfig.tiny(llm=runtime), _Tokenizer(), OPTIONS
    )
    offline_cache.write_json_atomic(str(tmp_path / offline_cache.MANIFEST), manifest)
    with pytest.raises(offline_cache.CacheError, match="tokenizer.sha256"):
        offline_cache.check_manifest(str(tmp_path), BagelConfig.tiny(), _Tokenizer(100), OPTIONS)
    with pytest.raises(offline_cache.CacheError, match="num_hidden_layers"):
        offline_cache.check_manifest(
            str(tmp_path), BagelConfig.tiny(llm=dict(num_hidden_layers=3)), _Tokenizer(), OPTIONS
        )
    with pytest.raises(offline_cache.CacheError, match="no manifest.json"):
        offline_cache.check_manifest(
            str(tmp_path / "nowhere"), BagelConfig.tiny(), _Tokenizer(), OPTIONS
        )


def test_trainer_refuses_a_cache_of_another_teacher_naming_it(tmp_path):
    """One teacher, or one per data source: a cache is taken only under the teachers that made
    it (by digest), and each refused one is named."""
    teacher = {"model_path": "/t", "weights": "model", "digest": "d1" * 32}
    other = dict(teacher, digest="d2" * 32)
    made = dict(top_k=4, logprob_dtype="float16", max_forward_tokens=64)
    args = (BagelConfig.tiny(), _Tokenizer(), OPTIONS)
    write = lambda m: offline_cache.write_json_atomic(str(tmp_path / offline_cache.MANIFEST), m)  # noqa: E731
    write(offline_cache.make_manifest(*args, **made, teacher=teacher))
    offline_cache.check_manifest(str(tmp_path), *args, teacher)
    with pytest.raises(offline_cache.CacheError, match="teacher: cache .*, now model_path's"):
        offline_cache.check_manifest(str(tmp_path), *args, None)
    by_source = {"maze": None, "count": teacher}
    write(offline_cache.make_manifest(*args, **made, teachers_by_source=by_source))
    offline_cache.check_manifest(str(tmp_path), *args, None, by_source)
    with pytest.raises(offline_cache.CacheError, match="teacher of count: cache") as refused:
        offline_cache.check_manifest(str(tmp_path), *args, None, {"maze": None, "count": other})
    assert "teacher of maze" not in str(refused.value)
    with pytest.raises(offline_cache.CacheError, match="teacher of count: cache"):
        offline_cache.check_manifest(str(tmp_path), *args, None)  # no mapping now


# ---- the trainer's micro-batches from a tiny cache ----------------------------------------------


def _write_cache(directory, samples, options=OPTIONS, skip=(), shard_samples=2, **manifest):
    """A cache of `samples` written with the project's writer (targets as the views give them,
    made-up teacher values), `skip`'s keys recorded as too long; returns its manifest."""
    os.makedirs(directory, exist_ok=True)
    settings = dict(top_k=4, logprob_dtype="float16", max_forward_tokens=4096, **manifest)
    made = offline_cache.make_manifest(BagelConfig.tiny(), _Tokenizer(), options, **settings)
    offline_cache.write_json_atomic(os.path.join(directory, offline_cache.MANIFEST), made)
    writer = offline_cache.ShardWriter(str(directory), 0, "float16", shard_samples)
    packs = offline_views.build_offline_packs(
        samples, encode, options, SPECIAL, num_rows=1, max_forward_tokens=4096, with_teacher=True
    )
    for j, index in enumerate(packs.kept):
        key = offline_cache.cache_key(samples[index])
        if key in skip:
            writer.skip(key, offline_cache.TOO_LONG)
            continue
        row, cols = offline_views.sample_entries(packs.teacher, j)
        targets = packs.teacher.loss_targets[row, cols]
        top = np.stack([(targets + i) % 100 for i in range(4)], axis=-1)
        logprobs = -np.arange(4, dtype=np.float32)[None].repeat(len(targets), 0)
        writer.add(key, targets, top, logprobs, np.ones(len(targets)))
    writer.commit()
    return made


def test_a_micro_batch_with_no_usable_sample_is_all_padding_and_counted(tmp_path):
    """As SFT and OPSD at fixed shapes: a micro-batch whose samples were all skipped by the
    collector or fit no row is an all-padding pack with an empty cache (loss 0, finite
    metrics), every sample counted as dropped, not a ValueError that ends the run."""
    from opsd_jax.training.step_batches import OfflineBatches

    fits, skipped, long = sample("a"), sample("b"), sample("long", answer="x" * 300)
    _write_cache(tmp_path, [fits, skipped, long], skip={"toy/b"})
    reader = offline_cache.CacheReader(str(tmp_path))
    shape = PackShape(row_length=256, patches=16, loss_entries=128)
    args = dict(num_rows=1, max_forward_tokens=4096, shapes=[shape])
    batch = offline_views.offline_batch([fits], reader, encode, OPTIONS, SPECIAL, **args)
    assert batch.num_dropped == 0 and batch.pack.loss_mask.any()
    for micro in ([skipped], [long], [skipped, long]):
        batch = offline_views.offline_batch(micro, reader, encode, OPTIONS, SPECIAL, **args)
        assert batch.num_dropped == len(micro) and batch.packed == ()
        assert batch.pack.tokens.shape == (1, 256) and not (batch.pack.segment_ids > 0).any()
        assert batch.cache["top_ids"].shape == (1, 128, 4) and not batch.pack.loss_mask.any()
        assert batch.padding_fraction == 1.0
    # The trainer's micro-batches count them (pack/dropped) ...
    config = types.SimpleNamespace(
        gradient_accumulation_steps=1, max_forward_tokens=4096, pack_length_buckets=1
    )
    batches = OfflineBatches(
        config,
        {"offline": [shape]},
        encode,
        OPTIONS,
        SPECIAL,
        None,
        local_samples=2,
        local_rows=1,
        sample_offset=0,
        cache_reader=reader,
    )
    sums = {}
    (pack, cache), bucket, tokens = batches.micro(0, 0, [skipped, long], None, 0, sums)
    assert sums["pack/dropped"] == 2 and sums["pack/offline_padding"] == 1.0
    assert (bucket, tokens) == (0, 0)
    # ... and the step on it is a loss of 0 with finite metrics and a zero gradient.
    model_config = BagelConfig.tiny(llm=dict(compute_dtype="float32", remat="none"))
    graphdef, params, rest = nnx.split(Bagel(model_config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    settings = builders.loss_settings(
        kd_weight=0.5, ce_weight=1.0, num_samples=2, vocab_limit=model_config.llm.vocab_size
    )
    grads, metrics = builders.offline_grad_step(graphdef, rest, settings)(params, pack, cache)
    for name, value in metrics.items():
        assert np.isfinite(np.asarray(value)).all(), name
    assert float(metrics["loss"]) == 0.0 and float(metrics["vt_weight_mean"]) == 0.0
    assert all(not np.asarray(g).any() for g in jax.tree.leaves(grads))


def test_a_damaged_cache_is_refused_when_opened_naming_the_file(tmp_path):
    """A listed shard missing or of another size than recorded, or a JSON file cut short, is
    a CacheError naming the file when the cache is opened (before the model loads), not a
    pyarrow / json error at the first step that reads it; a shard damaged at its size is
    named at the read."""
    _write_cache(tmp_path, [sample(p) for p in "abcd"])
    shard = tmp_path / "p0-000001.parquet"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(offline_cache.CacheError, match=rf"{shard}: {len(whole) // 2} bytes, "):
        offline_cache.CacheReader(str(tmp_path))
    shard.unlink()
    with pytest.raises(offline_cache.CacheError, match=rf"{shard}: missing"):
        offline_cache.CacheReader(str(tmp_path))
    shard.write_bytes(whole[:-8] + bytes(8))  # the same size, the footer gone
    reader = offline_cache.CacheReader(str(tmp_path))
    reader.lookup("toy/a")
    with pytest.raises(offline_cache.CacheError, match=rf"{shard} \(sample 'toy/c'\)"):
        reader.lookup("toy/c")
    shard.write_bytes(whole)
    for name in ("progress-p0.json", offline_cache.MANIFEST):
        path = tmp_path / name
        text = path.read_text()
        path.write_text(text[: len(text) // 2])
        with pytest.raises(offline_cache.CacheError, match=rf"{path} is not valid JSON"):
            offline_cache.check_manifest(str(tmp_path), BagelConfig.tiny(), _Tokenizer(), OPTIONS)
            offline_cache.CacheReader(str(tmp_path))
        path.write_text(text)
    assert len(offline_cache.CacheReader(str(tmp_path))) == 4


def test_processes_writing_one_new_manifest_at_once_all_go_on(tmp_path):
    """Collectors started together on one new directory all find no manifest and write it:
    each through a tmp file of its own (one shared name: the slower rename found it gone), and
    `create_json` keeps the first (the others read it back and compare)."""
    import threading

    manifest = {"format": "x", "payload": list(range(2000))}
    trials, writers, failures = 20, 4, []
    barrier = threading.Barrier(writers)

    def write(trial_dirs):
        for directory in trial_dirs:
            barrier.wait()
            path = os.path.join(directory, offline_cache.MANIFEST)
            try:
                if not os.path.exists(path):
                    offline_cache.write_json_atomic(path, manifest)
            except OSError as e:
                failures.append(e)

    dirs = [tmp_path / str(t) for t in range(trials)]
    for d in dirs:
        d.mkdir()
    threads = [threading.Thread(target=write, args=(dirs,)) for _ in range(writers)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert failures == []
    for d in dirs:
        assert json.loads((d / offline_cache.MANIFEST).read_text()) == manifest
        assert os.listdir(d) == [offline_cache.MANIFEST]  # no tmp file left
    path = str(tmp_path / "once.json")
    assert offline_cache.create_json(path, {"a": 1}) is True
    assert offline_cache.create_json(path, {"a": 2}) is False
    assert json.loads(open(path).read()) == {"a": 1} and os.listdir(tmp_path).count("once.json")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_an_unfinished_cache_is_refused_when_opened_saying_how_to_finish(
    tmp_path, toy_data, monkeypatch
):
    """A collection stopped early (--max_samples, a kill) or a process of several that never
    ran: the trainer's check names how many of the run's samples are missing and which
    processes did not finish, before the first step needs one. A finished collection over the
    same data is taken from its progress files without reading the rows again."""
    from opsd_jax.training.offline import checks as offline_checks

    stopped = tmp_path / "stopped"
    _collect(stopped, toy_data, max_samples=5)
    manifest = offline_cache.read_manifest(str(stopped))
    with pytest.raises(offline_cache.CacheError, match="of the run's 23 training samples") as e:
        offline_checks.check_covers(str(stopped), toy_data, manifest)
    assert "no process finished" in str(e.value) and "collect_traces.py again" in str(e.value)
    two = tmp_path / "two"
    _collect(two, toy_data, process=0, count=2)
    with pytest.raises(
        offline_cache.CacheError, match=r"^.*: 11 of the run's 23 .*process\(es\) 1 "
    ):
        offline_checks.check_covers(str(two), toy_data, offline_cache.read_manifest(str(two)))
    _collect(two, toy_data, process=1, count=2)
    offline_checks.check_covers(str(two), toy_data, offline_cache.read_manifest(str(two)))
    # Recorded as finished over the same data: the rows are not read (a 7B data set's images).
    same = tmp_path / "same"
    _collect(same, toy_data, made=dict(data=offline_checks.data_settings(toy_data)))
    monkeypatch.setattr(offline_collect, "rows_of_process", None)  # reading them would fail
    offline_checks.check_covers(str(same), toy_data, offline_cache.read_manifest(str(same)))


def test_a_self_teacher_and_the_image_transform_are_recorded_and_compared(tmp_path, toy_data):
    """The manifest records the digest of a `self` teacher's weights (model_path's, or with
    resume_from + resume_model_only the checkpoint's params) and the image transform: the
    collector refuses to resume into a cache of other weights or another transform (the two
    teachers were mixed in one cache), and the trainer refuses the cache, naming the field."""
    from configs import offline_tiny
    from opsd_jax.training.offline import checks as offline_checks

    checkpoint = tmp_path / "checkpoints"
    for item in ("params", "ema_params"):
        (checkpoint / item / "d").mkdir(parents=True)
        (checkpoint / item / "d" / "data").write_bytes(item.encode() * 100)
        (checkpoint / item / "_METADATA").write_text("{}")
    config = offline_tiny.get_config()
    with config.unlocked():
        config.resume_from, config.resume_model_only = str(checkpoint), True
    first = offline_checks.teacher_identity(config, lora=False)
    assert first == offline_checks.checkpoint_identity(str(checkpoint), "params")
    with config.unlocked():
        config.finetune_from_ema = True
    assert (
        offline_checks.teacher_identity(config, lora=False)["digest"] != first["digest"]
    )  # ema_params
    (checkpoint / "params" / "d" / "data").write_bytes(b"other weights" * 100)
    second = offline_checks.checkpoint_identity(str(checkpoint), "params")
    assert second["digest"] != first["digest"]
    # The collector: a cache begun with one teacher's weights is not continued with another's.
    cache = tmp_path / "cache"
    data = offline_checks.data_settings(toy_data)
    _collect(cache, toy_data, max_samples=3, made=dict(teacher=first, data=data))
    with pytest.raises(offline_cache.CacheError, match="teacher.digest: cache"):
        _collect(cache, toy_data, made=dict(teacher=second, data=data))
    wider = dataclasses.replace(
        toy_data, image_transform=dataclasses.replace(toy_data.image_transform, max_size=224)
    )
    other_data = offline_checks.data_settings(wider)
    with pytest.raises(offline_cache.CacheError, match="data.image_transform.max_size: cache 112"):
        _collect(cache, toy_data, made=dict(teacher=first, data=other_data))
    # The trainer: the same teacher and transform only, each named.
    args = (str(cache), BagelConfig.tiny(), _Tokenizer(), OPTIONS)
    offline_cache.check_manifest(*args, first, image_transform=data["image_transform"])
    with pytest.raises(offline_cache.CacheError, match="teacher: cache checkpoint .*, now check"):
        offline_cache.check_manifest(*args, second, image_transform=data["image_transform"])
    with pytest.raises(
        offline_cache.CacheError, match="data.image_transform.max_size: cache 112, now 224"
    ):
        offline_cache.check_manifest(*args, first, image_transform=other_data["image_transform"])
    # A cache of a `self` teacher made before its weights were recorded: refused, saying so.
    legacy = tmp_path / "legacy"
    _collect(legacy, toy_data, max_samples=1)
    with pytest.raises(offline_cache.CacheError, match=r"no digest recorded\), now check"):
        offline_cache.check_manifest(str(legacy), *args[1:], first)


# ---- the offline loss equals the online one on the same teacher and completion -----------------


@pytest.mark.slow
def test_offline_loss_and_gradient_equal_the_online_ones(tmp_path):
    config = BagelConfig.tiny(llm=dict(compute_dtype="float32", remat="none"))
    graphdef, teacher_params, rest = nnx.split(Bagel(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    leaves, tree = jax.tree.flatten(teacher_params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    student_params = jax.tree.unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )
    samples = [sample("a"), sample("b", thoughts=("x",), vts=((1, 2),), answer="BB"), sample("c")]
    k, tau, vocab = 16, 2.0, config.llm.vocab_size - 5  # a padded table: ids >= vocab masked

    # Collect (the teacher on both views), then through the fp32 cache on disk. One row, so
    # the trainer's text-only pack has the collector's layout and entries compare one to one.
    packs = offline_views.build_offline_packs(
        samples, encode, OPTIONS, SPECIAL, num_rows=1, max_forward_tokens=256, with_teacher=True
    )
    step = offline_collect.make_collect_step(graphdef, rest, top_k=k, vocab_limit=vocab)
    top_logprobs, top_ids, vt_kl = (
        np.asarray(x) for x in step(teacher_params, packs.teacher, packs.student)
    )
    writer = offline_cache.ShardWriter(str(tmp_path), 0, "float32", shard_samples=10)
    for j, s in enumerate(samples):
        row, cols = offline_views.sample_entries(packs.teacher, j)
        writer.add(
            offline_cache.cache_key(s),
            packs.teacher.loss_targets[row, cols],
            top_ids[row, cols],
            top_logprobs[row, cols],
            vt_kl[row, cols],
        )
    writer.commit()
    manifest = dict(top_k=k, logprob_dtype="float32", format=offline_cache.CACHE_FORMAT)
    batch = offline_views.offline_batch(
        samples,
        offline_cache.CacheReader(str(tmp_path), manifest),
        encode,
        OPTIONS,
        SPECIAL,
        num_rows=1,
        max_forward_tokens=256,
    )
    pack, mask, cache = batch.pack, batch.pack.loss_mask, batch.cache
    assert batch.num_dropped == 0
    np.testing.assert_array_equal(pack.tokens, packs.student.tokens)
    for j, s in enumerate(samples):
        # Before the first VT image both views are the same text (causal attention): weight 0;
        # after it the teacher sees the image, the text-only view does not.
        row, cols = offline_views.sample_entries(pack, j)
        before = len(encode(offline_views.target_segments(s, 8)[0])) + 1
        weights = cache["vt_weights"][row, cols]
        assert (np.abs(weights[:before]) < 1e-6).all() and (weights[before:] > 1e-6).all()

    @jax.jit
    def logits_of(params, view):
        model = nnx.merge(graphdef, params, rest)
        return model.logits_at(model(view), view.loss_rows)

    teacher_logits = logits_of(teacher_params, packs.teacher)
    text_logits = logits_of(teacher_params, pack)  # the teacher model on the text-only view
    common = dict(sample_ids=pack.loss_sample, num_samples=3, vocab_limit=vocab)

    def offline(logits, norm, vt):
        return losses.cached_top_k_kl(
            logits,
            cache["top_logprobs"],
            cache["top_ids"],
            mask,
            tau,
            student_norm=norm,
            weights=cache["vt_weights"] if vt else None,
            **common,
        )[0]

    def online_top_k(logits):  # the on-policy loss: teacher top-k, both renormalised, beta 0
        return losses.generalized_jsd(
            logits, teacher_logits, mask, beta=0.0, temperature=tau, top_k=k, clip=0.0, **common
        )[0]

    # The VT weight is KL(teacher on the VT view || the same model on the text-only view). It
    # is the KL of two nearly equal distributions (~1e-4), which fp32 log-softmaxes give to
    # ~1e-6 absolute only, whatever the formula: checked here on its own, then used as cached.
    def log_softmax64(logits):  # numpy float64, ids >= vocab left out
        z = np.asarray(logits, np.float64)[..., :vocab]
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    teacher_logp = log_softmax64(teacher_logits)
    vt_weights = (np.exp(teacher_logp) * (teacher_logp - log_softmax64(text_logits))).sum(-1)
    np.testing.assert_allclose(cache["vt_weights"][mask], vt_weights[mask], rtol=0, atol=2e-6)
    assert (cache["vt_weights"] >= 0).all()
    vt_weights = cache["vt_weights"]

    def online_full(logits, weighted):  # the PyTorch offline trainer's formula, from logits
        s = losses.mask_vocab(logits, vocab) / tau
        t = losses.mask_vocab(teacher_logits, vocab)
        ids = jax.lax.top_k(t, k)[1]
        q = jax.nn.softmax(jnp.take_along_axis(t, ids, -1) / tau, -1)
        log_p = jnp.take_along_axis(jax.nn.log_softmax(s, -1), ids, -1)
        kl = jnp.sum(q * (jnp.log(q) - log_p), -1) * tau**2
        w = jnp.where(mask, vt_weights if weighted else 1.0, 0.0)
        per_sample = [
            jnp.sum((w * kl)[pack.loss_sample == i]) / jnp.sum(w[pack.loss_sample == i])
            for i in range(3)
        ]
        return sum(per_sample) / 3

    # The loss as a function of the student's logits: value and gradient, three settings.
    student_logits = logits_of(student_params, pack)
    for norm, vt, online in [
        ("top_k", False, online_top_k),
        ("full", False, lambda z: online_full(z, False)),
        ("full", True, lambda z: online_full(z, True)),
    ]:
        value, grad = jax.jit(jax.value_and_grad(lambda z: offline(z, norm, vt)))(student_logits)
        expected, expected_grad = jax.jit(jax.value_and_grad(online))(student_logits)
        assert float(value) > 0.01
        assert_close_to_scale(value, expected, rel=1e-6, err_msg=f"{norm}, vt={vt}")
        assert_close_to_scale(grad, expected_grad, rel=1e-6, err_msg=f"{norm}, vt={vt}")
    # The train step (defaults: full vocabulary, VT-weighted) against the online loss through
    # the student model: the parameter gradient.
    settings = builders.loss_settings(
        kd_weight=1.0, ce_weight=0.0, kd_temperature=tau, num_samples=3, vocab_limit=vocab
    )
    grads, metrics = builders.offline_grad_step(graphdef, rest, settings)(
        student_params, pack, cache
    )
    expected, expected_grads = jax.jit(
        jax.value_and_grad(lambda p: online_full(logits_of(p, pack), True))
    )(student_params)
    assert_close_to_scale(metrics["loss"], expected, rel=1e-6)
    assert_trees_close_to_scale(grads, expected_grads, rel=1e-6)
    # train.py's path: the pack and the cache at fixed shapes (wider than the content, the
    # samples in two rows), stacked as two equal micro-batches, through the one compiled step
    # (scan accumulation, mean gradient). Its loss and gradient norm are the online ones.
    shape = PackShape(row_length=512, patches=64, loss_entries=256)
    fixed = offline_views.offline_batch(
        samples,
        offline_cache.CacheReader(str(tmp_path), manifest),
        encode,
        OPTIONS,
        SPECIAL,
        num_rows=2,
        max_forward_tokens=256,
        shapes=[shape],
    )
    assert fixed.pack.tokens.shape == (2, 512) and fixed.cache["top_ids"].shape == (2, 256, k)
    assert fixed.num_dropped == 0 and int(fixed.pack.loss_mask.sum()) == int(mask.sum())
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(optax.constant_schedule(0.0))
    )
    compiled = train_step.make_train_step(
        train_step.make_offline_loss(graphdef, rest, settings),
        optimizer,
        teacher_mode="self",
        ema_decay=0.0,
        schedule=optax.constant_schedule(0.0),
    )
    state = train_step.init_state(
        jax.tree.map(jnp.copy, student_params), optimizer, "self", jax.random.key(0)
    )
    stacked = jax.tree.map(
        lambda *xs: np.stack(xs), (fixed.pack, fixed.cache), (fixed.pack, fixed.cache)
    )
    _, step_metrics = compiled(state, stacked)
    assert_close_to_scale(step_metrics["loss"], expected, rel=1e-6)
    expected_norm = np.sqrt(
        sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(expected_grads))
    )
    assert_close_to_scale(step_metrics["grad_norm"], expected_norm, rel=1e-6)
    # A cache made for other targets (another tokenizer / prompt) is refused by name.
    other = [sample("a", answer="Z"), *samples[1:]]
    with pytest.raises(offline_cache.CacheError, match="'toy/a': the cached target"):
        offline_views.offline_batch(
            other,
            offline_cache.CacheReader(str(tmp_path), manifest),
            encode,
            OPTIONS,
            SPECIAL,
            num_rows=1,
            max_forward_tokens=256,
        )


# ---- the two commands as a user runs them ------------------------------------------------------


ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_script(*args, log_compiles=False):
    env = subprocess_env(1)
    if log_compiles:  # jax logs every compilation (stderr), merged in order with the console
        env.update(JAX_LOG_COMPILES="1", PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout


def offline_args(results_dir, cache_dir):
    return [
        "--config",
        "configs/offline_tiny.py",
        f"--config.results_dir={results_dir}",
        f"--config.offline_cache_dir={cache_dir}",
    ]


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """scripts/collect_traces.py, uninterrupted, then train.py mode 'offline' (2 steps) with
    JAX_LOG_COMPILES=1, on the toy task (16 samples): (results dir, collector out, trainer out)."""
    root = tmp_path_factory.mktemp("offline")
    common = offline_args(root, root / "cache")
    collected = run_script("scripts/collect_traces.py", *common)
    trained = run_script(
        "train.py",
        *common,
        "--config.total_steps=2",
        "--config.log_every=1",
        "--config.progress_bar=False",
        log_compiles=True,
    )
    return root, collected, trained


@pytest.mark.slow
def test_collect_traces_then_train_offline(offline_run):
    """scripts/collect_traces.py then train.py mode 'offline' on the toy task (16 samples)."""
    root, out, trained = offline_run
    assert "[p0] 16/16 samples" in out and "ETA" in out
    assert re.search(r"done: 16 samples written, 0 were cached before, skipped none", out), out
    assert "16 samples, " in out.splitlines()[-1]  # the cache size per sample is reported
    assert not re.search(r"^I\d{4} ", out, re.M), out[:3000]  # no absl INFO lines
    assert "offline teacher cache" in trained and "done: 2 steps" in trained
    logged = [json.loads(line) for line in open(root / "metrics.jsonl")]
    assert [m["step"] for m in logged] == [1, 2]
    for m in logged:
        assert m["kd"] > 0 and m["ce"] > 0 and m["vt_weight_mean"] > 0
        assert m["loss"] == pytest.approx(m["ce"] + 0.5 * m["kd"], rel=1e-5)
        assert m["pack/dropped"] == 0  # every sample fits the fixed offline rows
    assert sorted(os.listdir(root / "checkpoints")) == ["2"]


@pytest.mark.slow
def test_the_offline_train_step_compiles_before_step_1_and_nothing_after(offline_run):
    """Offline mode runs the same one compiled step as on-policy: compiled once, ahead of time,
    at the config's fixed pack shapes (the cached teacher's [rows, entries, top-k] included),
    announced before step 1; after step 1's line nothing compiles at all (no sampler here)."""
    _, _, out = offline_run
    lines = out.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/2"))
    announced = [i for i, line in enumerate(lines) if line.startswith("compiling the train step")]
    assert len(announced) == 1 and announced[0] < first_step, out[-6000:]
    assert re.match(
        r"compiling the train step for 1 x 2 rows x \(offline 1024 tokens / 256 "
        r"patches, cached teacher top-64\), 192 loss entries per row: [\d.]+ s",
        lines[announced[0]],
    ), lines[announced[0]]
    compiled = [line for line in lines if "Compiling jit(train_step)" in line]
    assert len(compiled) == 1, compiled
    # The compiled step's cache argument has the fixed shape [micro-batches, rows, entries, k].
    assert "int32[1,2,192,64]" in compiled[0] and "float32[1,2,192,64]" in compiled[0]
    later = [
        re.search(r"Compiling (\S+)", line).group(1)
        for line in lines[first_step:]
        if "Compiling " in line
    ]
    assert later == [], later


@pytest.mark.slow
def test_offline_training_resumes_bit_identically(offline_run, tmp_path):
    """A run stopped after step 2 and resumed to step 4 ends with the params, optimizer state and
    data position of a run that went to step 4 at once: the data iterator and the cache reader
    resume together (the cache is read by sample key). The stopped run is the fixture's: a
    2-step run of the same config, its last checkpoint at step 2."""
    from scripts import crash_drill

    root, _, _ = offline_run
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    shutil.copytree(root, resumed, ignore=shutil.ignore_patterns("cache"))
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["2"]
    common = ["--config.total_steps=4", "--config.log_every=1", "--config.progress_bar=False"]
    run_script("train.py", *offline_args(straight, root / "cache"), *common)
    # (The saved config names the fixture's toy model, which a resume must keep.)
    model = f"--config.model_path={root / 'toy' / 'model'}"
    out = run_script("train.py", *offline_args(resumed, root / "cache"), *common, model)
    assert "resumed from" in out and "at step 2" in out, out[-3000:]
    for item in ("params", "opt_state"):
        a = crash_drill.saved_arrays(straight / "checkpoints", 4, item)
        b = crash_drill.saved_arrays(resumed / "checkpoints", 4, item)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    logged = [json.loads(line) for line in open(resumed / "metrics.jsonl")]
    expected = [json.loads(line) for line in open(straight / "metrics.jsonl")]
    assert [m["step"] for m in logged] == [m["step"] for m in expected]
    assert [m["loss"] for m in logged] == [m["loss"] for m in expected]


@pytest.mark.slow
def test_collection_killed_mid_run_resumes_to_the_uninterrupted_cache(offline_run, tmp_path):
    """A real crash: scripts/collect_traces.py is SIGKILLed once its progress file lists a
    shard (4 shards of 4 samples), then run again with the same command. Every sample is then
    cached exactly once, and bit-equal to the uninterrupted collection's."""
    root, _, _ = offline_run
    cache = tmp_path / "cache"
    # One shard per forward batch (samples_per_micro_batch = 4): the rerun then batches the
    # samples left as the uninterrupted run did. Batched otherwise, a sample's rows and pack
    # sizes change, and with them the float rounding (the VT weights, KLs of ~1e-7, move by
    # ~1e-7; see test_offline_loss_and_gradient_equal_the_online_ones).
    args = [
        "scripts/collect_traces.py",
        *offline_args(root, cache),  # the fixture's toy assets
        "--config.offline_shard_samples=4",
    ]
    progress = cache / "progress-p0.json"

    def listed():  # the progress file is replaced atomically: never read half-written
        return (
            [k for shard in json.loads(progress.read_text())["shards"] for k in shard["keys"]]
            if progress.exists()
            else []
        )

    with open(tmp_path / "killed.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=subprocess_env(1),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            while process.poll() is None and not listed():
                time.sleep(0.01)
            process.send_signal(signal.SIGKILL)
        finally:
            process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    before = listed()
    assert 0 < len(before) < 16, before  # killed mid-run, not before the first shard or after
    out = run_script(*args)
    assert re.search(
        rf"done: {16 - len(before)} samples written, {len(before)} were cached "
        r"before, skipped none",
        out,
    ), out
    assert not [f for f in os.listdir(cache) if f.endswith(".tmp")]
    shards = json.loads(progress.read_text())["shards"]
    assert {s["file"] for s in shards} == {f for f in os.listdir(cache) if f.endswith(".parquet")}
    keys = [k for shard in shards for k in shard["keys"]]
    reference = offline_cache.CacheReader(str(root / "cache"))  # the uninterrupted collection
    assert len(keys) == len(set(keys)) == 16 and set(keys) == set(reference.keys())
    resumed = offline_cache.CacheReader(str(cache))
    for key in keys:
        got, want = resumed.lookup(key), reference.lookup(key)
        for field in ("target_ids", "top_ids", "top_logprobs", "vt_weights"):
            np.testing.assert_array_equal(
                getattr(got, field), getattr(want, field), err_msg=f"{key} {field}"
            )


def test_offline_config_values_are_checked(tmp_path):
    from configs import offline_7b, offline_tiny, thinkmorph_7b
    from opsd_jax import run_config

    config = offline_tiny.get_config()
    with config.unlocked():
        config.model_path, config.toy_data = str(tmp_path), False
        config.data.datasets = [dict(name="d", path=str(tmp_path))]
        config.offline_cache_dir = str(tmp_path)
    open(tmp_path / offline_cache.MANIFEST, "w").close()
    run_config.validate(config, num_devices=1)
    for key, value, message in [
        ("teacher_mode", "ema", "teacher_mode='ema' with mode='offline'"),
        ("kd_temperature", 0.0, "kd_temperature=0.0: must be > 0"),
        ("kd_weight", -1.0, "kd_weight=-1.0: must be >= 0"),
        ("kd_student_norm", "vocab", "kd_student_norm='vocab': allowed values are 'full', 'top_k'"),
        ("offline_logprob_dtype", "int8", "offline_logprob_dtype='int8': allowed values"),
        ("offline_cache_dir", "", "offline_cache_dir is empty"),
        ("offline_cache_dir", str(tmp_path / "none"), "no manifest.json; make the cache first"),
    ]:
        bad = config.copy_and_resolve_references()
        with bad.unlocked():
            bad[key] = value
        with pytest.raises(run_config.ConfigError) as error:
            run_config.validate(bad, num_devices=1)
        assert message in str(error.value)
    # The collector makes the cache: it only needs the directory named.
    with config.unlocked():
        config.offline_cache_dir = str(tmp_path / "new")
    run_config.validate(config, num_devices=1, need_cache=False)
    # The 7B offline config is the paper recipe's data / optimiser / mesh with the PyTorch
    # offline trainer's loss, steps and collector settings.
    paper, offline = thinkmorph_7b.get_config().to_dict(), offline_7b.get_config().to_dict()
    changed = {k for k in paper if paper[k] != offline[k]}
    assert changed == {
        "mode",
        "teacher_mode",
        "offline_cache_dir",
        "ce_weight",
        "gradient_accumulation_steps",
        "total_steps",
        "save_every",
        "results_dir",
    }
    assert (
        offline["kd_weight"],
        offline["kd_temperature"],
        offline["kd_use_vt_weights"],
        offline["offline_top_k"],
        offline["offline_logprob_dtype"],
    ) == (0.5, 2.0, True, 256, "float16")
