"""What a resume with another config means: every changed key named, contradictions refused.

A resumed run takes its params, optimizer state, teacher and data position from the
checkpoint and everything else from the config given now. `check(saved, now)` lists every key
whose value differs (saved -> now) with what the change does to the resumed run, and sorts the
changes in three kinds:

  plain       the new value applies from the next step (a loss weight, the learning rate's
              schedule, logging); printed, nothing else;
  contradict  the saved state was made under the old value (the model it holds, the mode, the
              teacher it keeps): refused unless `allow_config_change=True`, which accepts the
              meaning printed next to it (e.g. an 'ema' run resumed as 'fixed' takes the saved
              EMA weights as its fixed teacher: the checkpoint holds no initial weights);
  impossible  the saved state cannot be read under the new value (frozen groups keep no
              optimizer state): refused always, with the way to do it instead.

Keys about where and how the process runs (directories, resume switches, hosts, the progress
bar, the W&B id) are not compared.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# Not part of what the run trains: never compared.
NOT_COMPARED = frozenset(
    {
        "results_dir",
        "checkpoint_dir",
        "auto_resume",
        "resume_from",
        "resume_model_only",
        "finetune_from_ema",
        "allow_config_change",
        "progress_bar",
        "distributed",
        "coordinator_address",
        "num_processes",
        "process_id",
        "wandb_runid",
    }
)

# Freezing decides which params have optimizer moments: the saved state has another layout.
IMPOSSIBLE = {
    name: (
        f"frozen groups keep no optimizer state, so a state saved with another {name} cannot "
        "be restored; start a new run from these weights instead (--config.resume_from=<this "
        "checkpoint> --config.resume_model_only=True)"
    )
    for name in ("freeze_llm", "freeze_vit", "freeze_und")
}
# The saved state's params are LoRA adapters of that rank and on those projections (or the
# whole model): another rank, target set or full fine-tuning has another layout.
IMPOSSIBLE.update(
    {
        name: (
            f"the checkpoint holds the params of its own {name} (adapters of that shape, or "
            "the whole model without LoRA), which cannot be restored under another; start a "
            "new run instead (a LoRA run's merged model: scripts/convert_hf.py jax-to-hf, then "
            "that directory as model_path)"
        )
        for name in ("lora_rank", "lora_targets")
    }
)


def _teacher_meaning(saved: str, now: str) -> str:
    if now == "self":
        return f"the saved {saved} teacher is not used: the teacher is the student itself"
    if now == "checkpoint":
        return f"the saved {saved} teacher is not used: the teacher is teacher_path's model"
    if saved in ("self", "checkpoint"):
        return (
            f"the checkpoint keeps no teacher: the {now} teacher starts from the restored "
            "student weights"
        )
    if now == "fixed":
        return (
            "the fixed teacher is the checkpoint's EMA weights (the checkpoint holds no "
            "initial weights); it no longer moves"
        )
    return "the EMA teacher starts from the saved fixed teacher's weights and follows the student"


CONTRADICTS = {
    "model_path": lambda saved, now: (
        "the weights come from the checkpoint, trained from the saved model; the new path gives "
        "only the model config and the tokenizer, which must be the saved ones' to mean "
        "anything"
    ),
    "weights": lambda saved, now: "no effect: a resume reads no starting weights",
    "mode": lambda saved, now: (
        f"the saved weights and optimizer moments continue under the '{now}' objective"
    ),
    "teacher_mode": _teacher_meaning,
    "teacher_by_source": lambda saved, now: (
        "each data source is scored by the new mapping's teacher from the next step; a student "
        "copy the checkpoint does not keep starts from the restored student weights, and only "
        "the saved run's checkpoint teachers are taken (their digests are compared)"
    ),
    "fixed_teacher_dtype": lambda saved, now: f"the saved fixed teacher is cast to {now}",
    "lora_alpha": lambda saved, now: (
        f"the saved adapters' update is scaled by {now} / rank instead of {saved} / rank: the "
        "model the run resumes is not the one it saved"
    ),
}

PLAIN = {
    "total_steps": lambda saved, now: f"the run now ends at step {now}",
    "lr": lambda saved, now: "the schedule's peak changes; the optimizer moments carry on",
    "min_lr": lambda saved, now: "the schedule's floor changes",
    "warmup_steps": lambda saved, now: "the schedule is re-evaluated at the resumed step",
    "lr_scheduler": lambda saved, now: "the schedule is re-evaluated at the resumed step",
    "ema_decay": lambda saved, now: "the EMA continues from its saved weights at the new decay",
    "teacher_path": lambda saved, now: (
        "the checkpoint teacher is read from the new path; only the saved run's own teacher "
        "is taken (the weights' digest is compared)"
    ),
    "global_seed": lambda saved, now: (
        "the data position and sampling key come from the checkpoint; only new randomness "
        "(evaluation, data not yet read after a data change) follows the new seed"
    ),
}


@dataclasses.dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    now: Any
    kind: str  # plain | contradict | impossible
    meaning: str

    def line(self) -> str:
        text = f"{self.key}: {self.saved!r} -> {self.now!r}"
        return f"{text} ({self.meaning})" if self.meaning else text


def _flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def changes(saved: Mapping, now: Mapping) -> list[Change]:
    """Every compared key whose value differs between the saved config and this one."""
    old, new = _flat(saved), _flat(now)
    found = []
    for key in sorted(set(old) | set(new)):
        if key in NOT_COMPARED or old.get(key) == new.get(key):
            continue
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if key in IMPOSSIBLE:
            found.append(Change(key, a, b, "impossible", IMPOSSIBLE[key]))
        elif key in CONTRADICTS:
            found.append(Change(key, a, b, "contradict", CONTRADICTS[key](a, b)))
        else:
            meaning = PLAIN[key](a, b) if key in PLAIN else ""
            found.append(Change(key, a, b, "plain", meaning))
    return found


class ResumeConfigError(ValueError):
    pass


def check(saved: Mapping | None, now: Mapping, source: str) -> list[str]:
    """The lines to print for a resume from `source` (its config `saved`) with config `now`;
    raises ResumeConfigError (every refused change named) for a change that contradicts the
    saved state without `allow_config_change`, or one that cannot be honoured at all."""
    if not saved:
        return []
    found = changes(saved, now)
    allow = bool(now.get("allow_config_change", False))
    impossible = [c for c in found if c.kind == "impossible"]
    refused = impossible + ([] if allow else [c for c in found if c.kind == "contradict"])
    if refused:
        lines = "\n  ".join(c.line() for c in refused)
        hint = (
            ""
            if impossible
            else "\n  (--config.allow_config_change=True accepts these, with the meaning given)"
        )
        raise ResumeConfigError(
            f"resuming from {source} with a config that contradicts the saved state:\n"
            f"  {lines}{hint}"
        )
    if not found:
        return [f"resuming from {source}: the config is the saved one"]
    return [f"resuming from {source} with {len(found)} changed config key(s), saved -> now:"] + [
        f"  {c.line()}" for c in found
    ]
