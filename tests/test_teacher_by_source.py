"""A teacher per data source (teacher_by_source, #55 item 2).

Each loss entry is scored by its own source's teacher: a two-source micro-batch routed to two
teachers gives, per source, the loss that source's samples get alone under that teacher alone
(an independent reference: single-teacher steps on one-sample packs), and the mapping swapped
does not. A micro-batch of one source runs the other teacher under a cond that is not taken,
and compiled for a GPU each teacher's forward stays inside its conditional.
The train step (with LoRA: an EMA copy of the adapters beside another checkpoint's weights)
logs each source's loss; the config's mapping is checked before any compute; and train.py
trains LoRA adapters so taught, saves, resumes bit-identically and refuses another teacher in
one line.
"""

import dataclasses
import json
import re
import shutil
import types

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_gpu_compile
import test_offline
from conftest import run_python
from test_lora_training import LORA_RUN
from test_opsd_packs import SPECIAL, encode
from test_teacher_checkpoint import FP32, split, toy_corpus, write_deeper_teacher
from test_train_cli import assert_same_params
from test_train_step import COMPLETIONS, SAMPLES, fixed_training_packs, optim_config, stacked

from configs import smoke
from models.configs import BagelConfig
from opsd_jax import run_config
from opsd_jax.data import opsd_packs, pack_shapes
from opsd_jax.io import teacher_checkpoint, weights_digest
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.programs import gpu_target, hlo_stats
from opsd_jax.run_config import checks
from opsd_jax.toy import model as toy_model
from opsd_jax.training import train_step
from opsd_jax.training.offline import cache as offline_cache
from opsd_jax.training.offline import views as offline_views

SOURCES = ("maze", "count")


def of_source(sample, dataset):
    return types.SimpleNamespace(**vars(sample), dataset=dataset)


def packs_of(samples, completions):
    """(student, teacher, drawn log-probs (none recorded), each entry's source) of one row."""
    packs = fixed_training_packs(samples, completions)
    index = {name: i for i, name in enumerate(SOURCES)}
    drawn = opsd_packs.sampled_logprobs(packs, None)
    packed = [samples[i] for i in packs.kept]
    return (
        packs.student,
        packs.teacher,
        drawn,
        opsd_packs.entry_sources(packs.student, packed, index),
    )


@pytest.fixture(scope="module")
def models():
    """A two-layer student (seed 0) and a three-layer teacher of other weights (seed 1)."""
    tiny = BagelConfig.tiny(llm=FP32)
    graphdef, params, rest = split(tiny, 0)
    teacher_graphdef, teacher_params, teacher_rest = split(
        tiny.replace(llm=dict(num_hidden_layers=3)), 1
    )
    model = train_step.TeacherModel(teacher_graphdef, teacher_rest)
    return graphdef, params, rest, model, teacher_params


# Sample 0 from the maze source, sample 1 from the count source.
MIXED = [of_source(SAMPLES[0], "maze"), of_source(SAMPLES[1], "count")]


def alone(models, k, mode):
    """Sample k of MIXED alone in its pack, under one teacher: its per-token distillation."""
    graphdef, params, rest, model, teacher_params = models
    settings = builders.loss_settings(num_samples=1, reduction="token_mean")
    packs = packs_of(MIXED[k : k + 1], COMPLETIONS[k : k + 1])[:2]
    loss_fn = train_step.make_opsd_loss(
        graphdef, rest, settings, mode, model if mode == "checkpoint" else None
    )
    teacher = teacher_params if mode == "checkpoint" else None
    return float(jax.jit(loss_fn)(params, teacher, packs)[1]["jsd"])


def routed(models, of_source, samples=MIXED, completions=COMPLETIONS[:2]):
    graphdef, params, rest, model, teacher_params = models
    teachers = train_step.StepTeachers(("self", "checkpoint"), (model,), of_source, SOURCES)
    settings = builders.loss_settings(num_samples=len(samples), reduction="token_mean")
    loss_fn = train_step.make_opsd_loss(graphdef, rest, settings, teachers)
    packs = packs_of(samples, completions)
    return jax.jit(loss_fn)(params, (None, teacher_params), packs), loss_fn, packs


def per_token_of(metrics, name, term="jsd"):
    return float(metrics[f"source/{name}/{term}_sum"]) / float(metrics[f"source/{name}/tokens"])


def test_each_sample_is_scored_by_its_sources_teacher(models):
    """maze -> the student itself, count -> the three-layer checkpoint: each source's loss is
    its sample's alone under its teacher alone; swapped, neither is."""
    want_maze, want_count = alone(models, 0, "self"), alone(models, 1, "checkpoint")
    assert not np.isclose(want_maze, alone(models, 0, "checkpoint"), rtol=0.1)  # they differ
    (loss, metrics), _, packs = routed(models, of_source=(0, 1))
    sources = packs[3]
    assert sorted(np.unique(sources[packs[0].loss_mask]).tolist()) == [0, 1]
    np.testing.assert_allclose(per_token_of(metrics, "maze"), want_maze, rtol=1e-5)
    np.testing.assert_allclose(per_token_of(metrics, "count"), want_count, rtol=1e-5)
    tokens = [float(metrics[f"source/{n}/tokens"]) for n in SOURCES]
    assert tokens == [len(COMPLETIONS[0]) + 1, len(COMPLETIONS[1]) + 1]  # + <|im_end|>
    # token_mean over both sources: the two per-token figures weighed by their tokens.
    want = (want_maze * tokens[0] + want_count * tokens[1]) / sum(tokens)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)

    (_, swapped), _, _ = routed(models, of_source=(1, 0))
    assert not np.isclose(per_token_of(swapped, "maze"), want_maze, rtol=0.1)
    assert not np.isclose(per_token_of(swapped, "count"), want_count, rtol=0.1)


def test_a_micro_batch_of_one_source_leaves_the_other_teacher_to_a_cond_not_taken(models):
    """Two maze samples: the loss is the student-as-teacher one, and the checkpoint teacher's
    forward sits in a conditional (run only when one of its sources has an entry)."""
    samples = [of_source(SAMPLES[0], "maze"), of_source(SAMPLES[2], "maze")]
    completions = [COMPLETIONS[0], COMPLETIONS[2]]
    (loss, metrics), loss_fn, packs = routed(models, (0, 1), samples, completions)
    graphdef, params, rest, _, teacher_params = models
    settings = builders.loss_settings(num_samples=2, reduction="token_mean")
    own = train_step.make_opsd_loss(graphdef, rest, settings, "self")
    want, _ = jax.jit(own)(params, None, packs[:2])
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    assert float(metrics["source/count/tokens"]) == 0.0
    hlo = jax.jit(loss_fn).lower(params, (None, teacher_params), packs).as_text()
    assert hlo.count("stablehlo.case") + hlo.count("stablehlo.if") >= 2, "no conditional"


def test_the_train_step_logs_each_sources_loss_with_lora_and_an_ema_copy(models):
    """LoRA (B = 0 at the start: the model is its base) with maze -> the EMA of the adapters
    and count -> the checkpoint: the step's per-source losses are the references above (the
    EMA teacher is the student at the start), the checkpoint teacher stays bit-identical, and a
    source without a token in the step shows NaN."""
    graphdef, params, rest, model, teacher_params = models
    config = optim_config(
        lora_rank=4, lora_alpha=8.0, lora_targets=".*", teacher_mode="ema", compute_dtype="float32"
    )
    mesh = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    lgraphdef, lparams, lrest = run_config.with_adapters(graphdef, params, rest, config, mesh)
    optimizer = train_step.make_optimizer(config)
    teachers = train_step.StepTeachers(("ema", "checkpoint"), (model,), (0, 1), SOURCES)
    settings = builders.loss_settings(num_samples=2, reduction="token_mean")
    step = train_step.make_train_step(
        train_step.make_opsd_loss(lgraphdef, lrest, settings, teachers),
        optimizer,
        teacher_mode=teachers,
        ema_decay=0.5,
        schedule=train_step.learning_rate_schedule(config),
    )

    def fresh_state():
        state = run_config.init_train_state(config, optimizer, (), jax.tree.map(jnp.copy, lparams))
        assert state.teacher_params is not None and state.base is not None
        return state.replace(teacher_weights=(jax.tree.map(jnp.copy, teacher_params),))

    state, metrics = step(fresh_state(), stacked(packs_of(MIXED, COMPLETIONS[:2])))
    np.testing.assert_allclose(float(metrics["source/maze/jsd"]), alone(models, 0, "self"), 1e-5)
    np.testing.assert_allclose(
        float(metrics["source/count/jsd"]), alone(models, 1, "checkpoint"), rtol=1e-5
    )
    assert "source/maze/jsd_sum" not in metrics
    for a, b in zip(jax.tree.leaves(state.teacher_weights), jax.tree.leaves(teacher_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    only_maze = [of_source(SAMPLES[0], "maze"), of_source(SAMPLES[2], "maze")]
    _, metrics = step(fresh_state(), stacked(packs_of(only_maze, [COMPLETIONS[0], COMPLETIONS[2]])))
    assert np.isnan(float(metrics["source/count/jsd"])) and np.isfinite(float(metrics["loss"]))


def test_the_split_names_the_teachers_in_use_and_what_the_state_keeps():
    config = smoke.get_config()
    config.teacher_by_source = "toy_count=/t/a, toy_maze=fixed"
    split = run_config.TrainedSplit.of_config(config)
    # The data config's order, whatever the mapping's.
    assert split.teacher_by_source == (("toy_maze", "fixed"), ("toy_count", "/t/a"))
    assert split.teachers == ("fixed", "/t/a") and split.checkpoint_paths == ("/t/a",)
    assert split.teacher == "fixed" and split.teacher_is_copy and split.separate_teacher
    teachers = split.step_teachers((train_step.TeacherModel(None, None),))
    assert teachers.kinds == ("fixed", "checkpoint") and teachers.of_source == (0, 1)
    assert "toy_maze: the starting weights" in split.describe()
    assert "toy_count: /t/a, frozen" in split.describe()


@pytest.mark.parametrize(
    "mapping, changes, message",
    [
        ("toy_maze=self", {}, r"dataset 'toy_count' has no teacher"),
        ("toy_maze=self,toy_count=ema,jigsaw=ema", {}, r"'jigsaw' is no dataset"),
        ("toy_maze=ema,toy_count=fixed", {}, r"'ema' and 'fixed' both"),
        ("toy_maze=self,toy_count", {}, r"'toy_count' is not dataset_name=teacher"),
        ("toy_maze=self,toy_maze=ema", {}, r"dataset 'toy_maze' is given twice"),
        ("toy_maze=self,toy_count=/nowhere", {}, r"'/nowhere': not a BAGEL HF directory"),
        ("toy_maze=self,toy_count=ema", dict(mode="sft"), r"SFT has no teacher"),
        (
            "toy_maze=self,toy_count=ema",
            dict(mode="offline", teacher_mode="self", offline_cache_dir="/c"),
            r"'toy_count' -> 'ema'; an offline cache is collected from 'self'",
        ),
        (
            "toy_maze=self,toy_count=ema",
            dict(teacher_path="/x"),
            r"the mapping names every teacher",
        ),
    ],
)
def test_a_bad_mapping_is_named_before_any_compute(mapping, changes, message):
    config = smoke.get_config()  # two sources: toy_maze, toy_count
    config.update(dict(teacher_by_source=mapping, **changes))
    with pytest.raises(checks.ConfigError, match=message):
        checks.validate(config)


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory):
    """A toy student (seed 0) and a three-layer toy teacher of other weights (seed 1), both
    with the toy run's tokenizer."""
    root, corpus = tmp_path_factory.mktemp("teachers"), toy_corpus()
    return {
        "student": toy_model.write_toy_model(root / "student", seed=0, corpus=corpus),
        "teacher": write_deeper_teacher(root / "teacher", corpus),
    }


@pytest.mark.slow
def test_a_run_with_a_teacher_per_source_logs_each_and_resumes_bit_identically(tmp_path, toy_dirs):
    """configs/smoke.py's two toy sources with LoRA adapters, toy_maze scored by the EMA (of
    the adapters) and toy_count by the three-layer checkpoint: each step logs both sources'
    losses, the checkpoints name the teacher and keep the adapters' EMA, the resumed run's
    params equal the straight run's, and another teacher is refused in one line. The rollout
    prefills its 4 prompts 2 at a time (rollout_prefill_rows), as a one-GPU run with two
    frozen models may need to."""
    mapping = f"toy_maze=ema,toy_count={toy_dirs['teacher']}"

    def train(results_dir, *overrides):
        return run_python(
            "train.py",
            "--config",
            *LORA_RUN,
            f"--config.model_path={toy_dirs['student']}",
            f"--config.results_dir={results_dir}",
            "--config.rollout_prefill_rows=2",
            *overrides,
        )

    straight = train(
        tmp_path / "straight", "--config.total_steps=4", f"--config.teacher_by_source={mapping}"
    )
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    assert "teachers by data source: toy_maze: an EMA of what trains; toy_count:" in straight.stdout
    assert "4 prompt rows in an engine of 4 slots, prefilled 2 at a time" in straight.stdout
    assert re.search(r"\| jsd by source toy_count \S+ toy_maze \S+ \|", straight.stdout)
    rows = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl")]
    logged = [r for r in rows if "source/toy_maze/tokens" in r]
    assert len(logged) == 4, rows
    tokens = sum(r["source/toy_maze/tokens"] + r["source/toy_count/tokens"] for r in logged)
    assert tokens > 0
    assert all(r["source/toy_count/tokens"] == 0 or r["source/toy_count/jsd"] >= 0 for r in logged)

    shutil.copytree(tmp_path / "straight" / "checkpoints" / "2", tmp_path / "resumed/checkpoints/2")
    shutil.copytree(tmp_path / "straight" / "toy", tmp_path / "resumed" / "toy")
    meta = json.loads((tmp_path / "resumed/checkpoints/2/meta/metadata").read_text())
    assert meta["teacher_checkpoints"] == [teacher_checkpoint.identity(toy_dirs["teacher"])]
    assert meta["teacher_mode"] == "ema" and "ema_params" in meta["items"]

    other = f"toy_maze=ema,toy_count={toy_dirs['student']}"
    refused = train(
        tmp_path / "resumed",
        "--config.total_steps=4",
        f"--config.teacher_by_source={other}",
        "--config.allow_config_change=True",
    )
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "its run was taught by" in lines[0], refused.stderr

    resumed = train(
        tmp_path / "resumed", "--config.total_steps=4", f"--config.teacher_by_source={mapping}"
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout
    assert_same_params(
        tmp_path / "straight" / "checkpoints", tmp_path / "resumed" / "checkpoints", 4
    )


OFFLINE_TWO_SOURCES = """
from configs import offline_tiny


def get_config():
    config = offline_tiny.get_config()
    config.data.datasets = [
        dict(name="toy_maze", path="", weight=1.0, num_used_data=4),
        dict(name="toy_count", path="", weight=1.0, num_used_data=4),
    ]
    return config
"""


@pytest.mark.slow
def test_an_offline_cache_per_source_holds_each_sources_teacher(tmp_path, toy_dirs):
    """scripts/collect_traces.py with toy_maze -> model_path's weights and toy_count -> the
    three-layer checkpoint: each source's cached entries are those of a cache collected from
    its teacher alone (the student's weights; teacher_mode='checkpoint', whose manifest names
    that teacher), and toy_count's are not the student's; train.py trains on it with the same
    mapping and refuses it under the mapping swapped."""
    config_file = tmp_path / "two_sources.py"
    config_file.write_text(OFFLINE_TWO_SOURCES)
    mapping = f"toy_maze=self,toy_count={toy_dirs['teacher']}"

    def run(script, cache, *overrides):
        result = run_python(
            script,
            "--config",
            str(config_file),
            f"--config.model_path={toy_dirs['student']}",
            f"--config.results_dir={tmp_path / 'run'}",
            f"--config.offline_cache_dir={tmp_path / cache}",
            *overrides,
        )
        return result

    for cache, overrides in (
        ("student", ()),
        (
            "teacher",
            ("--config.teacher_mode=checkpoint", f"--config.teacher_path={toy_dirs['teacher']}"),
        ),
        ("mixed", (f"--config.teacher_by_source={mapping}",)),
    ):
        made = run("scripts/collect_traces.py", cache, *overrides)
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    # The checkpoint teacher's own cache: its digest and its three layers recorded.
    manifest = json.loads((tmp_path / "teacher" / "manifest.json").read_text())
    assert manifest["teacher"] == teacher_checkpoint.identity(toy_dirs["teacher"])
    assert manifest["model_config"]["llm"]["num_hidden_layers"] == 3
    manifest = json.loads((tmp_path / "mixed" / "manifest.json").read_text())
    assert manifest["teachers_by_source"] == {
        # 'self': the student's starting weights, named by their digest too, so a collection
        # resumed from other weights is refused rather than mixed in.
        "toy_maze": weights_digest.identity(toy_dirs["student"], "ema"),
        "toy_count": teacher_checkpoint.identity(toy_dirs["teacher"]),
    }
    readers = {
        c: offline_cache.CacheReader(str(tmp_path / c)) for c in ("student", "teacher", "mixed")
    }
    keys = readers["mixed"].keys()
    assert {k.split("/")[0] for k in keys} == {"toy_maze", "toy_count"}
    for key in keys:
        want = readers["student" if key.startswith("toy_maze/") else "teacher"].lookup(key)
        got = readers["mixed"].lookup(key)
        for field in ("target_ids", "top_ids", "top_logprobs", "vt_weights"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), key)
        if key.startswith("toy_count/"):
            own = readers["student"].lookup(key).top_logprobs
            assert not np.allclose(got.top_logprobs, own, atol=1e-2), key

    trained = run(
        "train.py", "mixed", f"--config.teacher_by_source={mapping}", "--config.total_steps=1"
    )
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert (
        "the cache collected per data source: toy_maze from model_path; toy_count from"
        in trained.stdout
    )
    assert re.search(r"\| kd by source toy_count \S+ toy_maze \S+ \|", trained.stdout)
    swapped = f"toy_count=self,toy_maze={toy_dirs['teacher']}"
    refused = run(
        "train.py",
        "mixed",
        f"--config.teacher_by_source={swapped}",
        f"--config.results_dir={tmp_path / 'another_run'}",
        "--config.total_steps=1",
    )
    assert refused.returncode == 2
    assert "teacher of toy_count: cache " in refused.stderr, refused.stderr


@pytest.mark.slow
def test_compiled_for_a_gpu_each_teachers_forward_stays_inside_its_conditional():
    """The routed loss's gradient compiled for an H100 (no GPU needed): two conditionals, and
    each teacher's attention kernels lie inside one of them, so XLA did not move a teacher's
    forward out to run whatever the micro-batch's sources (a 7B teacher's forward, every
    micro-batch). The student's own kernels stay outside."""
    mesh = gpu_target.make_mesh("h100", 1)
    model_config = test_gpu_compile.tiny_model_config("pallas")
    deeper = model_config.replace(llm=dict(num_hidden_layers=3))
    graphdef, params, _ = test_gpu_compile.abstract_split(model_config, mesh)
    teacher_graphdef, teacher_params, _ = test_gpu_compile.abstract_split(deeper, mesh)
    model = train_step.TeacherModel(teacher_graphdef, test_gpu_compile.host_rest(deeper))
    teachers = train_step.StepTeachers(("self", "checkpoint"), (model,), (0, 1), SOURCES)
    run = smoke.get_config()
    loss_fn = train_step.make_opsd_loss(
        graphdef, test_gpu_compile.host_rest(model_config), run_config.loss_settings(run), teachers
    )
    shapes = pack_shapes.pack_shapes(run)

    def on_mesh(x):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=mesh_lib.batch_sharding(mesh, x.ndim)
        )

    student, teacher = (
        jax.tree.map(on_mesh, opsd_packs.shaped_pack([], shapes[n][0], 1, SPECIAL, [], fixed=True))
        for n in ("student", "teacher")
    )
    entries = (1, shapes["student"][0].loss_entries)
    drawn = on_mesh(jax.ShapeDtypeStruct(entries, jnp.float32))
    sources = on_mesh(jax.ShapeDtypeStruct(entries, jnp.int32))
    grad = jax.jit(jax.grad(lambda p, t, packs: loss_fn(p, t, packs)[0]))
    with mesh_lib.use_mesh(mesh):
        lowered = grad.lower(params, (None, teacher_params), (student, teacher, drawn, sources))
    computations, entry = hlo_stats.parse_module(gpu_target.compile(lowered, mesh).as_text())

    def kernels(names):
        return sum(
            inst.opcode == "custom-call" and test_gpu_compile.TRITON in inst.attributes
            for name in names
            for inst in computations[name]
        )

    conditionals = [i for c in computations.values() for i in c if i.opcode == "conditional"]
    inside = [
        kernels(
            set().union(*(hlo_stats.reachable(computations, c) for c in hlo_stats.callees_of(i)))
        )
        for i in conditionals
    ]
    assert len(conditionals) == 2 and all(n >= 1 for n in inside), inside
    assert kernels(hlo_stats.reachable(computations, entry)) > sum(inside)  # the student's


def test_the_offline_step_logs_each_sources_kd_over_its_own_entries(models):
    """Offline mode: with each loss entry's source (the batch's third part) the loss reports
    each source's KD term; it is the KD of that source's entries alone (the loss's own term on
    a mask of them), and the step's total is unchanged by it."""
    graphdef, params, rest, _, _ = models
    samples = [test_offline.sample("a"), test_offline.sample("b", vts=((1, 2),))]
    samples[0].dataset, samples[1].dataset = "maze", "count"
    packs = offline_views.build_offline_packs(
        samples,
        encode,
        test_offline.OPTIONS,
        SPECIAL,
        num_rows=1,
        max_forward_tokens=256,
        with_teacher=False,
    )
    pack, k = packs.student, 8
    rng = np.random.default_rng(0)
    rows, entries = pack.loss_mask.shape
    logits = rng.normal(size=(rows, entries, k)).astype(np.float32)
    cache = dict(
        top_logprobs=logits - np.log(np.exp(logits).sum(-1, keepdims=True)),
        top_ids=rng.integers(0, 100, size=(rows, entries, k)).astype(np.int32),
        vt_weights=rng.uniform(size=(rows, entries)).astype(np.float32),
    )
    packed = [samples[i] for i in packs.kept]
    sources = opsd_packs.entry_sources(pack, packed, {"maze": 0, "count": 1})
    settings = builders.loss_settings(num_samples=2, reduction="token_mean")
    plain = train_step.make_offline_loss(graphdef, rest, settings)
    by_source = train_step.make_offline_loss(graphdef, rest, settings, SOURCES)
    want_loss, want = jax.jit(plain)(params, None, (pack, cache))
    loss, metrics = jax.jit(by_source)(params, None, (pack, cache, sources))
    assert float(loss) == float(want_loss) and float(metrics["kd"]) == float(want["kd"])
    for s, name in enumerate(SOURCES):
        only = dataclasses.replace(pack, loss_mask=pack.loss_mask & (sources == s))
        _, alone = jax.jit(plain)(params, None, (only, cache))
        per_token = per_token_of(metrics, name, "kd")
        np.testing.assert_allclose(per_token, float(alone["kd"]), rtol=1e-5)
        assert float(metrics[f"source/{name}/tokens"]) == float(only.loss_mask.sum()) > 0
