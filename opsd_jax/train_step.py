"""The OPSD train state and the jitted pieces of one optimizer step.

One optimizer step (train.py drives it):

1. the sampler draws completions for every micro-batch with the current params;
2. per micro-batch, `grad_step` runs the student forward/backward and the teacher forward
   (stop-gradient, fully rematerialised so none of its activations stay alive) on the aligned
   student / teacher Packs, and returns the gradients of
   `ce_weight * CE + jsd_weight * (generalized JSD | tinker)` over the completion entries;
3. gradients are summed over micro-batches and `apply_update` does one AdamW step (grad-norm
   clip, warmup + cosine or constant LR), then the EMA teacher update.

Teacher modes: `self` (stop-gradient of the current params: no extra memory), `ema` (an EMA copy
updated after every optimizer step: phi <- d * phi + (1 - d) * theta), `fixed` (the initial
params, frozen; `fixed_teacher_dtype='bfloat16'` stores them in bf16 to halve their memory).

Parameters and optimizer state are fp32 (the "master" copy); the forward computes in the model
config's compute dtype. Frozen groups (`freeze_vit`, `freeze_llm`, and with `freeze_und`
everything but lm_head, see `trainable_labels`) get no optimizer state and a zero update, so
they stay bit-identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.pack import Pack
from opsd_jax import losses

TEACHER_MODES = ("self", "ema", "fixed")
LOSS_KINDS = ("jsd", "tinker")
LR_SCHEDULERS = ("cosine", "constant")


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Static (compile-time) loss knobs, named as in the PyTorch trainer."""

    jsd_weight: float = 1.0
    ce_weight: float = 0.0
    jsd_loss_kind: str = "jsd"
    jsd_beta: float = 0.5
    jsd_temperature: float = 1.0
    jsd_top_k: int = 256
    jsd_token_clip: float = 0.05
    jsd_clip_mode: str = "entry"
    reduction: str = "seq_mean"
    num_samples: int = 1  # samples per micro-batch (per-sample reduction)
    # Ids >= vocab_limit (padded lm_head rows, past the tokenizer) are masked out of every loss,
    # as the sampler masks them (losses.mask_vocab); None keeps the whole table.
    vocab_limit: int | None = None


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # nnx.State of the trainable-or-not nnx.Params (fp32)
    opt_state: Any
    teacher_params: Any  # nnx.State for 'ema' / 'fixed'; None for 'self'
    rng: jax.Array


def learning_rate_schedule(config) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine to `min_lr` or constant."""
    if config.lr_scheduler not in LR_SCHEDULERS:
        raise ValueError(f"config.lr_scheduler={config.lr_scheduler!r}; allowed: {LR_SCHEDULERS}")
    warmup = optax.linear_schedule(0.0, config.lr, max(config.warmup_steps, 1))
    decay_steps = max(config.total_steps - config.warmup_steps, 1)
    if config.lr_scheduler == "cosine":
        after = optax.cosine_decay_schedule(config.lr, decay_steps, alpha=config.min_lr / config.lr)
    else:
        after = optax.constant_schedule(config.lr)
    if config.warmup_steps <= 0:
        return after
    return optax.join_schedules([warmup, after], [config.warmup_steps])


def trainable_labels(params, *, freeze_vit: bool, freeze_llm: bool, freeze_und: bool = False):
    """'train' / 'frozen' per parameter, by where it lives in the model.

    `freeze_und` is BAGEL's flag (Qwen2MoT forward_train in modeling/bagel/qwen2_navit.py):
    every understanding-token activation is detached, at the LM input, after q/k/v, after
    attention, after the MLP and after the final norm, so only generation tokens carry gradient
    into the LM body. In understanding-only training every token is an understanding token, so
    nothing but `lm_head` (applied after the detached final norm) gets a gradient: the ViT,
    connector, embeddings and LM layers keep their values, exactly as frozen groups here do.
    """

    def name(key) -> str:
        return str(key.key if hasattr(key, "key") else key)

    def label(path, _):
        top = name(path[0])
        if freeze_vit and top == "vit_model":
            return "frozen"
        if freeze_llm and top == "language_model":
            return "frozen"
        if freeze_und and not (top == "language_model" and name(path[1]) == "lm_head"):
            return "frozen"
        return "train"

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(config, params) -> optax.GradientTransformation:
    adamw = optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(
            learning_rate_schedule(config),
            b1=config.beta1,
            b2=config.beta2,
            eps=config.eps,
            weight_decay=0.0,
        ),
    )
    labels = trainable_labels(params, freeze_vit=config.freeze_vit, freeze_llm=config.freeze_llm,
                              freeze_und=config.get("freeze_und", False))  # fmt: skip
    # set_to_zero keeps no state: frozen params cost no optimizer memory and never move.
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)


def completion_loss(student_logits, teacher_logits, pack: Pack, settings: LossSettings):
    """ce_weight * CE + jsd_weight * distillation over the pack's loss entries."""
    common = dict(sample_ids=pack.loss_sample, num_samples=settings.num_samples)
    if settings.jsd_loss_kind == "jsd":
        distill, diag = losses.generalized_jsd(
            student_logits, teacher_logits, pack.loss_mask,
            beta=settings.jsd_beta, temperature=settings.jsd_temperature,
            top_k=settings.jsd_top_k, clip=settings.jsd_token_clip,
            clip_mode=settings.jsd_clip_mode, reduction=settings.reduction,
            token_ids=pack.loss_targets, vocab_limit=settings.vocab_limit, **common,
        )  # fmt: skip
    else:
        distill, diag = losses.tinker_loss(
            student_logits, teacher_logits, pack.loss_targets, pack.loss_mask,
            temperature=settings.jsd_temperature, reduction=settings.reduction,
            vocab_limit=settings.vocab_limit, **common,
        )  # fmt: skip
    metrics = {"jsd": distill}
    for key in ("clip_fraction", "teacher_topk_mass", "k1_reverse_kl"):
        if key in diag:
            metrics[key] = diag[key]
    if settings.jsd_loss_kind == "tinker":
        # Under 'tinker' the distillation value (`jsd`, and `loss`) is -reduce(A), the k1 KL
        # estimate; the PyTorch trainer logs -reduce(A * log p) for the same gradient. Both are
        # logged under names that say which is which, so the two trainers' logs can be compared.
        metrics["tinker_k1"] = distill
        metrics["tinker_surrogate"] = diag["pytorch_surrogate"]
    loss = settings.jsd_weight * distill
    if settings.ce_weight:
        ce, _ = losses.completion_ce(
            student_logits, pack.loss_targets, pack.loss_mask, reduction=settings.reduction,
            vocab_limit=settings.vocab_limit, **common,
        )  # fmt: skip
        loss = loss + settings.ce_weight * ce
        metrics["ce"] = ce
    metrics["loss"] = loss
    metrics["loss_tokens"] = jnp.sum(pack.loss_mask)
    return loss, metrics


def make_grad_step(graphdef, rest, settings: LossSettings, teacher_mode: str):
    """jit(params, teacher_params, student_pack, teacher_pack) -> (grads, metrics)."""
    if teacher_mode not in TEACHER_MODES:
        raise ValueError(f"teacher_mode={teacher_mode!r}; allowed: {TEACHER_MODES}")

    def teacher_logits(teacher_params, pack):
        # Full remat + stop-gradient: the teacher's activations are never kept for a backward.
        @jax.checkpoint
        def forward(teacher_params, pack):
            teacher = nnx.merge(graphdef, teacher_params, rest)
            return teacher.logits_at(teacher(pack), pack.loss_rows)

        return jax.lax.stop_gradient(forward(jax.lax.stop_gradient(teacher_params), pack))

    def loss_fn(params, teacher_params, student_pack, teacher_pack):
        student = nnx.merge(graphdef, params, rest)
        student_logits = student.logits_at(student(student_pack), student_pack.loss_rows)
        source = params if teacher_mode == "self" else teacher_params
        if teacher_mode == "fixed":  # possibly stored in bf16: compute from fp32 copies
            source = jax.tree.map(lambda p, t: t.astype(p.dtype), params, teacher_params)
        return completion_loss(
            student_logits, teacher_logits(source, teacher_pack), student_pack, settings
        )

    @jax.jit
    def grad_step(params, teacher_params, student_pack, teacher_pack):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, teacher_params, student_pack, teacher_pack
        )
        return grads, metrics

    return grad_step


def make_apply_update(optimizer: optax.GradientTransformation, teacher_mode: str, ema_decay: float):
    """jit(state, summed grads, number of micro-batches[, loss]) -> (new state, update metrics).

    A non-finite gradient (or loss, when given) skips the update: params, optimizer state and
    EMA stay exactly as they were, only `step` advances (the batch is consumed), and the
    metric `nonfinite` is 1. The caller counts consecutive skips and gives up eventually.
    """

    @jax.jit(donate_argnums=(0,))
    def apply_update(state: TrainState, grads, num_micro_batches, loss=0.0):
        grads = jax.tree.map(lambda g: g / num_micro_batches, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        teacher = state.teacher_params
        if teacher_mode == "ema":
            teacher = optax.incremental_update(params, teacher, step_size=1.0 - ema_decay)
        new = (params, opt_state, teacher)
        old = (state.params, state.opt_state, state.teacher_params)
        params, opt_state, teacher = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              teacher_params=teacher)  # fmt: skip
        return state, {"grad_norm": grad_norm, "nonfinite": 1.0 - finite.astype(jnp.float32)}

    return apply_update


def init_state(params, optimizer, teacher_mode: str, rng, fixed_teacher_dtype="float32",
               teacher_source=None) -> TrainState:  # fmt: skip
    """A fresh TrainState. The EMA / fixed teacher is a real copy (never an alias of params,
    which would be donated twice); `teacher_source` overrides where it is copied from (e.g. a
    checkpoint's EMA with `finetune_from_ema`)."""
    source = params if teacher_source is None else teacher_source
    if teacher_mode == "ema":
        teacher = jax.tree.map(jnp.copy, source)
    elif teacher_mode == "fixed":
        teacher = jax.tree.map(lambda x: x.astype(jnp.dtype(fixed_teacher_dtype)), source)
        teacher = jax.tree.map(jnp.copy, teacher)
    else:
        teacher = None
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), teacher_params=teacher, rng=rng)  # fmt: skip


def make_sft_grad_step(graphdef, rest, settings: LossSettings):
    """SFT baseline: jit(params, pack) -> (grads, metrics) of the CE on the pack's loss entries.

    No teacher at all (so the train state keeps no teacher copy: train.py requires
    teacher_mode='self' in SFT mode). The CE is `losses.completion_ce` with the configured
    reduction; `token_accuracy` is the share of target tokens that are the argmax prediction.
    """

    def loss_fn(params, pack):
        model = nnx.merge(graphdef, params, rest)
        logits = model.logits_at(model(pack), pack.loss_rows)
        ce, _ = losses.completion_ce(
            logits, pack.loss_targets, pack.loss_mask, reduction=settings.reduction,
            sample_ids=pack.loss_sample, num_samples=settings.num_samples,
            vocab_limit=settings.vocab_limit,
        )  # fmt: skip
        predicted = jnp.argmax(losses.mask_vocab(logits, settings.vocab_limit), axis=-1)
        hits = (predicted == pack.loss_targets) & pack.loss_mask
        tokens = jnp.sum(pack.loss_mask)
        metrics = {"ce": ce, "loss": ce, "loss_tokens": tokens,
                   "token_accuracy": jnp.sum(hits) / jnp.maximum(tokens, 1)}  # fmt: skip
        return ce, metrics

    @jax.jit
    def grad_step(params, pack):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, pack)
        return grads, metrics

    return grad_step
