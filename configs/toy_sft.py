"""Stage 1 of the toy Visual-OPSD experiment: SFT from random init on `toy_majority`.

    python train.py --config configs/toy_sft.py [--config.global_seed=S]

Goal: a model that answers well *with* the VT image in context and clearly worse without it, the
starting point Visual-OPSD needs (scripts/toy_experiment.py runs all stages). The task
(opsd_jax/toy/tasks.py, `toy_majority`): which of four colours has the most dots; the VT
image paints the winning colour's cells, so with it the answer is nearly the image's mean colour.

Context mix, `sft_vt_fraction` = 0.75: with only the VT context (1.0) the model never learns to
write its answer after the bare question, so the stage-2 student would start from malformed
completions, not from a weaker reader; with only the student context (0.0) the model cannot use
VT images at all and there is no teacher. With 0.75 the VT view gets most of the labels and is
learnt first (~100 % with VT by step 100 on the development seed), while the problem-image view
is only emerging when the 250 steps end (~50 % there, chance is 25 %); with 0.5 the two views
were learnt nearly together (91 % vs 100 % at step 250), leaving little for stage 2 to transfer.

Prompts: no system prompt, and a short reference intro / transition, because the toy tokenizer
knows only the task's words (our default wording would cost ~150 byte-level tokens per sample).
"""

import ml_collections

from configs import common

# Short prompt texts the toy tokenizer encodes in a few tokens (shared with toy_opsd.py).
TOY_REFERENCE_INTRO = "I will keep the dots of the most frequent colour."
TOY_TRANSITION = "Which colour has the most dots?"


def toy_task_config(config: ml_collections.ConfigDict) -> None:
    """Model, data and prompt settings shared by both stages (in place)."""
    config.compute_dtype = "float32"  # CPU
    config.remat = "none"
    config.toy_data = True
    config.data.datasets = [dict(name="toy_majority", path="", weight=1.0, num_used_data=-1)]
    config.data.image_transform.max_size = 84  # 6 x 6 patches of 14 px: one per grid cell
    config.data.image_transform.min_size = 56
    # Decoding in the main thread: the images are tiny, and on 2 shared cores read threads only
    # contend with the jitted step for the GIL and the cores.
    config.data.num_threads = 0
    config.use_system_prompt = False
    config.reference_intro = TOY_REFERENCE_INTRO
    config.transition_prompt = TOY_TRANSITION
    config.sample_max_new_tokens = 16  # the reference completion is ~12 tokens
    config.sample_max_image_skips = 0  # toy completions never open an image
    config.max_forward_tokens = 512
    # One sample per row. Measured: a teacher context takes 126 tokens and 72 patches, a student
    # context 65 tokens and 36 patches, a reference target 15 tokens, a completion up to 18.
    config.pack_row_tokens = 256
    config.pack_row_patches = 128
    config.pack_student_row_tokens = 128
    config.pack_student_row_patches = 64
    config.pack_loss_entries = 32
    config.samples_per_micro_batch = 16
    config.rows_per_micro_batch = 16
    config.gradient_accumulation_steps = 1
    config.progress_bar = False


def get_config() -> ml_collections.ConfigDict:
    config = common.base_config()
    toy_task_config(config)
    config.mode = "sft"
    config.teacher_mode = "self"  # SFT has no teacher
    config.sft_vt_fraction = 0.75
    config.lr = 1e-3
    config.min_lr = 1e-5
    config.warmup_steps = 20
    config.lr_scheduler = "cosine"
    config.total_steps = 250
    config.save_every = 250
    config.log_every = 25
    config.results_dir = "results/toy_sft"
    config.lock()
    return config
