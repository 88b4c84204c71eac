"""A teacher from another checkpoint (teacher_mode='checkpoint'): loaded, checked, named.

The teacher is a BAGEL-layout HF directory of its own (ThinkMorph-7B teaching a student that
starts from BAGEL-7B, say). It scores the student's packs, so it must read them as the student
does: the same tokenizer (every id the same token; `tokenizer_difference` names the first one
that is not), the same vocabulary width (the JSD compares the two distributions row for row) and
the same image patching (the packs' patches and position ids are the student's). Its depth,
width and weights are its own.

It is held frozen in the compute dtype (no fp32 master copy: nothing trains it) and sharded by
the same logical rules as the student's weights. The checkpoints do not hold it: they record its
`identity` (path, weights file and digest, io/weights_digest.py), and a resume reads it again
and refuses another.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from opsd_jax.io import hf_load, weights_digest

# The weights file a teacher directory is read from: its model.safetensors when it has one
# (the trained weights, as the fixed teacher's), else the one file it has.
TEACHER_WEIGHTS = "auto"


class TeacherMismatch(ValueError):
    """The teacher cannot score the student's packs; the message names the first difference."""


@dataclasses.dataclass
class TeacherCheckpoint:
    graphdef: Any  # the teacher's own nnx graph (no adapters)
    params: Any  # its nnx.Param state, in the compute dtype, sharded on the mesh
    rest: Any  # its non-Param state
    model_config: Any  # models.configs.BagelConfig
    identity: dict  # weights_digest.identity: recorded in every checkpoint

    def describe(self) -> str:
        llm = self.model_config.llm
        count = sum(x.size for x in jax.tree.leaves(self.params))
        return (
            f"teacher {weights_digest.describe(self.identity)}: {count:,} parameters "
            f"({llm.num_hidden_layers} layers, hidden {llm.hidden_size}), frozen in "
            f"{self.model_config.llm.compute_dtype}"
        )


def weights_stem(teacher_path: str | os.PathLike) -> str:
    return hf_load.initial_weights(teacher_path, TEACHER_WEIGHTS).fixed_teacher


def identity(teacher_path: str | os.PathLike) -> dict:
    """The teacher's identity as the checkpoints record it (path, weights file, digest)."""
    return weights_digest.identity(teacher_path, weights_stem(teacher_path))


def tokenizer_difference(student, teacher) -> str | None:
    """The first way the two BagelTokenizers would read a text differently, or None."""
    if student.vocab_length != teacher.vocab_length:
        return f"{teacher.vocab_length} tokenizer ids against the student's {student.vocab_length}"
    if student.special_tokens() != teacher.special_tokens():
        return f"special ids {teacher.special_tokens()} against {student.special_tokens()}"
    ours, theirs = student.hf.get_vocab(), teacher.hf.get_vocab()
    by_id = {i: token for token, i in theirs.items()}
    for token, i in sorted(ours.items(), key=lambda item: item[1]):
        if theirs.get(token) != i:
            return f"id {i} is {by_id.get(i)!r} for the teacher and {token!r} for the student"
    return None


def shape_difference(student_config, teacher_config) -> str | None:
    """The first model-config field the packs or the loss need alike, where they differ."""
    fields = {
        "the lm_head rows (llm vocab_size)": lambda c: c.llm.vocab_size,
        "the ViT patch size": lambda c: c.vit.patch_size,
        "the ViT patches per side": lambda c: c.vit_max_num_patch_per_side,
        "visual understanding (visual_und)": lambda c: c.visual_und,
    }
    for name, value in fields.items():
        if value(student_config) != value(teacher_config):
            return f"{name}: {value(teacher_config)} against the student's {value(student_config)}"
    return None


def model_config_of(teacher_path: str | os.PathLike, config_changes=None) -> tuple:
    """(the teacher's BagelConfig as it is built: runtime `config_changes`, no gen expert, the
    vocabulary grown as its tokenizer asks; its BagelTokenizer), reading no weights."""
    changes = dict(config_changes or {})
    changes["llm"] = {**dict(changes.get("llm", {})), "build_gen_expert": False}
    teacher_config = hf_load.read_config(teacher_path, **changes)
    tokenizer = hf_load.load_tokenizer(teacher_path)
    grown = hf_load.grown_vocab(teacher_config, tokenizer)
    return teacher_config.replace(llm=dict(vocab_size=grown)), tokenizer


def load(
    teacher_path: str | os.PathLike,
    mesh,
    *,
    student_config,
    student_tokenizer,
    config_changes=None,
) -> TeacherCheckpoint:
    """The teacher of `teacher_path` on `mesh`, in `config_changes`' compute dtype (the
    student's runtime), after its tokenizer and shapes are checked against the student's
    (TeacherMismatch, naming the first difference, before any weight is read)."""
    teacher_config, tokenizer = model_config_of(teacher_path, config_changes)
    difference = tokenizer_difference(student_tokenizer, tokenizer)
    if difference is None:
        difference = shape_difference(student_config, teacher_config)
    if difference is not None:
        raise TeacherMismatch(
            f"teacher_path={os.fspath(teacher_path)!r} cannot score the student's packs: "
            f"{difference}"
        )
    stem = weights_stem(teacher_path)
    dtype = jnp.dtype(teacher_config.llm.compute_dtype)
    graphdef, state = hf_load.load_weights(
        teacher_path, teacher_config, weights=stem, mesh=mesh, dtype=dtype
    )
    graphdef, params, rest = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
    return TeacherCheckpoint(
        graphdef,
        params,
        rest,
        teacher_config,
        weights_digest.identity(teacher_path, stem),
    )
