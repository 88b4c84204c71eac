"""Stage 2 of the toy Visual-OPSD experiment: Visual-OPSD from the stage-1 SFT checkpoint.

    python train.py --config configs/toy_opsd.py \
        --config.resume_from=results/toy_sft/checkpoints [--config.noise_vt=True]

The student samples a completion from [problem image, question]; the teacher (an EMA of the
student, initialised from the stage-1 weights) scores it with the VT image in context; the
student learns to match the teacher token by token (generalized JSD, beta 0.5). With
`noise_vt=True` the VT pixels are Gaussian noise: the control arm, which should not help.
scripts/toy_experiment.py runs both arms and evaluates them.

Recipe as in the paper (configs/thinkmorph_7b.py) except where the toy scale needs otherwise:
EMA decay 0.99 (the paper's 0.995 lags ~200 steps, longer than this whole run), a learning rate
for a 400k-parameter model, teacher top-64 (the toy vocabulary is ~400 ids), and no per-entry
clip (`jsd_token_clip` 0 instead of 0.05). The clip: the toy completion has one decisive token
(the first colour word); where student and teacher disagree there, its JSD entries are far above
0.05, so the clip gives exactly them zero gradient. Measured on the development seed (1000,
not a reported one): with the clip the student fell from 51 % to 27 % (a constant answer) in
150 steps in both arms; without it, it rose to 66 % in 100 steps. The paper's clip tempers
stylistic tokens in 1000-token reasoning; it is kept as a flag to rerun with.
"""

import ml_collections

from configs import common, toy_sft


def toy_opsd_recipe(config: ml_collections.ConfigDict) -> None:
    """The toy task and the Visual-OPSD recipe above (in place; shared with configs/tiny.py)."""
    toy_sft.toy_task_config(config)
    config.mode = "opsd"
    config.teacher_mode = "ema"
    config.ema_decay = 0.99
    config.noise_vt = False
    config.jsd_beta = 0.5
    config.jsd_temperature = 1.0
    config.jsd_top_k = 64
    config.jsd_token_clip = 0.0  # see the docstring: 0.05 zeroes the decisive token's gradient
    config.jsd_weight = 1.0
    config.ce_weight = 0.0
    config.sample_temperature = 1.0
    config.lr = 3e-4
    config.min_lr = 3e-6
    config.warmup_steps = 10
    config.lr_scheduler = "cosine"


def get_config() -> ml_collections.ConfigDict:
    config = common.base_config()
    toy_opsd_recipe(config)
    config.resume_from = "results/toy_sft/checkpoints"
    config.resume_model_only = True
    config.auto_resume = True
    config.total_steps = 150
    config.save_every = 50
    config.max_checkpoints = 10
    config.log_every = 10
    config.results_dir = "results/toy_opsd"
    config.lock()
    return config
