"""K_gen: the KL math against numpy, exactly 0 for identical contexts, positive with VT images,
and the chunked per-entry KL equal to numpy's KL of the full [R, C, V] logits."""

import dataclasses
import functools
import json

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from opsd_jax import run_config
from opsd_jax.data.image_transform import VitImageInputs, vit_position_ids
from opsd_jax.data.opsd_packs import build_training_packs
from opsd_jax.data.packing import SpecialTokens
from opsd_jax.data.pipeline import Sample, reference_completion
from opsd_jax.evaluation import kl_diagnostic
from opsd_jax.io.hf_load import load_hf
from opsd_jax.toy import model as toy_model

SPECIAL = SpecialTokens(im_start=1000, im_end=1001, vision_start=1002, vision_end=1003)
VOCAB_LIMIT = 1004  # rows 1004.. of the tiny embedding table are padding

MAX_FORWARD = run_config.defaults().max_forward_tokens  # the run default


class CharTokenizer:
    """Enough of BagelTokenizer for the diagnostic: one id per character."""

    vocab_length = VOCAB_LIMIT

    def encode(self, text):
        return [ord(c) % 900 + 10 for c in text]

    def special_tokens(self):
        return SPECIAL


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """BagelConfig.tiny() with the toy checkpoint's random weights (loading them is much faster
    than Bagel's op-by-op initialisation on CPU); its tokenizer is not used."""
    model_dir = toy_model.write_toy_model(
        tmp_path_factory.mktemp("kl_model"),
        dtype="fp32",
        corpus=["a b c"],
        tokenizer_vocab_size=300,
    )
    model, config, _ = load_hf(
        model_dir, tokenizer=False, config_changes={"llm": {"compute_dtype": "float32"}}
    )
    assert config.llm.vocab_size > VOCAB_LIMIT
    return model


def samples(num=3, seed=0):
    rng = np.random.default_rng(seed)

    def vit(h, w):
        return VitImageInputs(
            rng.uniform(-1, 1, (h * w, 588)).astype(np.float32), vit_position_ids(h, w), h, w
        )

    return [
        Sample(
            pid=f"p{i}",
            dataset="even" if i % 2 == 0 else "odd",
            question=f"what is {i}?",
            answer=str(i),
            problem_image=vit(2, 2),
            vt_images=[vit(2, 1)],
            thoughts=["first", "then"],
            full_text_only_thought=f"it is {i}" if i else None,
        )
        for i in range(num)
    ]


def test_kl_from_logits_matches_numpy():
    rng = np.random.default_rng(1)
    teacher, student = rng.normal(0, 2, (2, 3, 11)), rng.normal(0, 2, (2, 3, 11))

    def log_softmax(x):
        return (
            x
            - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - x.max(-1, keepdims=True)
        )

    for limit in (None, 7):
        t, s = teacher[..., :limit], student[..., :limit]
        expected = (np.exp(log_softmax(t)) * (log_softmax(t) - log_softmax(s))).sum(-1)
        got = kl_diagnostic.kl_from_logits(
            jnp.asarray(teacher, jnp.float32), jnp.asarray(student, jnp.float32), limit
        )
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)
    same = kl_diagnostic.kl_from_logits(jnp.asarray(teacher), jnp.asarray(teacher))
    assert float(jnp.abs(same).max()) == 0.0


def test_reference_completion_format():
    with_text, without_text = samples(2)[1], samples(2)[0]
    assert reference_completion(with_text) == ("<think>it is 1</think><answer>1</answer>")
    # No text-only thought: the sample's thoughts stand in for it.
    assert reference_completion(without_text) == ("<think>first then</think><answer>0</answer>")


def test_identical_contexts_give_zero_and_vt_gives_positive(model):
    tokenizer = CharTokenizer()
    data = samples(3)
    # Without VT images, intro and transition the teacher's context is the student's.
    bare = builders.prompt_options(use_reference_intro=False, use_transition_prompt=False)
    no_vt = [dataclasses.replace(s, vt_images=[]) for s in data]
    same = kl_diagnostic.kl_diagnostic(
        model, no_vt, tokenizer, options=bare, batch_size=3, max_forward_tokens=MAX_FORWARD
    )
    expected_tokens = [len(tokenizer.encode(reference_completion(s))) + 1 for s in data]
    assert [r["num_tokens"] for r in same.records] == expected_tokens
    assert [r["pid"] for r in same.records] == ["p0", "p1", "p2"]
    all_tokens = np.concatenate(list(same.token_kl.values()))
    assert all_tokens.size == sum(expected_tokens)
    assert np.abs(all_tokens).max() <= 1e-6

    # chunk_size=4: the shapes of test_chunked_entry_kl_equals_full_logits (one compile for both).
    with_vt = kl_diagnostic.kl_diagnostic(
        model,
        data,
        tokenizer,
        options=bare,
        batch_size=3,
        chunk_size=4,
        max_forward_tokens=MAX_FORWARD,
    )
    noise = kl_diagnostic.kl_diagnostic(
        model,
        data,
        tokenizer,
        batch_size=3,
        chunk_size=4,
        max_forward_tokens=MAX_FORWARD,
        options=dataclasses.replace(bare, noise_vt=True),
    )
    for result in (with_vt, noise):
        assert result.summary["overall"]["num_tokens"] == sum(expected_tokens)
        assert result.summary["overall"]["mean"] > 1e-5
        assert set(result.summary["datasets"]) == {"even", "odd"}
        assert result.summary["datasets"]["even"]["num_samples"] == 2
    assert with_vt.summary["overall"]["mean"] != noise.summary["overall"]["mean"]
    table = kl_diagnostic.markdown_table({"VT": with_vt, "noise VT": noise})
    assert "| even | 2 |" in table and "**overall**" in table
    # The answer span: `<answer>a</answer>` (one id per character here) and the closing EOS.
    for record, sample in zip(with_vt.records, data):
        assert record["answer_tokens"] == len(f"<answer>{sample.answer}</answer>") + 1
        assert record["answer_mean_kl"] > 0
    assert all(abs(r["answer_mean_kl"]) <= 1e-6 for r in same.records)
    assert with_vt.summary["overall"]["answer_span_mean"] == pytest.approx(
        np.mean([r["answer_mean_kl"] for r in with_vt.records])
    )


def test_the_verdict_is_the_pytorch_projects_gate():
    def summary(answer):
        return {"overall": {"answer_span_mean": answer}}

    assert kl_diagnostic.verdict(summary(0.0501))[0] == "GO"
    for below in (0.05, 0.01):  # strictly above 0.05 nats to go, as there
        decision, why = kl_diagnostic.verdict(summary(below))
        assert decision == "NO-GO" and "does not change" in why and "0.05" in why
    decision, why = kl_diagnostic.verdict(summary(0.2), summary(0.3))
    assert decision == "GO" and "noise-VT control 0.3000" in why and "any extra image" in why


def test_chunked_entry_kl_equals_full_logits(model):
    tokenizer = CharTokenizer()
    data = samples(3)
    completions = [tokenizer.encode(reference_completion(s)) for s in data]
    bare = builders.prompt_options(use_reference_intro=False, use_transition_prompt=False)
    packs = build_training_packs(
        data, completions, tokenizer.encode, bare, SPECIAL, num_rows=3, max_forward_tokens=10240
    )
    chunked = kl_diagnostic.entry_kl(model, packs.student, packs.teacher, VOCAB_LIMIT, chunk_size=4)

    @functools.partial(jax.jit, static_argnums=0)
    def logits(graphdef, params, pack):
        merged = nnx.merge(graphdef, params)
        return merged.logits_at(merged(pack), pack.loss_rows)

    teacher = np.asarray(logits(*nnx.split(model), packs.teacher), np.float64)[..., :VOCAB_LIMIT]
    student = np.asarray(logits(*nnx.split(model), packs.student), np.float64)[..., :VOCAB_LIMIT]

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    reference = np.exp(log_softmax(teacher)) * (log_softmax(teacher) - log_softmax(student))
    reference = np.where(packs.student.loss_mask, reference.sum(-1), 0.0)
    np.testing.assert_allclose(chunked, reference, atol=2e-5, rtol=1e-4)
    assert (chunked[packs.student.loss_mask] > 0).all()


@pytest.mark.parametrize("max_forward_tokens", ["0", "-5"])
def test_a_max_forward_tokens_below_one_stops_the_script_before_any_load(
    tmp_path, monkeypatch, max_forward_tokens
):
    """0 used to mean the config's length silently, a negative value dropped every sample."""
    from scripts import kl_diagnostic as kl_cli

    builders.refuse_loads(monkeypatch, "--max_forward_tokens", (kl_cli, "setup"))
    argv = ["--model_dir", str(tmp_path), "--out", str(tmp_path / "kl")]
    with pytest.raises(
        SystemExit, match=f"--max_forward_tokens must be >= 1, got {max_forward_tokens}"
    ):
        kl_cli.main([*argv, "--max_forward_tokens", max_forward_tokens])


def script_ends_without_a_verdict(tmp_path, monkeypatch, capsys, options, max_forward, message):
    """scripts/kl_diagnostic.py on three samples without a model (nothing runs) exits with
    `message`, and prints no verdict and writes no file."""
    from scripts import kl_diagnostic as kl_cli

    loaded = (None, CharTokenizer(), samples(3), options, {}, None)
    monkeypatch.setattr(kl_cli, "setup", lambda args: loaded)
    argv = ["--model_dir", str(tmp_path), "--out", str(tmp_path / "kl")]
    with pytest.raises(SystemExit, match=message):
        kl_cli.main([*argv, "--max_forward_tokens", str(max_forward)])
    assert "verdict" not in capsys.readouterr().out
    assert not (tmp_path / "kl").exists()


def test_every_sample_dropped_ends_without_a_verdict_or_files(tmp_path, monkeypatch, capsys):
    """Contexts all longer than --max_forward_tokens: no K_gen was measured, so the script exits
    non-zero naming the flag, instead of a NO-GO on NaN KL and a kl_summary.json holding NaN."""
    options = builders.prompt_options(use_reference_intro=False, use_transition_prompt=False)
    script_ends_without_a_verdict(
        tmp_path,
        monkeypatch,
        capsys,
        options,
        8,
        r"^error: no sample measured: all 3 samples' teacher contexts are longer than "
        r"max_forward_tokens=8; raise --max_forward_tokens$",
    )


def test_statistics_of_no_values_are_written_as_null():
    """A summary of no measured sample holds NaN, which json.dump writes as a bare `NaN` (not
    JSON); json_ready turns every non-finite float into null."""
    options = builders.prompt_options(use_reference_intro=False, use_transition_prompt=False)
    result = kl_diagnostic.kl_diagnostic(
        None, samples(2), CharTokenizer(), options=options, batch_size=2, max_forward_tokens=8
    )
    assert result.summary["num_dropped"] == 2 and np.isnan(result.summary["overall"]["mean"])
    ready = kl_diagnostic.json_ready(dict(result.summary, records=[{"kl": float("inf")}]))
    assert ready["overall"]["mean"] is None and ready["records"] == [{"kl": None}]
    assert ready["overall"]["num_samples"] == 0 and ready["num_dropped"] == 2
    json.dumps(ready, allow_nan=False)  # raises on NaN


def test_a_reference_cut_to_fit_leaves_its_answer_span_out_of_the_gate(model):
    """A reference cut to fit max_forward_tokens ends in thought, not in its answer: its
    last entries are no answer span, so it is counted as truncated and left out of the gate
    (before, the gate averaged the cut thought's last entries as if they were the answer)."""
    tokenizer = CharTokenizer()
    data = samples(3)  # sample 0's reference is 3 characters longer than the others'
    options = builders.prompt_options(use_reference_intro=False, use_transition_prompt=False)
    lengths = [
        int((packs.teacher.segment_ids > 0).sum())
        for packs in (
            build_training_packs(
                [s],
                [tokenizer.encode(reference_completion(s))],
                tokenizer.encode,
                options,
                SPECIAL,
                num_rows=1,
                max_forward_tokens=MAX_FORWARD,
            )
            for s in data
        )
    ]
    assert lengths[0] == lengths[1] + 3 == lengths[2] + 3
    result = kl_diagnostic.kl_diagnostic(
        model, data, tokenizer, options=options, batch_size=3, max_forward_tokens=lengths[0] - 2
    )
    assert [r["truncated"] for r in result.records] == [True, False, False]
    assert result.records[0]["answer_tokens"] == 0
    assert np.isnan(result.records[0]["answer_mean_kl"])
    assert [r["answer_tokens"] for r in result.records[1:]] == [
        len(f"<answer>{s.answer}</answer>") + 1 for s in data[1:]
    ]
    assert result.summary["num_truncated"] == 1 and result.summary["num_dropped"] == 0
    assert result.summary["overall"]["answer_span_mean"] == pytest.approx(
        np.mean([r["answer_mean_kl"] for r in result.records[1:]])
    )


def test_every_reference_cut_ends_without_a_verdict_or_files(tmp_path, monkeypatch, capsys):
    """No answer span measured (every reference cut to fit): no verdict on NaN."""
    stats = {"num_samples": 3, "answer_span_mean": float("nan")}
    all_cut = kl_diagnostic.KLResult(
        [], {}, {"overall": stats, "datasets": {}, "num_dropped": 0, "num_truncated": 3}
    )
    monkeypatch.setattr(kl_diagnostic, "kl_diagnostic", lambda *a, **k: all_cut)
    script_ends_without_a_verdict(
        tmp_path,
        monkeypatch,
        capsys,
        builders.prompt_options(),
        64,
        r"^error: no answer span measured: all 3 measured references were cut to fit "
        r"max_forward_tokens=64; raise --max_forward_tokens$",
    )
