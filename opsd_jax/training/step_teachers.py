"""The teachers one OPSD train step runs, and which loss entries each one scores.

A run has one teacher (teacher_mode) or, with `teacher_by_source`, one per data source: the
student itself ('self'), its EMA or its starting weights ('ema' / 'fixed', the train state's
one `teacher_params` copy) and any number of other checkpoints ('checkpoint', each its own
graph, `TeacherModel`, over its weights in the train state's `teacher_weights` tuple).

With several, the OPSD batch carries a fourth part: each loss entry's data source (an index
into the run's datasets, -1 where the entry is empty; opsd_packs.entry_sources). The loss runs
each teacher over the whole teacher pack, skipping (`lax.cond`) a teacher whose sources have no
entry in the micro-batch, and takes every entry's logits from its own source's teacher
(`route`). The per-source loss (`source_metrics`) goes to the step log as source/<name>/jsd,
the distillation per completion token of that source's samples in the step (offline mode,
whose cache was collected per source, logs source/<name>/kd the same way).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

STUDENT_KINDS = ("self", "ema", "fixed")  # teachers made of the student's own weights
KINDS = STUDENT_KINDS + ("checkpoint",)


@dataclasses.dataclass(frozen=True)
class TeacherModel:
    """A teacher of another checkpoint: its own nnx graph and non-Param state (its weights are
    in the train state's `teacher_weights`). Its packs are the student's: same tokenizer,
    vocabulary and image patching (checked where it is loaded)."""

    graphdef: Any
    rest: Any

    @property
    def graph(self) -> tuple:
        return self.graphdef, self.rest


@dataclasses.dataclass(frozen=True)
class StepTeachers:
    """`kinds[t]`: teacher t's kind (KINDS); `models`: the 'checkpoint' teachers' graphs, in
    the order of their kinds (checkpoint teacher i's weights are `teacher_weights[i]`);
    `of_source[s]`: the teacher of data source s, whose name is `source_names[s]` (both empty
    when one teacher scores every entry)."""

    kinds: tuple[str, ...]
    models: tuple[TeacherModel, ...] = ()
    of_source: tuple[int, ...] = ()
    source_names: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.kinds or any(k not in KINDS for k in self.kinds):
            raise ValueError(f"teacher kinds {self.kinds}: each one of {KINDS}")
        if self.kinds.count("checkpoint") != len(self.models):
            raise ValueError("one TeacherModel per 'checkpoint' teacher, and only for them")
        if len({k for k in self.kinds if k in ("ema", "fixed")}) > 1:
            raise ValueError("one student copy at most ('ema' or 'fixed')")
        if len(self.of_source) != len(self.source_names):
            raise ValueError("of_source and source_names go together, one per data source")
        if any(not 0 <= t < len(self.kinds) for t in self.of_source):
            raise ValueError(f"of_source {self.of_source} names no teacher of {self.kinds}")

    @property
    def copy_mode(self) -> str:
        """What the train state's `teacher_params` hold: 'ema', 'fixed' or nothing ('self')."""
        return next((k for k in self.kinds if k in ("ema", "fixed")), "self")

    @property
    def by_source(self) -> bool:
        """Each data source's entries are scored by its own teacher (the batch's fourth part)."""
        return bool(self.of_source)

    def graphs(self, student_graph: tuple) -> list[tuple]:
        """Per teacher, the (graphdef, rest) its weights are merged with."""
        models = iter(self.models)
        return [next(models).graph if k == "checkpoint" else student_graph for k in self.kinds]

    def states(self, copy, weights) -> tuple:
        """Per teacher, the nnx.Param state handed to the loss: None for 'self' (the loss
        takes the student's params), `copy` (the EMA / fixed teacher as a whole model) for
        'ema' / 'fixed', `weights[i]` for the i-th checkpoint teacher."""
        weights = iter(() if weights is None else weights)
        return tuple(
            None if k == "self" else next(weights) if k == "checkpoint" else copy
            for k in self.kinds
        )


def route(
    teachers: StepTeachers,
    logits_of: Callable[[int], jax.Array],
    entry_sources: jax.Array,
    mask: jax.Array,
) -> jax.Array:
    """[R, E, V] logits, each entry's from its data source's teacher: `logits_of(t)` is teacher
    t's over the whole pack; it runs only when one of its sources has a live entry in `mask`
    (a `lax.cond`: zeros otherwise, which no entry then takes)."""
    entry_teacher = jnp.asarray(teachers.of_source, jnp.int32)[jnp.maximum(entry_sources, 0)]
    routed = None
    for t in range(len(teachers.kinds)):
        mine = entry_teacher == t
        shape = jax.eval_shape(lambda t=t: logits_of(t))
        logits = jax.lax.cond(
            jnp.any(mine & mask),
            lambda t=t: logits_of(t),
            lambda shape=shape: jnp.zeros(shape.shape, shape.dtype),
        )
        routed = logits if routed is None else jnp.where(mine[..., None], logits, routed)
    return routed


SOURCE_PREFIX = "source/"


def source_metrics(
    source_names: tuple[str, ...],
    per_token: jax.Array,
    entry_sources: jax.Array,
    mask: jax.Array,
    metric: str = "jsd",
) -> dict:
    """Per data source, the micro-batch's summed loss term (`metric`: 'jsd' online, 'kd'
    offline) over its live entries and their count (source/<name>/<metric>_sum,
    source/<name>/tokens); `finish_source_metrics` makes the step's per-token mean of them."""
    metrics = {}
    for s, name in enumerate(source_names):
        mine = (entry_sources == s) & mask
        metrics[f"{SOURCE_PREFIX}{name}/{metric}_sum"] = jnp.sum(jnp.where(mine, per_token, 0.0))
        metrics[f"{SOURCE_PREFIX}{name}/tokens"] = jnp.sum(mine).astype(jnp.float32)
    return metrics


def finish_source_metrics(metrics: dict) -> dict:
    """The step's metrics (each source's sum and tokens added up over the micro-batches) with
    each source's `<metric>_sum` replaced by its per-token mean `<metric>` (NaN for a source
    without a token in the step; the logger weighs the steps of a window by their tokens)."""
    out = {}
    for key, value in metrics.items():
        if key.startswith(SOURCE_PREFIX) and key.endswith("_sum"):
            tokens = metrics[key.rsplit("/", 1)[0] + "/tokens"]
            value = jnp.where(tokens > 0, value / jnp.maximum(tokens, 1e-30), jnp.nan)
            key = key[: -len("_sum")]
        out[key] = value
    return out
