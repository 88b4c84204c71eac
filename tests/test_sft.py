"""The SFT baseline: CE packs on the reference completion, the CE-only step, config, train.py."""

import types

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_opsd_packs import IME, IMS, SPECIAL, VS, encode, vit

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax import run_config
from opsd_jax.data.pipeline import reference_completion
from opsd_jax.data.sft_packs import build_sft_packs, choose_vt
from opsd_jax.training import train_step

OPTIONS = builders.prompt_options(system_prompt="ab", reference_intro="c", transition_prompt="d")


def sample(pid, question="q", answer="A", thought="t", problem=(1, 2)):
    return types.SimpleNamespace(
        pid=pid,
        question=question,
        answer=answer,
        problem_image=vit(*problem, 0.5),
        vt_images=[vit(1, 1, -0.5)],
        thoughts=["x0", "x1"],
        full_text_only_thought=thought,
    )


SAMPLES = [sample("a"), sample("b", "qq", "B", "two"), sample("c", "qqq", "C", None)]
# Written out by hand, not through reference_completion: the ThinkMorph output format with the text-only
# thought (docs/opsd_loss.md §c.2); without one, the text thoughts joined.
EXPECTED = [
    "<think>t</think><answer>A</answer>",
    "<think>two</think><answer>B</answer>",
    "<think>x0 x1</think><answer>C</answer>",
]


def test_reference_completion_is_the_thinkmorph_text_only_format():
    assert [reference_completion(s) for s in SAMPLES] == EXPECTED
    bare = types.SimpleNamespace(answer="7", thoughts=[], full_text_only_thought="")
    assert reference_completion(bare) == "<answer>7</answer>"


@pytest.mark.parametrize("use_vt", [[False, False, False], [True, False, True]])
def test_loss_entries_are_exactly_the_target_tokens(use_vt):
    packs = build_sft_packs(
        SAMPLES, encode, OPTIONS, SPECIAL, num_rows=2, max_forward_tokens=128, use_vt=use_vt
    )
    pack = packs.pack
    assert packs.kept == [0, 1, 2] and packs.num_dropped == 0 and packs.with_vt == use_vt
    for index, text in enumerate(EXPECTED):
        entries = pack.loss_mask & (pack.loss_sample == index)
        row = int(np.nonzero(entries.any(axis=1))[0][0])
        assert entries.sum() == entries[row].sum()  # one sample, one row
        target = encode(text)
        # Targets: the target tokens, then <|im_end|>; rows: its <|im_start|> and its tokens.
        assert pack.loss_targets[row][entries[row]].tolist() == target + [IME]
        rows = pack.loss_rows[row][entries[row]]
        assert pack.tokens[row, rows].tolist() == [IMS] + target
        assert pack.tokens[row, rows[-1] + 1] == IME
        # Nothing else in the row is scored: the entries of other samples sit elsewhere.
        segment = pack.segment_ids[row, rows[0]]
        assert (pack.segment_ids[row, rows] == segment).all()
        # The context: a VT image block (two image blocks in the sample) iff use_vt.
        blocks = int(((pack.tokens[row] == VS) & (pack.segment_ids[row] == segment)).sum())
        assert blocks == (2 if use_vt[index] else 1)
    assert int(pack.loss_mask.sum()) == sum(len(encode(t)) + 1 for t in EXPECTED)


def test_over_long_samples_are_dropped_and_vt_choice_is_seeded():
    long = sample("long", thought="x" * 60)
    packs = build_sft_packs(
        [long, SAMPLES[0]], encode, OPTIONS, SPECIAL, num_rows=1, max_forward_tokens=64
    )
    assert packs.kept == [1] and packs.num_dropped == 1
    with pytest.raises(ValueError, match="no sample fits max_forward_tokens=8"):
        build_sft_packs([long], encode, OPTIONS, SPECIAL, num_rows=1, max_forward_tokens=8)
    assert choose_vt(64, 0.5, seed=3, step=7) == choose_vt(64, 0.5, seed=3, step=7)
    assert choose_vt(64, 0.5, seed=3, step=7) != choose_vt(64, 0.5, seed=3, step=8)
    assert 16 < sum(choose_vt(64, 0.5, seed=3, step=7)) < 48
    assert choose_vt(4, 0.0, 0, 0) == [False] * 4 and choose_vt(4, 1.0, 0, 0) == [True] * 4


def test_sft_step_reduces_ce_on_a_fixed_batch():
    model = Bagel(
        BagelConfig.tiny(llm=dict(compute_dtype="float32", remat="none")), rngs=nnx.Rngs(0)
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    config = run_config.complete(
        dict(
            lr=3e-3, min_lr=1e-5, warmup_steps=0, total_steps=50, lr_scheduler="constant", eps=1e-8
        )
    )
    optimizer = train_step.make_optimizer(config)
    state = train_step.init_state(params, optimizer, "self", jax.random.key(0))
    assert state.teacher_params is None  # SFT keeps no teacher copy
    loss_fn = train_step.make_sft_loss(graphdef, rest, builders.loss_settings(num_samples=3))
    step = train_step.make_train_step(
        loss_fn,
        optimizer,
        teacher_mode="self",
        ema_decay=0.0,
        schedule=train_step.learning_rate_schedule(config),
    )
    pack = build_sft_packs(
        SAMPLES,
        encode,
        OPTIONS,
        SPECIAL,
        num_rows=1,
        max_forward_tokens=128,
        use_vt=[True, False, False],
    ).pack
    micro_batches = (jax.tree.map(lambda x: x[None], pack),)  # one micro-batch
    ces = []
    for _ in range(6):
        state, metrics = step(state, micro_batches)
        ces.append(float(metrics["ce"]))
        assert float(metrics["loss"]) == ces[-1]
        assert int(metrics["loss_tokens"]) == sum(len(encode(t)) + 1 for t in EXPECTED)
    assert all(b < a for a, b in zip(ces, ces[1:])) and ces[-1] < 0.8 * ces[0], ces
    assert 0.0 <= float(metrics["token_accuracy"]) <= 1.0
    assert jnp.isfinite(ces[-1])


def test_sft_config_values_are_checked(tmp_path):
    from configs import sft_7b, sft_tiny, thinkmorph_7b, toy_opsd, toy_sft

    config = sft_tiny.get_config()
    with config.unlocked():
        config.model_path, config.toy_data = str(tmp_path), False
        config.data.datasets = [dict(name="d", path=str(tmp_path))]
    run_config.validate(config, num_devices=1)
    for key, value, message in [
        ("mode", "rl", "mode='rl': allowed values are 'opsd', 'sft'"),
        ("teacher_mode", "ema", "teacher_mode='ema' with mode='sft'"),
        ("sft_vt_fraction", 1.5, "sft_vt_fraction=1.5: must be a number in [0, 1]"),
    ]:
        bad = config.copy_and_resolve_references()
        with bad.unlocked():
            bad[key] = value
        with pytest.raises(ValueError, match=None) as error:
            run_config.validate(bad, num_devices=1)
        assert message in str(error.value)
    # The 7B SFT baseline is the paper recipe with mode 'sft': same data, optimiser, batch, steps.
    paper, sft = thinkmorph_7b.get_config().to_dict(), sft_7b.get_config().to_dict()
    changed = {k for k in paper if paper[k] != sft[k]}
    assert changed == {"mode", "teacher_mode", "results_dir"} and sft["mode"] == "sft"
    assert toy_sft.get_config().mode == "sft" and toy_opsd.get_config().mode == "opsd"


# train.py in SFT mode runs end to end in tests/test_toy_experiment.py (stage 1, its
# checkpoints and metrics); one train.py start-up per mode is what the CI time allows.
