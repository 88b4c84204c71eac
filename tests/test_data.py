"""Tests for the data sources, the grain pipeline and the toy data generator.

Why these: a bad row must be skipped and counted (never crash a run), a resumed run must see
exactly the samples it would have seen, the held-out split must not drift between machines, and
the two on-disk layouts must mean the same thing. Images use ImageTransform(112, 56, 14) (8x8
patches) to keep the tests fast.
"""

import codecs
import io
import json
import os
import pickle
import re

import builders
import numpy as np
import pytest
from PIL import Image

from opsd_jax.data.data_config import DataConfig, DatasetSpec
from opsd_jax.data.image_transform import ImageTransform
from opsd_jax.data.pipeline import (
    DataIterator,
    build_dataset,
    check_split_sizes,
    make_iterator,
)
from opsd_jax.data.sources import (
    DataError,
    RawSample,
    Skipped,
    check_dataset,
    decode_row,
    is_heldout,
    iter_samples,
    open_source,
    pid_fraction,
)
from opsd_jax.toy import data as toy
from scripts import make_toy_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = builders.data_fields()
ROUNDS = FIELDS["max_reference_rounds"]
SOURCE = dict(heldout_fraction=FIELDS["heldout_fraction"], max_reference_rounds=ROUNDS)
SMALL = ImageTransform(112, 56, 14)


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    toy.write_toy_data(str(out), seed=0, num_train=40, num_test=8, jsonl=True)
    return str(out)


def _config(datasets, **kwargs):
    kwargs.setdefault("image_transform", SMALL)
    return builders.data_config(datasets, **kwargs)


def _iterate(config, split="all", **kwargs):
    kwargs.setdefault("process_index", 0)
    kwargs.setdefault("process_count", 1)
    return make_iterator(config, split, **kwargs)


# ---------------------------------------------------------------------------------------- bad rows


@pytest.fixture(scope="module")
def corrupt_parquet(tmp_path_factory):
    """10 good toy rows with 6 bad ones interleaved; small row groups to cross group borders."""
    rows = toy.make_rows("toy_count", "train", 10, seed=1)
    bad = [dict(r) for r in toy.make_rows("toy_count", "train", 6, seed=2)]
    for i, r in enumerate(bad):
        r["pid"] = f"bad_{i}"
    bad[0]["problem_image_0"] = {"bytes": b"not an image at all", "path": "x.png"}
    bad[1]["question"] = None
    bad[2]["question"] = "   "
    bad[3]["reasoning_image_0"] = None
    bad[4]["question"] = "q" * 5000
    png = bad[5]["reasoning_image_0"]["bytes"]
    bad[5]["reasoning_image_0"] = {"bytes": png[: len(png) // 2], "path": "cut.png"}  # truncated
    mixed = rows[:3] + bad[:3] + rows[3:7] + bad[3:] + rows[7:]
    path = tmp_path_factory.mktemp("corrupt") / "train-00000.parquet"
    toy.write_parquet(mixed, str(path), row_group_size=4)
    return str(path)


def test_bad_rows_are_skipped_and_counted(corrupt_parquet):
    config = _config([DatasetSpec("c", corrupt_parquet)], max_question_chars=4096)
    it = _iterate(config, "all")
    samples = list(it)
    assert [s.pid for s in samples] == [f"toy_count_train_{i:05d}" for i in range(10)]
    expected = {
        "bad_image": 2,
        "missing_field": 1,
        "empty_question": 1,
        "missing_vt_image": 1,
        "too_long": 1,
    }
    assert {k: v for k, v in it.skipped.items() if v} == expected
    assert it.num_yielded == 10
    assert it.metrics()["data/skipped/bad_image"] == 2
    s = samples[0]
    assert (
        s.problem_image.patches.shape == (64, 588) and s.problem_image.patches.dtype == np.float32
    )
    assert s.problem_image.position_ids[:9].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 70]
    assert len(s.vt_images) == 1 and s.vt_images[0].grid_h == 8
    assert len(s.thoughts) == 2 and s.answer in "1234"


def test_decode_row_edge_cases(toy_dir):
    record = open_source(DatasetSpec("m", os.path.join(toy_dir, "toy_maze")), "all", **SOURCE)[0]
    ok = decode_row(record, "m", max_reference_rounds=ROUNDS)
    assert isinstance(ok, RawSample) and ok.problem_image.size == (112, 112)
    assert isinstance(ok.full_text_only_thought, str)
    # A column absent from the file behaves like None.
    no_vt = {k: v for k, v in record.items() if k != "reasoning_image_0"}
    assert decode_row(no_vt, "m", max_reference_rounds=ROUNDS).reason == "missing_vt_image"
    assert isinstance(
        decode_row(no_vt, "m", max_reference_rounds=ROUNDS, require_vt=False), RawSample
    )
    assert (
        decode_row(
            {k: v for k, v in record.items() if k != "pid"}, "m", max_reference_rounds=ROUNDS
        ).reason
        == "missing_field"
    )
    no_answer = dict(record, answer=None)
    assert decode_row(no_answer, "m", max_reference_rounds=ROUNDS).reason == "missing_field"
    # An image path that does not exist is a bad image, not an exception.
    missing = dict(record, problem_image_0={"bytes": None, "path": "nowhere.png"})
    assert decode_row(missing, "m", max_reference_rounds=ROUNDS).reason == "bad_image"


def test_a_jsonl_line_that_is_not_utf8_is_one_counted_read_error(tmp_path):
    # A byte-order mark (Notepad, PowerShell) must not cost line 1, and one Latin-1 line must
    # cost only itself, named by file and line, not crash the reading of the whole file.
    path = tmp_path / "train.jsonl"
    toy.write_jsonl(toy.make_rows("toy_maze", "train", 3, seed=6), str(path))
    lines = path.read_bytes().splitlines(keepends=True)
    latin1 = '{"pid": "latin1", "question": "caf\u00e9?", "answer": "A"}\n'.encode("latin-1")
    path.write_bytes(codecs.BOM_UTF8 + lines[0] + latin1 + b"".join(lines[1:]))
    spec = DatasetSpec("j", str(path))
    assert check_dataset(spec) == 1
    out = list(iter_samples(spec, "all", **SOURCE))
    assert [type(o).__name__ for o in out] == ["RawSample", "Skipped", "RawSample", "RawSample"]
    assert out[1].reason == "read_error"
    assert out[1].detail.startswith("train.jsonl:2: not UTF-8")
    # A file with no UTF-8 line at all is a whole unreadable file: an error up front, saying why.
    utf16 = tmp_path / "utf16" / "train.jsonl"
    utf16.parent.mkdir()
    utf16.write_text(b"".join(lines).decode("utf-8"), encoding="utf-16")
    with pytest.raises(DataError, match=re.escape(f"{utf16} has no readable line")):
        check_dataset(DatasetSpec("j16", str(utf16)))


def _damage_column_chunk(path, group, column):
    """Overwrite the first page header of one column chunk; the footer stays valid."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    names = [meta.schema.column(j).path for j in range(meta.num_columns)]
    chunk = meta.row_group(group).column(names.index(column))
    with open(path, "r+b") as f:
        f.seek(chunk.data_page_offset)
        f.write(b"\xff" * 16)


def test_a_damaged_parquet_row_group_skips_its_rows_naming_file_and_group(tmp_path):
    # The footer is intact, so check_dataset passes: the damage shows only when the row group is
    # read, mid-run, inside grain's reader threads, where it must be a counted skip, not a crash.
    rows = toy.make_rows("toy_maze", "train", 12, seed=7)
    path = str(tmp_path / "train.parquet")
    toy.write_parquet(rows, path, row_group_size=4)
    _damage_column_chunk(path, group=1, column="problem_image_0.bytes")
    spec = DatasetSpec("p", path)
    assert check_dataset(spec) == 1
    it = _iterate(_config([spec]), "all")
    assert [s.pid for s in it] == [r["pid"] for r in rows[:4] + rows[8:]]
    assert {k: v for k, v in it.skipped.items() if v} == {"read_error": 4}
    error = open_source(spec, "all", **SOURCE)[5]["_error"]
    assert error.startswith(f"{path}: row group 1: cannot read")
    # The pid column is read when the source opens (the split needs it): an error up front.
    _damage_column_chunk(path, group=0, column="pid")
    with pytest.raises(DataError, match=re.escape(f"{path}: cannot read the pid column")):
        open_source(spec, "all", **SOURCE)


# ----------------------------------------------------------------------------- checkpointed state


def test_iterator_state_restores_same_samples(toy_dir, corrupt_parquet):
    config = _config(
        [
            DatasetSpec("maze", os.path.join(toy_dir, "toy_maze"), weight=2.0),
            DatasetSpec("bad", corrupt_parquet),
        ],
        seed=3,
        max_question_chars=4096,
    )
    it = _iterate(config, "train", shuffle=True, repeat=True)
    it.take(13)
    state = json.loads(json.dumps(it.get_state()))  # must survive a JSON round trip
    expected = [(s.dataset, s.pid) for s in it.take(12)]
    skipped_after = dict(it.skipped)

    resumed = _iterate(config, "train", shuffle=True, repeat=True)
    resumed.set_state(state)
    assert resumed.num_yielded == 13
    got = resumed.take(12)
    assert [(s.dataset, s.pid) for s in got] == expected
    assert resumed.skipped == skipped_after
    assert sum(skipped_after.values()) > 0  # the bad rows were crossed and counted


def test_process_shards_are_disjoint(toy_dir):
    config = _config([DatasetSpec("maze", os.path.join(toy_dir, "toy_maze"))])
    shards = [
        [s.pid for s in _iterate(config, "all", shuffle=True, process_index=p, process_count=2)]
        for p in range(2)
    ]
    assert not set(shards[0]) & set(shards[1])
    assert len(shards[0]) + len(shards[1]) == 48
    assert abs(len(shards[0]) - len(shards[1])) <= 1


@pytest.mark.parametrize("block", [1, 3])
def test_process_blocks_reassemble_the_single_process_stream(toy_dir, block):
    # The trainer's multi-host contract: dealing blocks of `block` rows to 2 processes and
    # putting each micro-batch together process-major gives the single-process order.
    specs = [
        DatasetSpec(n, os.path.join(toy_dir, n), weight=1.0) for n in ("toy_maze", "toy_count")
    ]
    config = _config(specs)
    single = [s.pid for s in _iterate(config, "train").take(4 * 2 * block)]
    local = [
        [
            s.pid
            for s in _iterate(
                config, "train", process_index=p, process_count=2, process_block=block
            ).take(4 * block)
        ]
        for p in range(2)
    ]
    joined = []
    for turn in range(4):
        for p in range(2):
            joined += local[p][turn * block : (turn + 1) * block]
    assert joined == single
    assert len(set(single)) == len(single)


# ------------------------------------------------------------------------------------ held-out split


def test_pid_hash_is_sha1_based():
    # sha1("abc") = a9993e36 4706816a ...: the fraction is its first 8 bytes over 2**64.
    assert pid_fraction("abc") == int("a9993e364706816a", 16) / 2.0**64
    pids = [f"pid-{i}" for i in range(2000)]
    held = [p for p in pids if is_heldout(p, 0.2)]
    assert 0.15 < len(held) / len(pids) < 0.25


def test_heldout_split_is_stable_and_disjoint(toy_dir):
    spec = DatasetSpec("maze", os.path.join(toy_dir, "toy_maze"))

    def pids(split, frac):
        source = open_source(spec, split, heldout_fraction=frac, max_reference_rounds=ROUNDS)
        return [source[i]["pid"] for i in range(len(source))]

    train, held = pids("train", 0.25), pids("eval", 0.25)
    assert pids("train", 0.25) == train  # stable
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(pids("all", 0.25))
    # eval = hash-held-out rows of the train file + every row of the test file
    assert {p for p in held if "_test_" in p} == {f"toy_maze_test_{i:05d}" for i in range(8)}
    assert 0 < sum("_train_" in p for p in held) < 40
    assert all(("_train_" in p) for p in train)
    # num_used_data caps after the split
    capped = open_source(
        DatasetSpec("m", spec.path, num_used_data=5),
        "train",
        heldout_fraction=0.25,
        max_reference_rounds=ROUNDS,
    )
    assert [capped[i]["pid"] for i in range(len(capped))] == train[:5]


# ------------------------------------------------------------------------------------------ layouts


def test_jsonl_and_parquet_layouts_read_the_same(toy_dir):
    parquet = list(
        iter_samples(DatasetSpec("x", os.path.join(toy_dir, "toy_count")), "all", **SOURCE)
    )
    jsonl = list(
        iter_samples(DatasetSpec("x", os.path.join(toy_dir, "toy_count_jsonl")), "all", **SOURCE)
    )
    assert len(parquet) == len(jsonl) == 48
    for a, b in zip(parquet, jsonl):
        assert isinstance(a, RawSample) and isinstance(b, RawSample)
        for field in ("pid", "question", "answer", "thoughts", "full_text_only_thought"):
            assert getattr(a, field) == getattr(b, field)
        assert np.array_equal(np.asarray(a.problem_image), np.asarray(b.problem_image))
        assert len(a.vt_images) == len(b.vt_images) == 1
        assert np.array_equal(np.asarray(a.vt_images[0]), np.asarray(b.vt_images[0]))


def test_parquet_random_access_across_row_groups(tmp_path):
    rows = toy.make_rows("toy_maze", "train", 11, seed=5)
    path = str(tmp_path / "train.parquet")
    toy.write_parquet(rows, path, row_group_size=3)
    source = open_source(DatasetSpec("m", path), "all", row_group_cache=1, **SOURCE)
    for i in [10, 0, 4, 3, 9, 1, 7]:
        assert source[i]["pid"] == rows[i]["pid"]
        assert source[i]["problem_image_0"]["bytes"] == rows[i]["problem_image_0"]["bytes"]
    clone = pickle.loads(pickle.dumps(source))  # picklable for multiprocess readers
    assert clone[5]["pid"] == rows[5]["pid"]


def test_config_from_dict(toy_dir):
    config = DataConfig.from_dict(
        {
            "datasets": {"maze": {"path": os.path.join(toy_dir, "toy_maze"), "weight": 2.0}},
            **builders.data_fields(image_transform="vit_thinkmorph_train", max_reference_rounds=1),
        }
    )
    assert config.datasets == (DatasetSpec("maze", os.path.join(toy_dir, "toy_maze"), weight=2.0),)
    assert config.image_transform == ImageTransform.vit_thinkmorph_train()
    assert (
        DataConfig.from_dict(dict(builders.data_fields(), datasets=[{"name": "a", "path": "p"}]))
        .datasets[0]
        .name
        == "a"
    )
    with pytest.raises(TypeError):
        DataConfig.from_dict(dict(builders.data_fields(), datasets=[], no_such_knob=1))
    with pytest.raises(TypeError, match="heldout_fraction"):  # a field the run config sets
        DataConfig.from_dict({"datasets": [], "max_reference_rounds": 1})


# ------------------------------------------------------------------------------------------ mixture


def test_mixture_follows_weights(toy_dir):
    config = _config(
        [
            DatasetSpec("maze", os.path.join(toy_dir, "toy_maze"), weight=3.0),
            DatasetSpec("count", os.path.join(toy_dir, "toy_count_jsonl"), weight=1.0),
        ]
    )
    # More samples than either dataset holds: the mixture repeats each one forever.
    names = [s.dataset for s in _iterate(config, "train", shuffle=True, repeat=True).take(120)]
    share = names.count("maze") / len(names)
    assert 0.65 < share < 0.85 and names.count("count") > 0
    # A single pass reads every row of every dataset once.
    eval_pids = [s.pid for s in _iterate(config, "eval")]
    assert len(eval_pids) == len(set(eval_pids))
    assert {p.split("_")[1] for p in eval_pids} == {"maze", "count"}


def test_build_dataset_emits_skipped_markers(corrupt_parquet):
    dataset, fingerprint = build_dataset(
        _config([DatasetSpec("c", corrupt_parquet)], max_question_chars=4096),
        "all",
        process_index=0,
        process_count=1,
    )
    elements = list(dataset)
    assert sum(isinstance(e, Skipped) for e in elements) == 6 and len(elements) == 16
    assert fingerprint["sizes"] == [16]
    assert isinstance(DataIterator(dataset).take(1)[0].pid, str)


# ----------------------------------------------------------------------------------- toy generator


def _tree_bytes(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def test_toy_generator_is_deterministic(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        make_toy_data.main(
            [
                "--out",
                str(tmp_path / name),
                "--seed",
                str(seed),
                "--num_train",
                "6",
                "--num_test",
                "2",
                "--jsonl",
                "--corpus_out",
                str(tmp_path / f"{name}.txt"),
            ]
        )
    a, b, c = (_tree_bytes(tmp_path / n) for n in "abc")
    assert a == b and len(a) > 4
    assert a != c
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes()
    corpus = (tmp_path / "a.txt").read_text()
    assert corpus == toy.toy_corpus_text(seed=7, num_train=6, num_test=2)
    assert "<answer>" in corpus and "maze" in corpus and "How many" in corpus


def test_toy_rows_are_consistent():
    for row in toy.make_rows("toy_maze", "train", 5, seed=0) + toy.make_rows(
        "toy_count", "test", 5, seed=0
    ):
        problem = Image.open(io.BytesIO(row["problem_image_0"]["bytes"]))
        vt = Image.open(io.BytesIO(row["reasoning_image_0"]["bytes"]))
        assert problem.size == vt.size == (112, 112)
        assert problem.tobytes() != vt.tobytes()  # the VT adds the visual step
        assert row["resoning_thought_1"].endswith(f"So the answer is {row['answer']}.")
        assert row["full_text_only_thought"].endswith(f"So the answer is {row['answer']}.")


# ------------------------------------------------------------------- whole files: checked up front


def test_an_empty_split_is_an_error_naming_the_dataset_and_its_keys(tmp_path):
    """Three rows in one train file: with nothing held out, a run that evaluates has no
    held-out row, and four processes would find fewer train rows than readers."""
    path = tmp_path / "d" / "train.jsonl"
    path.parent.mkdir()
    toy.write_jsonl(toy.make_rows("toy_maze", "train", 3, seed=6), str(path))
    config = _config([DatasetSpec("d", str(path.parent))], heldout_fraction=0.0)
    check_split_sizes(config, 3, evaluates=False)  # a train row for each of three readers
    with pytest.raises(DataError, match=r"'d' .*: its held-out split is empty \(data\.heldout_"):
        check_split_sizes(config, 1, evaluates=True)
    with pytest.raises(DataError, match=r"its train split has 3 rows, fewer than the 4 process"):
        check_split_sizes(config, 4, evaluates=False)


def test_a_corrupt_parquet_file_is_an_error_naming_it(toy_dir, tmp_path):
    from opsd_jax.data.sources import DataError, check_dataset

    folder = tmp_path / "toy_maze" / "data"
    folder.mkdir(parents=True)
    good = os.path.join(toy_dir, "toy_maze", "data", "train-00000-of-00001.parquet")
    (folder / "train-00000-of-00001.parquet").write_bytes(open(good, "rb").read())
    bad = folder / "train-00001-of-00001.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    spec = DatasetSpec("toy_maze", str(tmp_path / "toy_maze"))
    with pytest.raises(DataError, match=str(bad)):
        check_dataset(spec)
    with pytest.raises(DataError, match=str(bad)):  # and when a source opens it
        open_source(spec, "train", **SOURCE)


def test_a_missing_required_column_is_an_error_naming_file_and_column(toy_dir, tmp_path):
    import pyarrow.parquet as pq

    from opsd_jax.data.sources import DataError, check_dataset

    good = os.path.join(toy_dir, "toy_maze", "data", "train-00000-of-00001.parquet")
    folder = tmp_path / "toy_maze" / "data"
    folder.mkdir(parents=True)
    path = folder / "train-00000-of-00001.parquet"
    pq.write_table(pq.read_table(good).drop_columns(["question"]), path)
    with pytest.raises(DataError, match=f"{path} has no column 'question'"):
        check_dataset(DatasetSpec("toy_maze", str(tmp_path / "toy_maze")))
    assert check_dataset(DatasetSpec("toy_maze", os.path.join(toy_dir, "toy_maze"))) == 2
