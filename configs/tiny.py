"""The tiny CPU default: Visual-OPSD on the toy task with a toy BAGEL, about a minute on 2 cores.

    python train.py --config configs/tiny.py [--config.key=value ...]

The toy model (exact BAGEL HF layout, random weights, a small BPE tokenizer trained on the toy
corpus) and the toy data (ThinkMorph parquet layout) are made by the project's scripts under
`results_dir` the first time, then reused. Option names follow the PyTorch trainer.
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    config = common.base_config()

    # --- model: an HF directory in BAGEL's layout; the toy one is made if absent ---------------
    config.model_path = ""  # empty: <results_dir>/toy_model, written by scripts/make_toy_model.py
    config.compute_dtype = "float32"  # CPU: bf16 matmuls are slow there
    config.remat = "none"

    # --- data: the toy task, written by scripts/make_toy_data.py if absent ----------------------
    config.toy_data = True
    config.data.datasets = [
        dict(name="toy_maze", path="", weight=1.0, num_used_data=-1),
        dict(name="toy_count", path="", weight=1.0, num_used_data=-1),
    ]
    # Toy images are 112 px: keep them at that size (8 x 8 patches), not BAGEL's 378 px minimum.
    config.data.image_transform.max_size = 112
    config.data.image_transform.min_size = 56

    # --- Visual-OPSD -----------------------------------------------------------------------------
    config.teacher_mode = "ema"
    config.ema_decay = 0.9
    config.jsd_top_k = 64
    config.sample_max_new_tokens = 24
    config.sample_max_image_skips = 1
    config.max_forward_tokens = 1024

    # --- optimisation ----------------------------------------------------------------------------
    config.lr = 1e-4
    config.min_lr = 1e-6
    config.warmup_steps = 2
    config.total_steps = 12
    config.samples_per_micro_batch = 2
    config.rows_per_micro_batch = 1
    config.gradient_accumulation_steps = 2

    # --- run ---------------------------------------------------------------------------------------
    config.save_every = 6
    config.log_every = 2
    config.results_dir = "results/tiny"
    config.lock()
    return config
