"""The paper's benchmarks in process (opsd_jax/evaluation/benchmarks): VLMEvalKit-layout TSVs
written here, read back, prompted, decoded by the toy model and scored; the judge-free rules on
the answers that trip rule-based scorers."""

import dataclasses
import json
import re

import builders
import numpy as np
import pytest
from PIL import Image

from opsd_jax import run_config
from opsd_jax.data.image_transform import ImageTransform
from opsd_jax.evaluation.benchmarks import prompts, registry, run, scoring, tsv
from opsd_jax.toy import data as toy_data
from opsd_jax.toy import model as toy_model

OPTIONS = {"A": "a cat", "B": "a dog", "C": "a bird"}


# ---------------------------------------------------------------- multiple choice: the letter


@pytest.mark.parametrize(
    "prediction, choice",
    [
        ("B", "B"),
        ("B.", "B"),  # trailing punctuation
        ("(B)", "B"),
        ("The answer is B.", "B"),
        ("Answer: **B**", "B"),
        ("<answer>B</answer>", "B"),  # one word to the letter rule; the marked answer names B
        ("<think>A cat? No.</think><answer>C</answer>", "C"),  # the thought's 'A' is not a word
        ("a dog", "B"),  # the option's text instead of its letter
        ("I think it is a dog.", "B"),
        ("b", "Z"),  # lower case names no option
        ("A or B", "Z"),  # several letters: ambiguous
        ("A cat is shown in the picture, so the answer is the first one", "Z"),  # early 'A'
        ("Z", "Z"),
        ("Cannot determine the answer", "Z"),
        ("", "Z"),
        # multiple_choice.py `extract_answer_from_item` reads the first boxed text when the
        # tag pair is missing (even with a lone <answer>), and not when the tag is there
        ("<think>...</think> \\boxed{C}", "C"),
        ("A or B? <answer> \\boxed{C}", "C"),
        ("A or B? <answer> C </answer> \\boxed{A}", "C"),
        ("A or B? <answer></answer> \\boxed{C}", "Z"),  # an empty cut is not read
    ],
)
def test_choice_of(prediction, choice):
    assert scoring.choice_of(prediction, OPTIONS) == choice


def test_a_letter_counts_only_near_the_end():
    assert scoring.letter_in("so it is B and not the other", OPTIONS) is None  # 4th of 8 words
    assert scoring.letter_in("so it is B in the end", OPTIONS) == "B"  # 4th from the end


def test_circular_groups_need_every_rotation():
    assert scoring.circular_hits({0: [True, True], 1: [True, False]}) == {0: True, 1: False}
    assert scoring.pair_accuracy([True, True, True, False]) == 0.5


# ---------------------------------------------------------------- ChartQA: tag and relaxed accuracy

# The harness's ChartQA rule (hychaochao/VLMEvalKit_Thinkmorph, vlmeval/dataset/utils/refocus.py):
# `process_line` strips the tagged answer and hands it to `relaxed_correctness` as the reference
# with each gold answer as the value tested, and that function turns a text into a number only
# through Python's float() (after dividing off a trailing %), else compares lower-cased texts.
# So '$1,200' or '12 million' is text there, and the 5% is a share of the prediction. The loose
# parse strips currency, thousands commas and a unit word and measures 5% of the gold.


@pytest.mark.parametrize(
    "gold, prediction, harness, loose",
    [
        ("50", "52", True, True),  # within 5 %
        ("50", "53", False, False),
        ("1200", "$1,200", False, True),  # currency and thousands commas: text to the harness
        ("1200", "1,200", False, True),
        ("12", "12 million", False, True),  # a unit word: text to the harness
        ("3.5", "$3.5", False, True),
        ("0.45", "45%", True, True),  # a percent is a fraction: 0.45
        ("45", "45%", False, False),
        ("100", "95.2", False, True),  # 4.8 is 4.8 % of the gold, 5.04 % of the prediction
        ("100", "105.2", True, False),  # 5.2 is 5.2 % of the gold, 4.94 % of the prediction
        ("1000", "1e3", True, False),  # float() reads exponents; the loose parse does not
        ("Yes", "yes", True, True),
        ("Yes", " yes ", True, True),  # the harness strips the prediction
        ("0", "0.01", False, False),  # 0.01 off is all of the prediction; a gold 0 is text
        ("0", "0", True, True),  # a prediction 0 compares as text
        ("Germany", "France", False, False),
    ],
)
def test_relaxed_correct_as_the_harness_parses_and_loosely(gold, prediction, harness, loose):
    assert scoring.relaxed_correct(gold, prediction) is harness  # the harness's is the default
    assert scoring.relaxed_correct(gold, prediction, parse="harness") is harness
    assert scoring.relaxed_correct(gold, prediction, parse="loose") is loose


def test_an_unknown_chartqa_parse_is_named():
    with pytest.raises(ValueError, match=r"'lenient': one of harness, loose"):
        scoring.relaxed_correct("1", "1", parse="lenient")
    with pytest.raises(ValueError, match=r"'lenient': one of harness, loose"):
        run.evaluate_benchmarks(None, None, [], "nowhere", options=None, chartqa_parse="lenient")


def test_chartqa_reads_only_the_tag_and_gold_lists():
    # refocus.py `Refocus_extract_answer`: the tag's text when both tags are there, else the
    # judge; its `Round_k:` labels are blanked first.
    assert scoring.chartqa_answer("<think>x</think><answer> 42 </answer>") == "42"
    assert scoring.chartqa_answer("thinking\n\n 17 ") is None  # no last-line fallback
    assert scoring.chartqa_answer("so \\boxed{17}") is None  # nor a boxed one
    assert scoring.chartqa_answer("<answer>Round_1:\n17</answer>") == "17"
    assert scoring.gold_answers("['7', '8']") == ["7", "8"]
    assert scoring.gold_answers("7") == ["7"]


# ---------------------------------------------------------------- the <answer> cut

# The harness cuts the tag in two places the same way: `extract_answer_from_item` (multiple
# choice, vlmeval/dataset/utils/multiple_choice.py) and `Refocus_extract_answer` (ChartQA): when
# the prediction holds both '<answer>' and '</answer>', it splits on '<answer>', keeps the piece
# after the first one, and keeps that piece's text before its first '</answer>'. The old regex
# search below is what this project used before.
OLD_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


@pytest.mark.parametrize(
    "prediction, cut, old",
    [
        ("<answer> B </answer>", " B ", " B "),  # unstripped
        # The thinking names the tag: the cut stops at the real tag, the regex spans to its end.
        (
            "<think>Put it in <answer> tags.</think><answer> B </answer>",
            " tags.</think>",
            " tags.</think><answer> B ",
        ),
        ("<answer>A <answer>B</answer>", "A ", "A <answer>B"),  # a second <answer> ends it
        ("The closing tag is </answer>. <answer> B", " B", None),  # to the end
        ("<answer> B", None, None),  # no </answer>: no tag
        ("<ANSWER>B</ANSWER>", None, None),  # case-sensitive, both
        ("<answer></answer>", "", ""),
    ],
)
def test_the_tag_is_cut_as_the_harness_cuts_it(prediction, cut, old):
    assert scoring.tagged_answer(prediction) == cut
    found = OLD_TAG.search(prediction)
    assert (found.group(1) if found else None) == old


def test_a_thought_naming_the_tag_is_no_rule_answer():
    """The whole text names B and C (ambiguous), and the harness's cut holds no letter, so its
    judge would read this; the old regex read the real tag's B."""
    prediction = (
        "<think>Is it C or not? The letter goes in <answer> tags.</think><answer> B </answer>"
    )
    assert scoring.rule_choice(prediction, OPTIONS) is None
    assert scoring.infer_choice(OLD_TAG.search(prediction).group(1), OPTIONS) == "B"
    # The cut runs to the end when the only </answer> comes first; the regex found nothing.
    late = "A or C? The closing tag is </answer>. <answer> B"
    assert scoring.rule_choice(late, OPTIONS) == "B" and not OLD_TAG.search(late)


# ---------------------------------------------------------------- VSP mazes


@pytest.mark.parametrize(
    "prediction, solves",
    [
        ("\\boxed{R, D}", True),  # S F / H G: right, then down onto G
        ("\\boxed{D}", False),  # onto the hole
        ("\\boxed{R}", False),  # stops short of G
        ("\\boxed{U}", False),  # off the map
        ("\\boxed{RD}", False),  # moves must be comma-separated
        ("\\boxed{D} then \\boxed{R,D}", True),  # the last boxed list counts
        ("\x08oxed{R,D}", True),  # '\b' read as a backspace
        ("no path", False),
    ],
)
def test_maze_path_solves(prediction, solves):
    assert scoring.maze_path_solves(prediction, "['SF', 'HG']") is solves


def test_the_maze_path_is_the_last_boxed_move_list_tag_or_not():
    # frozen_lake.py `extract_path_from_response`: the harness's rule for VSP is this regex on
    # the whole prediction (its judge call is commented out), so a boxed path needs no tag.
    assert scoring.maze_path("<answer>no</answer> \\boxed{R , D}") == "R,D"
    assert scoring.maze_path("\\boxed{R,D} <answer>\\boxed{L}</answer>") == "L"
    assert scoring.maze_path("<answer>R,D</answer>") is None


# ---------------------------------------------------------------- the TSV layout


def picture(seed, size=(28, 28)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))


def test_tsv_round_trip_with_lists_aliases_and_missing_options(tmp_path):
    path = tmp_path / "MMVP.tsv"
    tsv.write_tsv(
        path,
        [
            dict(
                index=1,
                image=picture(1),
                question="Is it red?",
                A="yes",
                B="no",
                C=None,
                answer="A",
                hint="Look closely",
                category="color",
            ),
            dict(index=2, image=1, question="Is it blue?", A="yes", B="no", answer="B"),
            dict(
                index=3,
                image=[picture(2), picture(3)],
                question="Same?",
                A="0.50",
                B="1",
                answer="A",
            ),
            dict(index=4, image=None, question="no image", answer="A"),
        ],
    )
    file = tsv.read_tsv(path)
    assert [r.index for r in file.rows] == [1, 2, 3] and file.skipped == {"no_image": 1}
    first, alias, pair = file.rows
    assert first.options == {"A": "yes", "B": "no"} and first.hint == "Look closely"
    assert first.extra == {"category": "color"} and first.answer == "A"
    assert alias.images_b64 == first.images_b64  # row 2 reuses row 1's image
    assert len(pair.images_b64) == 2 and pair.options == {"A": "0.50", "B": "1"}  # text kept
    assert np.array_equal(np.asarray(pair.images()[1]), np.asarray(picture(3)))


def test_bad_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        tsv.read_tsv(tmp_path / "nope.tsv")
    bad = tmp_path / "bad.tsv"
    bad.write_text("index\tquestion\n1\tq\n")
    with pytest.raises(tsv.BenchmarkFileError, match=r"bad.tsv: no column 'image'"):
        tsv.read_tsv(bad)
    bad.write_text(f"index\timage\tquestion\nx\t{'A' * 80}\tq\n")
    with pytest.raises(tsv.BenchmarkFileError, match=r"bad.tsv, line 2: index 'x'"):
        tsv.read_tsv(bad)


def test_cells_mean_what_pandas_reads_them_as_in_the_harness(tmp_path):
    """VLMEvalKit reads its TSVs with pandas: its missing-value words are empty cells (the
    option is not offered) and a column of numbers is numbers; aliases may point forward."""
    path = tmp_path / "BLINK.tsv"
    tsv.write_tsv(
        path,
        [
            dict(index=1, image=2, question="How many?", A="0.50", B="None", C="2", answer="A"),
            dict(index=2, image=picture(4), question="Which?", A="1.25", B="N/A", C="3"),
        ],
    )
    first, second = tsv.read_tsv(path).rows
    assert first.options == {"A": "0.5", "C": "2"}  # 'None' is pandas' NaN; 0.50 a float
    assert second.options == {"A": "1.25", "C": "3"} and second.answer is None
    assert first.images_b64 == second.images_b64  # a forward alias
    bad = tmp_path / "bad.tsv"
    tsv.write_tsv(bad, [dict(index=1, image=7, question="q")])
    with pytest.raises(tsv.BenchmarkFileError, match=r"bad.tsv, line 2: column 'image' refers"):
        tsv.read_tsv(bad)


def test_images_are_what_the_harness_dumps_and_reads_back(tmp_path):
    """One image goes through the harness's `<index>.jpg` file (a JPEG encode); a list through
    `<index>_<i>.png` files (lossless)."""
    path = tmp_path / "MMVP.tsv"
    tsv.write_tsv(
        path,
        [
            dict(index=5, image=picture(1, (64, 64)), question="q"),
            dict(index=6, image=[picture(2), picture(3)], question="q"),
        ],
    )
    one, two = tsv.read_tsv(path).rows
    assert one.image_files == ("5.jpg",) and two.image_files == ("6_0.png", "6_1.png")
    original = np.asarray(picture(1, (64, 64)))
    seen = np.asarray(one.images()[0])
    assert seen.shape == original.shape and not np.array_equal(seen, original)
    assert np.array_equal(seen, np.asarray(tsv.as_harness_file(picture(1, (64, 64)), "x.jpg")))
    assert np.array_equal(np.asarray(two.images()[0]), np.asarray(picture(2)))


def test_the_model_input_is_images_first_then_one_text_with_placeholders():
    mc = registry.BENCHMARKS["blink_jigsaw"].datasets[0]
    row = tsv.BenchmarkRow(1, ("x", "y"), "Which piece?", {"A": "left"}, "A", None, {})
    order, text = prompts.model_input(prompts.message(row, mc))
    assert order == [0, 1]
    assert text == (
        "<img><|image_1|></img> <img><|image_2|></img> Question: Which piece?\nOptions:\n"
        "A. left\n" + prompts.CHOOSE + "\n"
    )
    # VSP's tags place its images (an unnamed one is left out, <TEST-IMAGE> is the last).
    vsp = registry.BENCHMARKS["vsp"].datasets[0]
    maze = tsv.BenchmarkRow(
        2, ("a", "b", "c"), "See <IMAGE-1>. Now: <TEST-IMAGE> Path?", {}, "", None, {}
    )
    parts = prompts.message(maze, vsp)
    assert parts == ["See ", 0, ". Now: ", 2, " Path?"]
    assert prompts.model_input(parts) == (
        [0, 2],
        "See  <img><|image_1|></img> . Now:  <img><|image_2|></img>  Path?",
    )
    plain = tsv.BenchmarkRow(3, ("a",), "Path?", {}, "", None, {})
    assert prompts.message(plain, vsp) == [0, "Path?"]


@pytest.mark.parametrize(
    "dataset, prediction, hit, ruled",
    [
        ("MMVP", "<answer>B</answer>", True, True),
        ("MMVP", "The answer is A.", False, True),
        ("MMVP", "I am not sure about this one", False, False),  # the harness's judge reads it
        ("MMVP", "Z", False, True),
        ("MMVP", "<think>A or C</think> \\boxed{B}", True, True),  # boxed: a rule answer
        ("ChartQA_h_bar", "<answer>12</answer>", True, True),
        ("ChartQA_h_bar", "<answer>$12</answer>", False, True),  # read, but '$12' is no number
        ("ChartQA_h_bar", "It is about 12", False, False),  # no tag: the judge, a miss here
        ("ChartQA_h_bar", "It is\n12", False, False),  # not even as the last line
        # refocus.py reads only the tag: a boxed-only answer goes to the judge (the old rule
        # read it as the answer)
        ("ChartQA_h_bar", "<think>about 12</think> \\boxed{12}", False, False),
        ("VSP_maze_task_main_original", "no path", False, True),  # mazes have no judge
        ("VSP_maze_task_main_original", "\\boxed{R}", True, True),  # boxed, untagged: a rule
    ],
)
def test_answers_the_rules_cannot_read_are_counted(dataset, prediction, hit, ruled):
    d = next(d for b in registry.BENCHMARKS.values() for d in b.datasets if d.name == dataset)
    row = tsv.BenchmarkRow(1, ("x",), "q", dict(OPTIONS), "B", None, {"maze_map": "['SG']"})
    if dataset.startswith("ChartQA"):
        row = dataclasses.replace(row, options={}, answer="12")
    score = run.score_row(row, d, prediction)
    assert (score.hit, score.ruled) == (hit, ruled)


def test_the_runner_scores_chartqa_with_the_parse_it_is_given():
    d = registry.BENCHMARKS["chartqa"].datasets[0]
    row = tsv.BenchmarkRow(1, ("x",), "q", {}, "['1200', '1.2k']", None, {})
    tagged = "<think>about 1,200</think><answer> $1,200 </answer>"
    assert run.score_row(row, d, tagged) == run.Score(False, "$1,200", True)
    assert run.score_row(row, d, tagged, "loose") == run.Score(True, "$1,200", True)
    untagged = "about 1200"  # the judge's, in either parse: a miss here
    assert run.score_row(row, d, untagged, "loose") == run.Score(False, "", False)


def table_summary(parse, names=("chartqa",)):
    entry = dict(
        title="ChartQA",
        judge_free_where_paper_judged=True,
        score=50.0,
        mean_output_tokens=10.0,
        seconds_per_sample=0.1,
        judge_fallback_percent=25.0,
    )
    table = {name: dict(entry, title=name) for name in names}
    return dict(benchmarks=table, average=50.0, complete=False, chartqa_parse=parse)


def test_the_table_names_the_chartqa_parse():
    harness = run.markdown_table(table_summary("harness"))
    loose = run.markdown_table(table_summary("loose"))
    assert "ChartQA parse: harness (" in harness and "loose" not in harness
    assert "ChartQA parse: loose (" in loose and "harness (" not in loose
    assert "ChartQA parse" not in run.markdown_table(table_summary("loose", names=("mmvp",)))


def test_images_larger_than_the_vit_grid_are_refused_before_decoding():
    transform, pre_resize = run.harness_images()
    assert (transform.max_size, pre_resize.max_size) == (980, 1024)
    run.check_image_grid(transform, 14, 70)  # BAGEL's grid takes the harness's images
    with pytest.raises(ValueError, match=r"980 px are 70 patches of 14 px .* grid of 40"):
        run.check_image_grid(transform, 14, 40)


def test_the_multiple_choice_prompt_is_the_harness_layout():
    row = tsv.BenchmarkRow(1, ("x",), "What is it?", {"A": "cat", "B": "dog"}, "A", "a pet", {})
    text = prompts.question_text(row, registry.BENCHMARKS["mmvp"].datasets[0])
    assert text == (
        "Hint: a pet\nQuestion: What is it?\nOptions:\nA. cat\nB. dog\n"
        "Please select the correct answer from the options above. \n"
    )
    cv = registry.BENCHMARKS["cvbench"].datasets[0]
    assert (
        prompts.question_text(row.__class__(1, (), "q", {}, "A", None, {"prompt": "P"}), cv) == "P"
    )


def test_unknown_benchmarks_are_named():
    with pytest.raises(ValueError, match=r"unknown 'chart'.*vsp, vispuzzle"):
        registry.benchmarks_named("vsp,chart")
    assert [b.name for b in registry.benchmarks_named("all")] == list(registry.PAPER_ORDER)


# ---------------------------------------------------------------- end to end on the toy model


def mcq(i):
    return dict(
        index=i,
        image=picture(i),
        question=f"Which shape is shown? ({i})",
        A="circle",
        B="square",
        C="triangle",
        D=None,
        answer="B",
    )


def write_benchmarks(data_dir):
    """Two rows of every dataset of the nine benchmarks, with real-looking fields."""
    rows = {
        "VSP_maze_task_main_original": [
            dict(
                index=i,
                image=picture(i),
                question="Find a path from S to G.",
                answer="R,D",
                maze_map="['SF', 'HG']",
                maze_size=2,
            )
            for i in (0, 1)
        ],
        "ChartQA_h_bar": [
            dict(index=i, image=picture(i), question="What is the value of A?", answer="12")
            for i in (0, 1)
        ],
        "ChartQA_v_bar": [
            dict(index=i, image=picture(i), question="Which bar is tallest?", answer="['A', 'a']")
            for i in (0, 1)
        ],
        "SAT_circular": [
            dict(
                mcq(i),
                index=i + k * 1_000_000,
                A=["circle", "square"][k],
                B=["square", "circle"][k],
                answer="BA"[k],
            )
            for i in (0, 1)
            for k in (0, 1)
        ],
        "CV-Bench-2D": [
            dict(mcq(i), prompt="How many? (A) 1 (B) 2", source=["ADE20K", "COCO"][i])
            for i in (0, 1)
        ],
        "CV-Bench-3D": [dict(mcq(i), prompt="Which is closer? (A) x (B) y") for i in (0, 1)],
        "BLINK_Jigsaw": [dict(mcq(i), image=[picture(i), picture(i + 5)]) for i in (0, 1)],
    }
    for b in registry.BENCHMARKS.values():
        for d in b.datasets:
            tsv.write_tsv(data_dir / f"{d.name}.tsv", rows.get(d.name, [mcq(0), mcq(1)]))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from opsd_jax.io.hf_load import load_hf

    root = tmp_path_factory.mktemp("bench_toy")
    corpus = toy_data.toy_corpus_text(num_train=4, num_test=2).splitlines()
    model_dir = toy_model.write_toy_model(root / "model", corpus=corpus)
    model, _, tokenizer = load_hf(model_dir, config_changes={"llm": {"compute_dtype": "float32"}})
    (root / "data").mkdir()
    write_benchmarks(root / "data")
    return model, tokenizer, root, model_dir


@pytest.mark.slow
def test_every_benchmark_reads_prompts_decodes_and_scores(toy, tmp_path):
    model, tokenizer, root, _ = toy
    benchmarks = registry.benchmarks_named("all")
    result = run.evaluate_benchmarks(
        model,
        tokenizer,
        benchmarks,
        str(root / "data"),
        options=run_config.prompt_options({}),
        decode=run.DecodeSettings(max_new_tokens=6, batch_size=2),
        image_transform=ImageTransform(56, 28, 14),
        seeds=(0, 1),
    )
    records, summary = result["records"], result["summary"]
    rows = sum(
        len(tsv.read_tsv(root / "data" / f"{d.name}.tsv").rows)
        for b in benchmarks
        for d in b.datasets
    )
    assert len(records) == 2 * rows  # every row, for each seed
    assert all(0 < r["output_tokens"] <= 6 and r["seconds"] > 0 for r in records)
    assert summary["complete"] and list(summary["benchmarks"]) == list(registry.PAPER_ORDER)
    for name, entry in summary["benchmarks"].items():
        assert 0.0 <= entry["score"] <= 100.0, name
        assert len(next(iter(entry["datasets"].values()))["per_seed"]) == 2
    assert summary["benchmarks"]["sat"]["datasets"]["SAT_circular"]["rows"] == 4  # 2 groups
    assert "pair_accuracy" in summary["benchmarks"]["mmvp"]["datasets"]["MMVP"]
    # Greedy: both seeds decode alike.
    first = [r["prediction"] for r in records if r["seed"] == 0]
    assert first == [r["prediction"] for r in records if r["seed"] == 1]
    # Each record's hit is what the scorer says of its prediction.
    for r in records[:6]:
        if r["dataset"] in ("MMVP", "VisPuzzle"):
            assert r["hit"] == (
                scoring.choice_of(r["prediction"], {"A": "circle", "B": "square", "C": "triangle"})
                == "B"
            )
    paths = run.save(result, str(tmp_path))
    table = open(paths["table"]).read()
    assert table.startswith("| | VSP | VisPuzzle* | ChartQA* | V** |") and "| Avg |" in table
    assert summary["chartqa_parse"] == "harness" and "ChartQA parse: harness (" in table
    assert open(paths["records"]).read().count("\n") == len(records)


def test_missing_files_are_all_named_before_any_decoding(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"MMVP.tsv, .*BLINK.tsv"):
        run.check_files(str(tmp_path), registry.benchmarks_named("mmvp,blink"))


@pytest.mark.slow
def test_on_the_mesh_the_predictions_are_the_same(toy):
    """Sharded over the 8 simulated devices (a replicated decode copy, rows over the devices),
    greedy decoding gives the single-device predictions."""
    from opsd_jax.io.hf_load import load_hf
    from opsd_jax.parallel.mesh import make_mesh

    model, tokenizer, root, model_dir = toy
    mesh = make_mesh()  # the model as the evaluation script loads it: sharded over the mesh
    on_mesh, _, _ = load_hf(
        model_dir, mesh=mesh, config_changes={"llm": {"compute_dtype": "float32"}}
    )
    settings = dict(
        options=run_config.prompt_options({}),
        decode=run.DecodeSettings(max_new_tokens=6, batch_size=8),
        image_transform=ImageTransform(56, 28, 14),
    )
    benchmarks = registry.benchmarks_named("mmvp,sat")
    alone = run.evaluate_benchmarks(model, tokenizer, benchmarks, str(root / "data"), **settings)
    sharded = run.evaluate_benchmarks(
        on_mesh, tokenizer, benchmarks, str(root / "data"), mesh=mesh, **settings
    )
    assert [r["prediction"] for r in sharded["records"]] == [
        r["prediction"] for r in alone["records"]
    ]


def script_args(model_dir, data_dir, out, benchmarks, *extra):
    return [
        "--model_dir",
        str(model_dir),
        "--compute_dtype",
        "float32",
        "--benchmarks",
        benchmarks,
        "--data_dir",
        str(data_dir),
        "--limit",
        "1",
        "--max_new_tokens",
        "4",
        "--image_size",
        "56,28",
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.slow
def test_the_evaluate_script_runs_the_benchmarks(toy, tmp_path, capsys):
    from scripts import evaluate as evaluate_cli

    _, _, root, model_dir = toy
    evaluate_cli.main(script_args(model_dir, root / "data", tmp_path, "vsp,mmvp"))
    printed = capsys.readouterr().out
    assert "| | VSP | MMVP | Avg |" in printed and "not all nine benchmarks" in printed
    lines = (tmp_path / "benchmarks" / "benchmark_records.jsonl").read_text().splitlines()
    assert len(lines) == 2  # one row of each
    prompt = tmp_path / "system.txt"
    prompt.write_text("Think first.")
    own = tmp_path / "own"
    evaluate_cli.main(
        script_args(model_dir, root / "data", own, "mmvp", "--system_prompt_file", str(prompt))
    )
    assert len((own / "benchmarks" / "benchmark_records.jsonl").read_text().splitlines()) == 1
    loose = tmp_path / "loose"
    evaluate_cli.main(
        script_args(model_dir, root / "data", loose, "chartqa", "--chartqa_parse", "loose")
    )
    assert "ChartQA parse: loose (" in capsys.readouterr().out
    summary = json.loads((loose / "benchmarks" / "benchmark_summary.json").read_text())
    assert summary["chartqa_parse"] == "loose"
    with pytest.raises(SystemExit):  # argparse names the choices
        evaluate_cli.main(
            script_args(model_dir, root / "data", loose, "chartqa", "--chartqa_parse", "x")
        )
    with pytest.raises(SystemExit, match="unknown 'mmvpp'"):
        evaluate_cli.main(script_args(model_dir, root / "data", tmp_path, "mmvpp"))
    with pytest.raises(SystemExit, match="BLINK.tsv"):
        evaluate_cli.main(script_args(model_dir, tmp_path, tmp_path, "blink"))


@pytest.mark.parametrize("batch_size", ["0", "-3"])
def test_a_batch_size_below_one_stops_the_script_before_any_load(tmp_path, monkeypatch, batch_size):
    """--benchmarks with --batch_size < 1 is named before the config or the model loads (0 used
    to fail with a ZeroDivisionError after the whole decode, a negative value ran silently)."""
    from scripts import evaluate as evaluate_cli

    builders.refuse_loads(
        monkeypatch, "--batch_size", (evaluate_cli, "load_config"), (evaluate_cli, "load_model")
    )
    tsv.write_tsv(tmp_path / "MMVP.tsv", [mcq(0)])
    argv = script_args(tmp_path, tmp_path, tmp_path / "out", "mmvp", "--batch_size", batch_size)
    with pytest.raises(SystemExit, match=f"--batch_size must be >= 1, got {batch_size}"):
        evaluate_cli.main(argv)


def test_the_runner_refuses_a_batch_size_below_one(tmp_path):
    tsv.write_tsv(tmp_path / "MMVP.tsv", [mcq(0)])
    with pytest.raises(ValueError, match="decode.batch_size must be >= 1, got 0"):
        run.evaluate_benchmarks(
            None,  # refused before the model is used
            None,
            registry.benchmarks_named("mmvp"),
            str(tmp_path),
            options=run_config.prompt_options({}),
            decode=run.DecodeSettings(batch_size=0),
        )


def test_the_help_names_the_decoding_defaults_of_each_mode(monkeypatch, capsys):
    """--max_new_tokens / --max_image_skips: the held-out mode fills them from the config, the
    --benchmarks mode from the paper's protocol; the help says both, as the code does."""
    from scripts import evaluate as evaluate_cli

    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: the phrases are not wrapped
    with pytest.raises(SystemExit):
        evaluate_cli.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "(default: the config's sample_max_new_tokens; "
        "with --benchmarks: 1024, 4096 with --harness_sampling)"
    ) in help_text
    assert "(default: the config's sample_max_image_skips; with --benchmarks: 0)" in help_text
    assert "with --benchmarks: 0.3 under --harness_sampling, whatever this says" in help_text
    assert "with --benchmarks: not read; --seeds gives the seeds" in help_text
    parser = evaluate_cli.build_parser()
    harness = evaluate_cli.benchmark_decode_settings(
        parser.parse_args(["--benchmarks", "mmvp", "--harness_sampling", "--temperature", "0.9"])
    )
    assert harness.temperature == 0.3  # as the help says
    paper = evaluate_cli.benchmark_decode_settings(parser.parse_args(["--benchmarks", "mmvp"]))
    assert (paper.max_new_tokens, paper.max_image_skips, paper.do_sample) == (1024, 0, False)
    harness = evaluate_cli.benchmark_decode_settings(
        parser.parse_args(["--benchmarks", "mmvp", "--harness_sampling"])
    )
    assert (harness.max_new_tokens, harness.do_sample, harness.temperature) == (4096, True, 0.3)


def test_prompt_items_are_system_images_then_text():
    import dataclasses

    from opsd_jax.data.image_transform import VitImageInputs
    from opsd_jax.data.packing import Image as PackImage
    from opsd_jax.data.packing import Text

    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    vit = VitImageInputs(np.zeros((4, 588), np.float32), np.arange(4, dtype=np.int32), 2, 2)
    options = dataclasses.replace(run_config.prompt_options({}), system_prompt="Think first.")
    items = prompts.prompt_items([vit, vit], "Question: q\n", encode, options)
    assert [type(i) for i in items] == [Text, PackImage, PackImage, Text]
    assert items[0].ids == encode("Think first.") and items[-1].ids == encode("Question: q\n")
    bare = dataclasses.replace(options, use_system_prompt=False)
    assert [type(i) for i in prompts.prompt_items([vit], "q", encode, bare)] == [PackImage, Text]
