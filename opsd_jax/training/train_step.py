"""The OPSD / SFT train state and the one compiled training step.

One optimizer step (train.py drives it):

1. the sampler draws completions for every micro-batch with the current params (OPSD);
2. the host packs every micro-batch at the fixed shapes (opsd_jax/data/pack_shapes.py) and stacks
   them: arrays [micro-batches, rows, ...];
3. `make_train_step`'s jitted, donated `train_step(state, micro_batches) -> (state, metrics)`
   runs the whole rest on device: a `lax.scan` over the micro-batches (student forward /
   backward, teacher forward under stop-gradient and full remat; loss
   `ce_weight * CE + jsd_weight * (generalized JSD | tinker)`, or the SFT CE, or offline
   `ce_weight * CE + kd_weight * KL` against the cached teacher, no teacher forward) summing the
   gradients, then the mean gradient's norm, one AdamW step (grad-norm clip, warmup + cosine
   or constant LR), the EMA teacher update, and the non-finite skip. train.py compiles it ahead
   of time for each length bucket, so nothing compiles after step 1.

Teacher modes: `self` (stop-gradient of the current params: no extra memory), `ema` (an EMA copy
updated after every optimizer step: phi <- d * phi + (1 - d) * theta), `fixed` (the initial
params, frozen; `fixed_teacher_dtype='bfloat16'` stores them in bf16 to halve their memory),
`checkpoint` (another model's weights, `teacher_weights`: frozen, in the compute dtype, merged
with that model's own graph, `TeacherModel`; never checkpointed). With a teacher per data source
several run in one step, each scoring its sources' loss entries (`StepTeachers`,
opsd_jax/training/step_teachers.py).

Parameters and optimizer state are fp32 (the "master" copy); the forward computes in the model
config's compute dtype. With LoRA (`lora_rank > 0`, models/lora.py) `params` are the adapters
only (nnx.LoRAParam, fp32) and `base` the frozen model (nnx.Param, compute dtype), held once:
the student is base + adapters, the EMA / fixed teacher base + its own adapter copy, and the
optimizer, the EMA and the checkpoints touch the adapters only (`model_params`). Frozen groups (`freeze_vit`, `freeze_llm`, and with `freeze_und`
everything but lm_head, see `frozen_groups`) are split off the params before differentiation, so
the backward computes no gradient for them, they get no optimizer state, and they stay
bit-identical; `grad_norm` is over the trained parameters only.

One module of about 700 lines: the state, each mode's loss and the one compiled step share the
state's layout and the frozen-group split; the step is read in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models.pack import Pack
from opsd_jax.training import losses, step_teachers
from opsd_jax.training.step_teachers import StepTeachers, TeacherModel  # noqa: F401 (re-exported)

TEACHER_MODES = ("self", "ema", "fixed", "checkpoint")
LOSS_KINDS = ("jsd", "tinker")
LR_SCHEDULERS = ("cosine", "constant")


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Static (compile-time) loss knobs, named as in the PyTorch trainer. Made from a run
    config by opsd_jax/run_config (`loss_settings`), where their defaults are."""

    jsd_weight: float
    ce_weight: float
    jsd_loss_kind: str
    jsd_beta: float
    jsd_temperature: float
    jsd_top_k: int
    jsd_token_clip: float
    jsd_clip_mode: str
    reduction: str
    num_samples: int  # samples per micro-batch (per-sample reduction)
    # Offline mode (a cached teacher, opsd_jax/training/offline/cache.py): the PyTorch offline trainer's.
    kd_weight: float
    kd_temperature: float
    kd_use_vt_weights: bool
    kd_student_norm: str
    # Ids >= vocab_limit (padded lm_head rows, past the tokenizer) are masked out of every loss,
    # as the sampler masks them (models/vocab.mask_vocab); None keeps the whole table.
    vocab_limit: int | None = None
    # The temperature the rollout drew completions at (1 for greedy): the student's log-probs
    # are compared with the rollout's under the same one (`rollout_mismatch`).
    sample_temperature: float = 1.0


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # nnx.State of every nnx.Param (fp32), frozen groups included; LoRA: adapters
    opt_state: Any  # optax state of the trainable groups only
    teacher_params: Any  # nnx.State for 'ema' / 'fixed' (LoRA: adapters); None for 'self'
    rng: jax.Array
    # Consecutive non-finite steps up to now. Past `max_bad_steps` the step changes nothing at
    # all (not even `step`): the host reads a step's metrics one step late, and the state it
    # then saves must still be that of the last good step. Not checkpointed (a restarted run
    # counts afresh).
    bad_steps: jax.Array
    # LoRA: the frozen base model (every non-adapter nnx.Param, in the compute dtype), shared
    # by student, teacher and sampler; not checkpointed (the checkpoint names the HF weights it
    # came from). None in full fine-tuning.
    base: Any = None
    # Teachers of other checkpoints: each one's whole nnx.Param state, loaded from its own HF
    # directory, in the compute dtype; frozen, and not checkpointed (the checkpoint records
    # their paths and digests, and a resume reads them again). A tuple, one per checkpoint
    # teacher of the StepTeachers (train.py); one bare state for a step made with
    # teacher_mode='checkpoint' alone; None without such a teacher.
    teacher_weights: Any = None


def model_params(params, base):
    """The model's whole nnx.Param state: `params` alone, or LoRA adapters over the frozen
    `base` (what nnx.merge(graphdef, ..., rest) takes)."""
    return params if base is None else nnx.merge_state(params, base)


def _fresh(tree):
    # Fresh Variable objects: nnx refuses to merge Variables made at an outer trace level
    # inside value_and_grad's.
    return None if tree is None else jax.tree.map(lambda x: x, tree)


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


def frozen_groups(config, params=None) -> tuple[str, ...]:
    """The parameter groups that are not trained: top-level names ('vit_model') or, one level
    down, 'language_model/<name>'.

    `freeze_und` is BAGEL's flag (Qwen2MoT forward_train in modeling/bagel/qwen2_navit.py):
    every understanding-token activation is detached, at the LM input, after q/k/v, after
    attention, after the MLP and after the final norm, so only generation tokens carry gradient
    into the LM body. In understanding-only training every token is an understanding token, so
    nothing but `lm_head` (applied after the detached final norm) gets a gradient: the ViT,
    connector, embeddings and LM layers keep their values, as frozen groups do here. It needs
    `params` (the names of the groups to freeze).
    """
    groups = [
        name
        for name, frozen in (
            ("vit_model", config.freeze_vit),
            ("language_model", config.freeze_llm),
        )
        if frozen
    ]
    if config.freeze_und:
        if params is None:
            raise ValueError("frozen_groups: freeze_und needs the params' group names")
        raw = _raw(params)
        groups += [k for k in raw if k != "language_model"]
        groups += [f"language_model/{k}" for k in _raw(raw["language_model"]) if k != "lm_head"]
    return tuple(dict.fromkeys(groups))


def split_params(params, frozen: tuple[str, ...] = ()):
    """(trainable, frozen) halves of the params, each of the params' type. A group is a
    top-level name or 'top/name' one level down (see `frozen_groups`)."""
    trainable, kept = {}, {}
    for key, value in _raw(params).items():
        inner = {g.split("/", 1)[1] for g in frozen if g.startswith(f"{key}/")}
        if key in frozen:
            kept[key] = value
        elif inner:
            sub = _raw(value)
            trainable[key] = type(sub)({k: v for k, v in sub.items() if k not in inner})
            kept[key] = type(sub)({k: v for k, v in sub.items() if k in inner})
        else:
            trainable[key] = value
    return type(params)(trainable), type(params)(kept)


def merge_params(trainable, frozen, like):
    """The inverse of `split_params`, keys in the order of `like` (an nnx.State's pytree
    structure follows its key order, and the compiled step's output must match its input)."""
    halves = (_raw(trainable), _raw(frozen))
    merged = {}
    for key, value in _raw(like).items():
        parts = [h[key] for h in halves if key in h]
        if len(parts) == 1:
            merged[key] = parts[0]
        else:  # split one level down
            both = {**_raw(parts[0]), **_raw(parts[1])}
            sub = _raw(value)
            merged[key] = type(sub)({k: both[k] for k in sub})
    return type(trainable)(merged)


def _raw(params) -> dict:
    # An nnx.State wraps nested dicts in new States on item access, which changes the pytree
    # structure; its raw mapping keeps them as they are.
    return getattr(params, "raw_mapping", params)


def make_optimizer(config) -> optax.GradientTransformation:
    """AdamW with grad-norm clipping, for the trainable params only (see `split_params`)."""
    return optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(
            learning_rate_schedule(config),
            b1=config.beta1,
            b2=config.beta2,
            eps=config.eps,
            weight_decay=0.0,
        ),
    )


def applied_learning_rate(opt_state, schedule: optax.Schedule) -> jax.Array:
    """The learning rate the next update applies: the schedule at optax's own step count, which
    a skipped (non-finite) step does not advance."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    count = next(
        c for path, c in counts if getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState"
    )
    return schedule(count)


def completion_loss(
    student_logits, teacher_logits, pack: Pack, settings: LossSettings, by_source=None
):
    """ce_weight * CE + jsd_weight * distillation over the pack's loss entries. `by_source`:
    (StepTeachers, each entry's data source [R, E]) adds each source's distillation."""
    common = dict(sample_ids=pack.loss_sample, num_samples=settings.num_samples)
    if settings.jsd_loss_kind == "jsd":
        distill, diag = losses.generalized_jsd(
            student_logits,
            teacher_logits,
            pack.loss_mask,
            beta=settings.jsd_beta,
            temperature=settings.jsd_temperature,
            top_k=settings.jsd_top_k,
            clip=settings.jsd_token_clip,
            clip_mode=settings.jsd_clip_mode,
            reduction=settings.reduction,
            token_ids=pack.loss_targets,
            vocab_limit=settings.vocab_limit,
            **common,
        )
    else:
        distill, diag = losses.tinker_loss(
            student_logits,
            teacher_logits,
            pack.loss_targets,
            pack.loss_mask,
            temperature=settings.jsd_temperature,
            sample_temperature=settings.sample_temperature,  # warns when they differ
            reduction=settings.reduction,
            vocab_limit=settings.vocab_limit,
            **common,
        )
    metrics = {"jsd": distill}
    if by_source is not None:
        teachers, entry_sources = by_source
        metrics.update(
            step_teachers.source_metrics(
                teachers.source_names, diag["per_token"], entry_sources, pack.loss_mask
            )
        )
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
            student_logits,
            pack.loss_targets,
            pack.loss_mask,
            reduction=settings.reduction,
            vocab_limit=settings.vocab_limit,
            **common,
        )
        loss = loss + settings.ce_weight * ce
        metrics["ce"] = ce
    metrics["loss"] = loss
    metrics["loss_tokens"] = jnp.sum(pack.loss_mask)
    return loss, metrics


def rollout_mismatch(student_logits, pack: Pack, sampled, settings: LossSettings) -> dict:
    """How far the rollout's policy was from the student the step trains: at each completion
    token the rollout recorded (`sampled` [R, C], its log-prob as drawn; NaN elsewhere), the
    student's log-prob of the same token in this forward, at the sampling temperature. The gap
    |log p_student - log p_rollout| (mean and largest) and the per-token estimate of
    KL(rollout || student), E[exp(r) - 1 - r] with r the log ratio (unbiased, never negative).
    Any difference between the two programs shows here: the decode copy's precision, a wrong
    decode kernel, a stale or badly merged copy, lookahead's older policy versions."""
    valid = pack.loss_mask & jnp.isfinite(sampled)
    student = losses.token_logprobs(
        jax.lax.stop_gradient(student_logits),
        pack.loss_targets,
        valid,
        temperature=settings.sample_temperature,
        vocab_limit=settings.vocab_limit,
    )
    log_ratio = jnp.where(valid, student - jnp.where(valid, sampled, 0.0), 0.0)
    count = jnp.maximum(jnp.sum(valid), 1)
    return {
        "rollout/logprob_gap_mean": jnp.sum(jnp.abs(log_ratio)) / count,
        "rollout/logprob_gap_max": jnp.max(jnp.abs(log_ratio)),
        "rollout/mismatch_kl": jnp.sum(jnp.expm1(log_ratio) - log_ratio) / count,
    }


Loss = Callable[[Any, Any, tuple], tuple[jax.Array, dict]]


def make_opsd_loss(
    graphdef, rest, settings: LossSettings, teacher_mode, teacher_model=None
) -> Loss:
    """loss(params, teacher_params, (student_pack, teacher_pack[, sampled[, sources]])) ->
    (loss, metrics). With `sampled` (the rollout's log-probs at the student's entries,
    OpsdBatches' third part) the metrics hold the rollout's mismatch with the student
    (`rollout_mismatch`).

    `teacher_mode`: one teacher's kind (TEACHER_MODES), whose state `teacher_params` is (None
    for 'self'; for 'checkpoint' the weights of `teacher_model`, a TeacherModel); or a
    StepTeachers, and then `teacher_params` is a tuple of each teacher's state
    (StepTeachers.states) and, with teachers by data source, `sources` each loss entry's
    source (step_teachers.py)."""
    if isinstance(teacher_mode, StepTeachers):
        teachers, one_state = teacher_mode, False
        if teacher_model is not None:
            raise ValueError("StepTeachers carry their TeacherModels: give no teacher_model")
    else:
        if teacher_mode not in TEACHER_MODES:
            raise ValueError(f"teacher_mode={teacher_mode!r}; allowed: {TEACHER_MODES}")
        if (teacher_mode == "checkpoint") != (teacher_model is not None):
            raise ValueError("a TeacherModel goes with teacher_mode='checkpoint', and only with it")
        models = () if teacher_model is None else (teacher_model,)
        teachers, one_state = StepTeachers((teacher_mode,), models), True
    graphs = teachers.graphs((graphdef, rest))

    def teacher_logits(t, teacher_params, pack):
        # Full remat + stop-gradient: the teacher's activations are never kept for a backward.
        @jax.checkpoint
        def forward(teacher_params, pack):
            teacher = nnx.merge(graphs[t][0], teacher_params, graphs[t][1])
            return teacher.logits_at(teacher(pack), pack.loss_rows)

        return jax.lax.stop_gradient(forward(jax.lax.stop_gradient(teacher_params), pack))

    def teacher_source(kind, params, state):
        if kind == "self":
            return params
        if kind == "fixed":  # possibly stored in bf16: compute from fp32 copies
            return jax.tree.map(lambda p, t: t.astype(p.dtype), params, state)
        return state

    def loss_fn(params, teacher_params, packs):
        student_pack, teacher_pack = packs[:2]
        # The student on Variables of its own: a forward writes its layer loop's outputs back
        # into the Variables it was merged from, and a teacher reading those (the student's
        # own for 'self', the shared LoRA base for 'ema' / 'fixed') made the layer loop stack a
        # copy of every layer's weights for it (13 GiB on the one-GPU 7B recipe).
        student = nnx.merge(graphdef, _fresh(params), rest)
        student_logits = student.logits_at(student(student_pack), student_pack.loss_rows)
        states = (teacher_params,) if one_state else teacher_params
        weights = [teacher_source(k, params, x) for k, x in zip(teachers.kinds, states)]

        def logits_of(t):
            return teacher_logits(t, weights[t], teacher_pack)

        by_source = None
        if teachers.by_source:
            entry_sources = packs[3]
            by_source = (teachers, entry_sources)
        if len(teachers.kinds) > 1:
            logits = step_teachers.route(teachers, logits_of, entry_sources, student_pack.loss_mask)
        else:
            logits = logits_of(0)
        loss, metrics = completion_loss(student_logits, logits, student_pack, settings, by_source)
        if len(packs) > 2:
            metrics.update(rollout_mismatch(student_logits, student_pack, packs[2], settings))
        return loss, metrics

    return loss_fn


def make_sft_loss(graphdef, rest, settings: LossSettings) -> Loss:
    """SFT baseline: loss(params, None, (pack,)) -> (CE on the pack's loss entries, metrics).

    No teacher at all (so the train state keeps no teacher copy: train.py requires
    teacher_mode='self' in SFT mode). The CE is `losses.completion_ce` with the configured
    reduction; `token_accuracy` is the share of target tokens that are the argmax prediction.
    """

    def loss_fn(params, teacher_params, packs):
        del teacher_params
        (pack,) = packs
        model = nnx.merge(graphdef, params, rest)
        logits = model.logits_at(model(pack), pack.loss_rows)
        ce, _ = losses.completion_ce(
            logits,
            pack.loss_targets,
            pack.loss_mask,
            reduction=settings.reduction,
            sample_ids=pack.loss_sample,
            num_samples=settings.num_samples,
            vocab_limit=settings.vocab_limit,
        )
        predicted = jnp.argmax(losses.mask_vocab(logits, settings.vocab_limit), axis=-1)
        hits = (predicted == pack.loss_targets) & pack.loss_mask
        tokens = jnp.sum(pack.loss_mask)
        metrics = {
            "ce": ce,
            "loss": ce,
            "loss_tokens": tokens,
            "token_accuracy": jnp.sum(hits) / jnp.maximum(tokens, 1),
        }
        return ce, metrics

    return loss_fn


def make_loss(
    mode: str,
    graphdef,
    rest,
    settings: LossSettings,
    teacher_mode,
    teacher_model=None,
    *,
    source_names: tuple[str, ...] = (),
) -> Loss:
    """The loss of a training mode: 'opsd' (student vs teacher: `teacher_mode` a kind or a
    StepTeachers, as make_opsd_loss takes it), 'sft' or 'offline' (with `source_names`, its
    cache collected per data source, each source's KD term logged)."""
    if mode == "sft":
        return make_sft_loss(graphdef, rest, settings)
    if mode == "offline":
        return make_offline_loss(graphdef, rest, settings, source_names)
    return make_opsd_loss(graphdef, rest, settings, teacher_mode, teacher_model)


def make_grad_step(graphdef, rest, settings: LossSettings, teacher_mode: str, teacher_model=None):
    """jit(params, teacher_params, student_pack, teacher_pack[, base]) -> (grads, metrics) of
    one OPSD micro-batch: the body of the train step's scan, alone (bench/scale.py and
    bench/gpu_check.py compile it for the GPU target; the layout tests read its program). With
    a LoRA `base`, params and teacher_params are adapters and the grads are theirs; with a
    `teacher_model` (teacher_mode='checkpoint') teacher_params are its whole weights."""
    loss_fn = make_opsd_loss(graphdef, rest, settings, teacher_mode, teacher_model)

    @jax.jit
    def grad_step(params, teacher_params, student_pack, teacher_pack, base=None):
        def loss_of(params):
            here = _fresh(base)
            teacher = None if teacher_params is None else model_params(teacher_params, here)
            if teacher_model is not None:  # another model's weights, whole
                teacher = _fresh(teacher_params)
            return loss_fn(model_params(params, here), teacher, (student_pack, teacher_pack))

        (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        return grads, metrics

    return grad_step


def make_offline_loss(
    graphdef, rest, settings: LossSettings, source_names: tuple[str, ...] = ()
) -> Loss:
    """Offline Visual-OPSD: loss(params, None, (pack, cache[, sources])) -> (`ce_weight * CE +
    kd_weight * KL(cached teacher top-k || student)` on the text-only pack, metrics). With
    `source_names` and `sources` (each loss entry's data source) the metrics hold each
    source's KD term (source/<name>/kd, step_teachers.source_metrics).

    `cache` holds the teacher's top-k log-probs and ids and the VT-sensitivity weights at the
    pack's loss entries (offline_views.offline_batch). No teacher forward and no teacher copy
    (train.py requires teacher_mode='self' in offline mode).
    """

    def loss_fn(params, teacher_params, packs):
        del teacher_params
        pack, cache = packs[:2]
        model = nnx.merge(graphdef, params, rest)
        logits = model.logits_at(model(pack), pack.loss_rows)
        common = dict(
            sample_ids=pack.loss_sample,
            num_samples=settings.num_samples,
            vocab_limit=settings.vocab_limit,
        )
        kd, diag = losses.cached_top_k_kl(
            logits,
            cache["top_logprobs"],
            cache["top_ids"],
            pack.loss_mask,
            temperature=settings.kd_temperature,
            reduction=settings.reduction,
            weights=cache["vt_weights"] if settings.kd_use_vt_weights else None,
            student_norm=settings.kd_student_norm,
            **common,
        )
        tokens = jnp.sum(pack.loss_mask)
        loss = settings.kd_weight * kd
        metrics = {
            "kd": kd,
            "loss_tokens": tokens,
            "vt_weight_mean": jnp.sum(jnp.where(pack.loss_mask, cache["vt_weights"], 0.0))
            / jnp.maximum(tokens, 1),
        }
        if source_names and len(packs) > 2:
            metrics.update(
                step_teachers.source_metrics(
                    source_names, diag["per_token"], packs[2], pack.loss_mask, "kd"
                )
            )
        if settings.ce_weight:
            ce, _ = losses.completion_ce(
                logits, pack.loss_targets, pack.loss_mask, reduction=settings.reduction, **common
            )
            loss = loss + settings.ce_weight * ce
            metrics["ce"] = ce
        metrics["loss"] = loss
        return loss, metrics

    return loss_fn


def _update(
    state: TrainState, grads, loss, *, optimizer, teacher_mode, ema_decay, frozen, max_bad_steps
):
    """One AdamW step from the mean gradient of the trainable params, then the EMA.

    A non-finite gradient norm or loss skips the update: params, optimizer state and EMA stay
    exactly as they were, `step` advances (the batch is consumed), `bad_steps` counts it. Once
    `bad_steps` exceeds `max_bad_steps` (None: never) the run is stopping and the step is a
    no-op, `step` included.
    """
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
    halted = jnp.bool_(False) if max_bad_steps is None else state.bad_steps > max_bad_steps
    apply = finite & ~halted

    def update(old):
        params, opt_state, teacher = old
        trainable, frozen_params = split_params(params, frozen)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        params = merge_params(optax.apply_updates(trainable, updates), frozen_params, params)
        if teacher_mode == "ema":
            teacher = optax.incremental_update(params, teacher, step_size=1.0 - ema_decay)
        return params, opt_state, teacher

    # A branch, not a per-leaf select between new and old values: a skipped step then costs
    # nothing, and an applied one makes no second pass over params, moments and EMA (on a CPU
    # that pass cost as much as the AdamW update itself).
    old = (state.params, state.opt_state, state.teacher_params)
    params, opt_state, teacher = jax.lax.cond(apply, update, lambda old: old, old)
    bad_steps = jnp.where(finite, 0, state.bad_steps + 1)
    state = state.replace(
        step=jnp.where(halted, state.step, state.step + 1),
        params=params,
        opt_state=opt_state,
        teacher_params=teacher,
        bad_steps=jnp.where(halted, state.bad_steps, bad_steps),
    )
    nonfinite = 1.0 - finite.astype(jnp.float32)
    return state, {"grad_norm": grad_norm, "nonfinite": nonfinite, "bad_steps": state.bad_steps}


def make_apply_update(
    optimizer: optax.GradientTransformation,
    teacher_mode: str,
    ema_decay: float,
    frozen: tuple[str, ...] = (),
):
    """jit(state, summed grads of the trainable params, number of micro-batches[, loss]) ->
    (new state, update metrics): the train step's update on its own (tests)."""

    @jax.jit(donate_argnums=(0,))
    def apply_update(state: TrainState, grads, num_micro_batches, loss=0.0):
        grads = jax.tree.map(lambda g: g / num_micro_batches, grads)
        return _update(
            state,
            grads,
            loss,
            optimizer=optimizer,
            teacher_mode=teacher_mode,
            ema_decay=ema_decay,
            frozen=frozen,
            max_bad_steps=None,
        )

    return apply_update


# The loss metrics in the loss's own units: under 'token_sum' a step's value is their sum.
LOSS_TERMS = ("loss", "jsd", "ce", "kd", "tinker_k1", "tinker_surrogate")


def micro_batch_reduction(key: str, sum_micro_batches: bool):
    """How a step combines a metric over its micro-batches: a largest (`_max`) stays the
    largest; a count (`tokens`, a `_sum`) adds up, as do the loss terms when the loss is a plain
    sum ('token_sum'); the rest (means, fractions) are the micro-batches' mean."""
    if key.endswith("_max"):
        return jnp.max
    if key.endswith(("tokens", "_sum")) or (sum_micro_batches and key in LOSS_TERMS):
        return jnp.sum
    return jnp.mean


def make_train_step(
    loss_fn: Loss,
    optimizer: optax.GradientTransformation,
    *,
    teacher_mode,
    ema_decay: float,
    schedule: optax.Schedule,
    frozen: tuple[str, ...] = (),
    max_bad_steps: int | None = None,
    state_shardings=None,
    sum_micro_batches: bool = False,
):
    """jit(state, micro_batches) -> (state, metrics), the state donated.

    `teacher_mode`: the one teacher's kind (the loss then takes the teacher's state alone), or
    the loss's StepTeachers (it then takes each teacher's state: StepTeachers.states, the
    checkpoint teachers' from the state's `teacher_weights` tuple).

    `micro_batches`: the `loss_fn`'s pack tuple with every array stacked on a leading
    micro-batch axis. Gradient accumulation is a `lax.scan` over that axis: the gradients of
    the trainable params are summed in one buffer (sharded like the params when
    `state_shardings` is given, which also pins the output state to the input's layout, so the
    compiled step takes its own output). The step's loss is the micro-batches' mean, or their
    sum with `sum_micro_batches` (the 'token_sum' reduction: the step's plain sum over all its
    tokens, so its gradient is the one big batch's). Metrics: combined over the micro-batches
    by `micro_batch_reduction`, then `grad_norm` (trainable params), `nonfinite`, `bad_steps` and `lr`, the learning rate
    this update applied; with teachers by data source, each source's `source/<name>/jsd` and
    `source/<name>/tokens` (step_teachers.finish_source_metrics).
    """
    teachers = teacher_mode if isinstance(teacher_mode, StepTeachers) else None
    if teachers is not None:
        teacher_mode = teachers.copy_mode

    def teacher_states(state: TrainState, base):
        copy = state.teacher_params
        if copy is not None:
            copy = model_params(_fresh(copy), base)
        if teachers is not None:
            weights = state.teacher_weights
            return teachers.states(copy, None if weights is None else _fresh(tuple(weights)))
        if copy is None and state.teacher_weights is not None:  # another model's, whole
            return _fresh(state.teacher_weights)
        return copy

    def train_step(state: TrainState, micro_batches):
        trainable, frozen_params = split_params(state.params, frozen)

        def accumulate(grads, packs):
            def loss_of(trainable):
                params = merge_params(trainable, _fresh(frozen_params), state.params)
                base = _fresh(state.base)
                teacher = teacher_states(state, base)
                return loss_fn(model_params(params, base), teacher, packs)

            (_, metrics), micro_grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
            return jax.tree.map(jnp.add, grads, micro_grads), metrics

        grads = jax.tree.map(jnp.zeros_like, trainable)
        if state_shardings is not None:
            layout = split_params(state_shardings.params, frozen)[0]
            grads = jax.lax.with_sharding_constraint(grads, layout)
        grads, metrics = jax.lax.scan(accumulate, grads, micro_batches)
        if not sum_micro_batches:  # the micro-batches' mean, as one batch of them all
            num_micro = jax.tree.leaves(micro_batches)[0].shape[0]
            grads = jax.tree.map(lambda g: g / num_micro, grads)
        metrics = {
            k: micro_batch_reduction(k, sum_micro_batches)(m, axis=0) for k, m in metrics.items()
        }
        metrics = step_teachers.finish_source_metrics(metrics)
        lr = applied_learning_rate(state.opt_state, schedule)
        state, update_metrics = _update(
            state,
            grads,
            metrics["loss"],
            optimizer=optimizer,
            teacher_mode=teacher_mode,
            ema_decay=ema_decay,
            frozen=frozen,
            max_bad_steps=max_bad_steps,
        )
        return state, {**metrics, **update_metrics, "lr": lr}

    out_shardings = None
    if state_shardings is not None:
        mesh = jax.tree.leaves(state_shardings)[0].mesh
        out_shardings = (state_shardings, NamedSharding(mesh, PartitionSpec()))
    return jax.jit(train_step, donate_argnums=(0,), out_shardings=out_shardings)


def init_state(
    params,
    optimizer,
    teacher_mode: str,
    rng,
    fixed_teacher_dtype="float32",
    teacher_source=None,
    frozen: tuple[str, ...] = (),
    base=None,
    teacher_weights=None,
) -> TrainState:
    """A fresh TrainState. The EMA / fixed teacher is a real copy (never an alias of params,
    which would be donated twice); `teacher_source` overrides where it is copied from (e.g. a
    checkpoint's EMA with `finetune_from_ema`); the optimizer state covers the params outside
    the `frozen` groups. With LoRA `params` are the adapters and `base` the frozen model.
    `teacher_weights`: a checkpoint teacher's weights ('checkpoint'), held as given."""
    if teacher_mode == "checkpoint" and teacher_weights is None:
        raise ValueError("teacher_mode='checkpoint' needs the teacher's teacher_weights")
    source = params if teacher_source is None else teacher_source
    if teacher_mode == "ema":
        teacher = jax.tree.map(jnp.copy, source)
    elif teacher_mode == "fixed":
        teacher = jax.tree.map(lambda x: x.astype(jnp.dtype(fixed_teacher_dtype)), source)
        teacher = jax.tree.map(jnp.copy, teacher)
    else:
        teacher = None
    opt_state = optimizer.init(split_params(params, frozen)[0])
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        teacher_params=teacher,
        rng=rng,
        bad_steps=jnp.zeros((), jnp.int32),
        base=base,
        teacher_weights=teacher_weights,
    )


def abstract_state(
    abstract_params,
    optimizer,
    teacher_mode: str,
    rng,
    *,
    fixed_teacher_dtype="float32",
    frozen: tuple[str, ...] = (),
    abstract_base=None,
    abstract_teacher_weights=None,
) -> TrainState:
    """The TrainState `init_state` would make, as ShapeDtypeStructs carrying their shardings
    (no memory): the restore target of a resume and the AOT compile's argument. `abstract_params`
    carry NamedShardings (mesh.abstract_model); the optimizer moments and the teacher are laid
    out like their params, scalars and the rng key replicated. LoRA: `abstract_params` are the
    adapters, `abstract_base` the frozen base (kept as given); `abstract_teacher_weights` a
    checkpoint teacher's weights (kept as given)."""
    shapes = jax.eval_shape(
        lambda p, w: init_state(
            p, optimizer, teacher_mode, rng, fixed_teacher_dtype, frozen=frozen, teacher_weights=w
        ),
        abstract_params,
        abstract_teacher_weights,
    )
    mesh = jax.tree.leaves(abstract_params)[0].sharding.mesh
    replicated = NamedSharding(mesh, PartitionSpec())

    def like(x, param=None):
        sharding = replicated if param is None else param.sharding
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    trainable = split_params(abstract_params, frozen)[0]
    opt_state = optax.tree_utils.tree_map_params(
        optimizer, like, shapes.opt_state, trainable, transform_non_params=like
    )
    teacher = shapes.teacher_params
    if teacher is not None:
        teacher = jax.tree.map(like, teacher, abstract_params)
    return TrainState(
        step=like(shapes.step),
        params=jax.tree.map(like, shapes.params, abstract_params),
        opt_state=opt_state,
        teacher_params=teacher,
        rng=like(shapes.rng),
        bad_steps=like(shapes.bad_steps),
        base=abstract_base,
        teacher_weights=abstract_teacher_weights,
    )


def shardings_of(tree):
    """The `.sharding` of every leaf (ShapeDtypeStructs or arrays)."""
    return jax.tree.map(lambda x: x.sharding, tree)
