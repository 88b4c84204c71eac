"""The tiny CPU default, the README's first command: Visual-OPSD seen working in about 2 minutes.

    python train.py --config configs/tiny.py [--config.key=value ...]

The toy task `toy_majority` (opsd_jax/toy/tasks.py): which of four colours has the most dots on
a 6 x 6 grid. The visual thought (VT) image paints the winning colour's cells, so with it the
answer is easy and without it hard. The run starts from a stage-1 toy BAGEL shipped in the repo
(opsd_jax/toy/stage1/, made by scripts/make_toy_stage1.py, which records its command, commit
and sha256s in MANIFEST.json): an SFT model that answers nearly always right with the VT image
and near chance without it. Then Visual-OPSD as in configs/toy_opsd.py: the student samples
from the bare problem, the EMA teacher scores that completion with the VT image in context,
and the student learns to match it token by token. Held-out accuracy of both contexts is
printed at step 0 and every `eval_every` steps, and summarised at the end (table, one
held-out answer, `<results_dir>/summary.png`).

The toy data (ThinkMorph parquet layout, seeded by `global_seed`) is written under
`results_dir` the first time, then reused. configs/smoke.py is the machinery on a random model
(what the tests train); scripts/toy_experiment.py is the longer demonstration with its own
stage 1 per seed and the noise-VT control.
"""

import os

import ml_collections

from configs import common, toy_opsd

# The stage-1 model, found from this file so the run works from any working directory.
STAGE1_MODEL = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "opsd_jax", "toy", "stage1"
)


def get_config() -> ml_collections.ConfigDict:
    config = common.base_config()
    toy_opsd.toy_opsd_recipe(config)
    config.model_path = STAGE1_MODEL
    # Measured on 2 cores (README, 3 seeds): the no-VT accuracy rises by 31-55 points over 150
    # steps of 16 samples; with seven evaluations of both contexts that is under two minutes.
    config.total_steps = 150
    config.eval_every = 25
    config.eval_contexts = "student,teacher"
    config.eval_samples_per_dataset = 128  # of the 4096-row train file's held-out share + test
    config.eval_batch_size = 64
    config.save_every = 75
    config.max_checkpoints = 2
    config.log_every = 10
    config.results_dir = "results/tiny"
    config.lock()
    return config
