"""Answer extraction / normalisation, accuracy bookkeeping with scripted outputs, and the evaluate
pipeline end to end on the toy data and toy model (real sampler), output files included."""

import json
from pathlib import Path

import builders
import jax
import numpy as np
import pytest

from opsd_jax import run_config
from opsd_jax.data.image_transform import VitImageInputs, vit_position_ids
from opsd_jax.data.pipeline import Sample
from opsd_jax.evaluation import answers
from opsd_jax.evaluation import evaluate as evaluation
from opsd_jax.sampling import sampler
from opsd_jax.sampling.sampler import Completions
from opsd_jax.toy import data as toy_data
from opsd_jax.toy import model as toy_model

# ---------------------------------------------------------------------------------- answers


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>so B</think><answer> B </answer>", "B"),
        ("<answer>A</answer> wait, no: <answer>(C)</answer>", "(C)"),  # the last tag wins
        ("<ANSWER>\n42\n</Answer>", "42"),  # tags in any case, content over lines
        ("<think>a</think><answer>3.5", "3.5"),  # cut off before </answer>
        ("So the answer is B. The red square is walled off.", "B"),
        ("Final Answer: 42\nDone.", "42"),
        ("The answer is: B", "B"),  # the colon after "is" is not part of the answer
        ("so the final answer is : 42.", "42"),
        # A thought that mentions the tag opens no answer: the match never crosses an <answer>.
        ("<think>I will put it in <answer> tags.</think><answer>B</answer>", "B"),
        ("<answer> tags, so <answer>B</answer>", "B"),
        ("the answer is 3.5 m.", "3.5 m"),  # a decimal point is not a sentence end
        ("answer: 7</think>", "7"),  # stops at the next tag
        ("I think the count is four", None),
        ("the answer is", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert answers.extract_answer(text) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("(B)", "b"),
        ("B.", "b"),
        ("B)", "b"),
        ("B", "b"),
        (" [b] ", "b"),
        ("Option B", "b"),
        ("**B**", "b"),
        ("\\boxed{B}", "b"),
        ("3.0", "3"),
        ("3", "3"),
        ("03", "3"),
        ("1,000", "1000"),
        ("-0", "0"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("$3$", "3"),
        ("  The   Blue\tSquare! ", "the blue square"),
        ("\uff22", "b"),  # full-width B (NFKC)
    ],
)
def test_normalize_answer(raw, expected):
    assert answers.normalize_answer(raw) == expected


@pytest.mark.parametrize(
    "prediction, reference, correct",
    [
        ("(B)", "B", True),
        ("b.", "B", True),
        ("(B) the blue square", "B", True),  # a leading option marker answers a letter
        ("B. the blue square", "A", False),
        ("a red circle", "A", False),  # a word starting with the letter is not an option
        ("3.0", "3", True),
        ("3.01", "3", False),
        ("4", "3", False),
        ("the blue square", "The blue square.", True),
        (None, "A", False),
        ("", "A", False),
    ],
)
def test_is_correct(prediction, reference, correct):
    assert answers.is_correct(prediction, reference) is correct


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy data (2 held-out rows per task) and the toy model, written once for the module."""
    from opsd_jax.io.hf_load import load_hf

    root = tmp_path_factory.mktemp("eval_toy")
    data = toy_data.write_toy_data(str(root / "data"), num_train=4, num_test=2)
    corpus = toy_data.toy_corpus_text(num_train=4, num_test=2).splitlines()
    model_dir = toy_model.write_toy_model(root / "model", corpus=corpus)
    model, _, tokenizer = load_hf(model_dir, config_changes={"llm": {"compute_dtype": "float32"}})
    data_config = builders.data_config(
        [{"name": name, "path": path} for name, path in data.items()],
        image_transform={"max_size": 112, "min_size": 56, "stride": 14, "max_pixels": 112 * 112},
    )
    # The toy heldout split: the test files' rows plus any train rows hashing below 5 %.
    samples = evaluation.load_eval_samples(data_config, "eval", max_per_dataset=2)
    return {"model": model, "tokenizer": tokenizer, "samples": samples, "root": root}


def fake_sample(pid, dataset, answer, num_vt=1):
    def vit(h, w, value):
        return VitImageInputs(
            np.full((h * w, 588), value, np.float32), vit_position_ids(h, w), h, w
        )

    return Sample(
        pid=pid,
        dataset=dataset,
        question=f"question {pid}?",
        answer=answer,
        problem_image=vit(2, 2, 0.5),
        vt_images=[vit(1, 2, -0.5)] * num_vt,
        thoughts=["look", "so"],
        full_text_only_thought=None,
    )


def scripted_stream(texts, tokenizer, seen):
    """A drop-in for engine.stream that 'generates' texts[row_id] for each prompt, packing the
    prompts a pool at a time as the engine asks for them."""

    def stream_fn(model, prompts, rng, *, pool_size, row_ids, on_done, max_new_tokens, **_):
        out = Completions(
            tokens=np.zeros((prompts.count, max_new_tokens), np.int32),
            lengths=np.zeros(prompts.count, np.int32),
            logprobs=np.zeros((prompts.count, max_new_tokens), np.float32),
            finished=np.zeros(prompts.count, bool),
            rounds=np.ones(prompts.count, np.int32),
        )
        for first in range(0, prompts.count, pool_size):
            rows = list(range(first, min(first + pool_size, prompts.count)))
            seen.append((prompts.pack(rows), [int(row_ids[r]) for r in rows]))
            for r in rows:
                ids = tokenizer.encode(texts[row_ids[r]])[:max_new_tokens]
                out.tokens[r, : len(ids)] = ids
                out.lengths[r], out.finished[r] = len(ids), len(ids) < max_new_tokens
                on_done(r, out)
        return out

    return stream_fn


# ---------------------------------------------------------------------------------- scripted


def test_accuracy_of_scripted_outputs_is_exact(toy):
    tokenizer = toy["tokenizer"]
    # (dataset, reference, scripted generation, correct?) decided by hand.
    script = [
        ("maze", "A", "<think>route</think><answer>A</answer>", True),
        ("maze", "B", "<answer>(B)</answer>", True),
        ("maze", "B", "<answer>A</answer>", False),
        ("count", "3", "<answer>3.0</answer>", True),
        ("count", "2", "counting ... so the answer is 2.", True),
        ("count", "4", "<think>one two three</think>", False),
        ("count", "1", "<answer>2</answer>", False),
    ]
    samples = [fake_sample(f"p{i}", d, ref) for i, (d, ref, _, _) in enumerate(script)]
    texts = [text for _, _, text, _ in script]
    seen = []
    result = evaluation.evaluate(
        None,
        samples,
        tokenizer,
        max_new_tokens=64,
        batch_size=3,
        stream_fn=scripted_stream(texts, tokenizer, seen),
    )
    assert [r["correct"] for r in result.records] == [c for *_, c in script]
    assert [r["pid"] for r in result.records] == [s.pid for s in samples]
    assert [r["generation"] for r in result.records] == texts  # decode(encode(t)) == t
    maze, count = result.summary["datasets"]["maze"], result.summary["datasets"]["count"]
    assert maze["num_samples"] == 3 and maze["accuracy"] == pytest.approx(2 / 3)
    assert count["num_samples"] == 4 and count["accuracy"] == pytest.approx(2 / 4)
    overall = result.summary["overall"]
    assert overall["accuracy"] == pytest.approx(4 / 7)
    assert overall["macro_accuracy"] == pytest.approx((2 / 3 + 2 / 4) / 2)
    assert overall["answer_tag_rate"] == pytest.approx(5 / 7)
    lengths = [len(tokenizer.encode(t)) for t in texts]
    assert overall["mean_completion_length"] == pytest.approx(np.mean(lengths))
    assert result.records[4]["extracted"] == "2" and result.records[5]["extracted"] is None
    # Packed as a pool of 3 slots frees up: each prompt once, in its own row.
    assert [rows for _, rows in seen] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [pack.num_rows for pack, _ in seen] == [3, 3, 1]
    scalars = result.scalars()
    assert scalars["eval/accuracy"] == pytest.approx(4 / 7)
    assert scalars["eval/maze/accuracy"] == pytest.approx(2 / 3)
    assert scalars["eval/completion_length"] == pytest.approx(np.mean(lengths))


def test_contexts_give_the_right_prompts(toy):
    tokenizer = toy["tokenizer"]
    samples = [fake_sample("p0", "d", "A", num_vt=2), fake_sample("p1", "d", "B", num_vt=1)]
    packs = {}
    for context, noise in (("student", False), ("teacher", False), ("teacher", True)):
        seen = []
        evaluation.evaluate(
            None,
            samples,
            tokenizer,
            context=context,
            max_new_tokens=4,
            batch_size=2,
            options=builders.prompt_options(noise_vt=noise),
            stream_fn=scripted_stream(["x", "y"], tokenizer, seen),
        )
        packs[context, noise] = seen[0][0]
    student, teacher, noisy = (
        packs["student", False],
        packs["teacher", False],
        packs["teacher", True],
    )
    # Images per row: the problem image only, or the problem image plus the sample's VTs.
    assert student.vit_image_ids.max(axis=1).tolist() == [1, 1]
    assert teacher.vit_image_ids.max(axis=1).tolist() == [3, 2]
    # The teacher's prompt starts with the student's (same tokens, same positions).
    n = int((student.segment_ids[0] > 0).sum())
    np.testing.assert_array_equal(teacher.tokens[0, :n], student.tokens[0, :n])
    # noise_vt changes the VT pixels only: same layout, same problem image.
    np.testing.assert_array_equal(noisy.tokens, teacher.tokens)
    problem = teacher.vit_image_ids == 1
    np.testing.assert_array_equal(noisy.vit_patches[problem], teacher.vit_patches[problem])
    vt = teacher.vit_image_ids > 1
    assert not np.allclose(noisy.vit_patches[vt], teacher.vit_patches[vt])
    with pytest.raises(ValueError, match="context='oracle'"):
        evaluation.evaluate(None, samples, tokenizer, context="oracle")


# ---------------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("do_sample", [False, True])
def test_streamed_evaluation_equals_one_static_batch(toy, do_sample):
    """Through the engine (3 slots, 4 prompts: one waits for a slot) every sample's completion
    is the one `sampler.sample` gives it in a single static batch of all prompts."""
    samples, tokenizer = toy["samples"], toy["tokenizer"]
    settings = dict(max_new_tokens=8, do_sample=do_sample, temperature=1.0, seed=5)
    result = evaluation.evaluate(
        toy["model"], samples, tokenizer, batch_size=3, cache_dtype="float32", **settings
    )
    special = tokenizer.special_tokens()
    options = run_config.prompt_options({})
    static = sampler.sample(
        toy["model"],
        evaluation.build_context_prompt_pack(
            samples, tokenizer.encode, options, special, "student"
        ),
        jax.random.key(5),
        special=special,
        vocab_limit=tokenizer.vocab_length,
        max_new_tokens=8,
        do_sample=do_sample,
        cache_dtype="float32",
    )
    assert len(samples) == 4
    for row, record in enumerate(result.records):
        assert record["generation"] == tokenizer.decode(static.row(row)), row
        assert record["completion_length"] == static.lengths[row]


def test_evaluate_runs_on_the_toy_model_and_writes_files(toy, tmp_path):
    samples = toy["samples"]
    assert {s.dataset for s in samples} == {"toy_maze", "toy_count"}
    lines = []
    result = evaluation.evaluate(
        toy["model"],
        samples,
        toy["tokenizer"],
        context="teacher",
        max_new_tokens=5,
        batch_size=2,
        cache_dtype="float32",
        log=lines.append,
    )
    assert len(result.records) == len(samples) and len(lines) == -(-len(samples) // 2)
    for record, sample in zip(result.records, samples):
        assert record["pid"] == sample.pid and record["reference"] == sample.answer
        assert 0 < record["completion_length"] <= 5
        assert isinstance(record["generation"], str)
    paths = evaluation.save_results(result, tmp_path, "teacher")
    written = [json.loads(x) for x in Path(paths["generations"]).read_text().splitlines()]
    assert [w["pid"] for w in written] == [s.pid for s in samples]
    assert set(written[0]) >= {
        "pid",
        "dataset",
        "question",
        "reference",
        "generation",
        "extracted",
        "correct",
    }
    summary = json.loads(Path(paths["summary"]).read_text())
    assert summary["overall"]["num_samples"] == len(samples)
    assert summary["settings"]["context"] == "teacher"
    table = Path(paths["table"]).read_text()
    assert "| toy_maze |" in table and "| toy_count |" in table and "**overall**" in table


def test_checkpoint_flag_names_a_step_and_its_run(tmp_path):
    from scripts import evaluate as evaluate_cli

    for step, complete in ((3, True), (7, True), (9, False)):
        (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
        if complete:
            (tmp_path / "checkpoints" / str(step) / "commit_success.txt").write_text("ok")
    assert evaluate_cli.step_dir_of(tmp_path).endswith("checkpoints/7")
    assert evaluate_cli.step_dir_of(tmp_path / "checkpoints" / "3").endswith("/3")
    only_incomplete = tmp_path / "other"
    (only_incomplete / "checkpoints" / "5").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        evaluate_cli.step_dir_of(only_incomplete)
    with pytest.raises(FileNotFoundError, match="--checkpoint"):
        evaluate_cli.step_dir_of(tmp_path / "nope")
    # The run a checkpoint belongs to, from any of the three ways to name it.
    for given in (tmp_path, tmp_path / "checkpoints", tmp_path / "checkpoints" / "3"):
        assert evaluate_cli.run_dir_of(given) == str(tmp_path)


def test_cli_writes_under_the_run_by_default(tmp_path, monkeypatch, capsys):
    """`--checkpoint RUN` without `--out` writes to RUN/eval/, beside the trainer's evaluations
    (model loading and sampling are stubbed: only where the files go is checked here)."""
    from scripts import evaluate as evaluate_cli

    (tmp_path / "run" / "checkpoints" / "3").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "3" / "commit_success.txt").write_text("ok")
    monkeypatch.setattr(
        evaluate_cli, "setup", lambda args: (None, None, [], builders.prompt_options(), None, None)
    )
    records = [
        {
            "dataset": "d",
            "correct": True,
            "completion_length": 1,
            "has_answer_tag": True,
            "finished": True,
        }
    ]
    monkeypatch.setattr(
        evaluation,
        "evaluate",
        lambda *a, **k: evaluation.EvalResult(records, evaluation.summarize(records)),
    )
    monkeypatch.chdir(tmp_path)
    evaluate_cli.main(["--checkpoint", str(tmp_path / "run")])
    assert not (tmp_path / "results").exists()
    summary = tmp_path / "run" / "eval" / "step3_student_evaluate_summary.json"
    assert summary.is_file() and f"summary: {summary}" in capsys.readouterr().out
    # Another step of the same run, and another item of it, get their own files; the trainer's
    # own step<N>_<context> evaluation (the run's held-out history) is never written over.
    (tmp_path / "run" / "checkpoints" / "5").mkdir()
    (tmp_path / "run" / "checkpoints" / "5" / "commit_success.txt").write_text("ok")
    trainers = summary.parent / "step5_student_summary.json"
    trainers.write_text("the trainer's")
    step_5 = str(tmp_path / "run" / "checkpoints" / "5")
    evaluate_cli.main(["--checkpoint", step_5])
    evaluate_cli.main(["--checkpoint", step_5, "--params", "ema_params"])
    assert summary.is_file() and (summary.parent / "step5_student_evaluate_summary.json").is_file()
    assert (summary.parent / "step5_student_ema_evaluate_summary.json").is_file()
    assert trainers.read_text() == "the trainer's"


def test_cli_on_an_fsdp_mesh(toy, tmp_path, capsys):
    """scripts/evaluate.py in-process: 8 CPU devices (conftest), prompt rows sharded over them."""
    from scripts import evaluate as evaluate_cli

    data = toy["root"] / "data"
    evaluate_cli.main(
        [
            "--model_dir",
            str(toy["root"] / "model"),
            "--compute_dtype",
            "float32",
            "--data",
            f"toy_maze={data / 'toy_maze'}",
            "--data",
            f"toy_count={data / 'toy_count'}",
            "--image_size",
            "112,56",
            "--num_samples",
            "1",
            "--batch_size",
            "8",
            "--max_new_tokens",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert "| toy_maze | 1 |" in out and "| **overall** | 2 |" in out
    summary = json.loads((tmp_path / "student_summary.json").read_text())
    assert summary["settings"]["max_new_tokens"] == 3
    assert summary["overall"]["mean_completion_length"] <= 3
    with pytest.raises(SystemExit, match="--noise_vt only changes the teacher context"):
        evaluate_cli.main(["--model_dir", "x", "--noise_vt"])
    with pytest.raises(SystemExit, match="does not exist"):
        evaluate_cli.main(["--model_dir", str(toy["root"] / "model"), "--data", "a=/nope"])
