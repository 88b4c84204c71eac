"""A resume with another config (opsd_jax/training/resume_changes.py): every changed key is said
with its meaning; changes that contradict the saved state are refused unless allowed."""

import pytest

from configs import smoke
from opsd_jax.training import resume_changes


def configs(**now):
    saved = smoke.get_config().to_dict()
    current = smoke.get_config()
    with current.unlocked():
        for key, value in now.items():
            current[key] = value
    return saved, current.to_dict()


def test_the_same_config_says_so():
    assert resume_changes.check(*configs(), "ck") == [
        "resuming from ck: the config is the saved one"
    ]


def test_plain_changes_are_listed_with_their_meaning():
    lines = resume_changes.check(
        *configs(total_steps=40, jsd_beta=0.9, results_dir="elsewhere"), "ck"
    )
    assert lines[0] == "resuming from ck with 2 changed config key(s), saved -> now:"
    assert "  jsd_beta: 0.5 -> 0.9" in lines
    assert "  total_steps: 12 -> 40 (the run now ends at step 40)" in lines
    assert not any("results_dir" in line for line in lines)  # where the run writes: not compared


def test_a_teacher_change_is_refused_unless_allowed_and_then_explained():
    saved, now = configs(teacher_mode="fixed")
    with pytest.raises(
        resume_changes.ResumeConfigError,
        match="(?s)teacher_mode: 'ema' -> 'fixed'.*allow_config_change=True",
    ):
        resume_changes.check(saved, now, "ck")
    saved, now = configs(teacher_mode="fixed", allow_config_change=True)
    lines = resume_changes.check(saved, now, "ck")
    assert any(
        "teacher_mode: 'ema' -> 'fixed' (the fixed teacher is the checkpoint's EMA" in line
        for line in lines
    )


@pytest.mark.parametrize(
    "key,value,pattern",
    [
        ("model_path", "/elsewhere", "model_path: ''"),
        ("mode", "sft", "mode: 'opsd' -> 'sft'"),
    ],
)
def test_state_changes_are_refused(key, value, pattern):
    with pytest.raises(resume_changes.ResumeConfigError, match=pattern):
        resume_changes.check(*configs(**{key: value}), "ck")


def test_freezing_cannot_change_even_when_allowed():
    saved, now = configs(freeze_vit=True, allow_config_change=True)
    with pytest.raises(resume_changes.ResumeConfigError, match="(?s)freeze_vit.*resume_model_only"):
        resume_changes.check(saved, now, "ck")
