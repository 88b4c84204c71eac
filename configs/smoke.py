"""The machinery on a CPU: Visual-OPSD's whole run with a *random* toy BAGEL, about a minute.

    python train.py --config configs/smoke.py [--config.key=value ...]

What the tests train (and configs/sanity.py, sft_tiny.py, offline_tiny.py build on): every
stage of a run (sampler, packs, the donated step, EMA, checkpoints, resume, evaluation) on two
toy tasks, two samples per micro-batch and two micro-batches per step. It learns nothing worth reading: the model starts random, so
its completions are byte noise. configs/tiny.py, the README's first command, is the one that
shows the method working.

The toy model (exact BAGEL HF layout, random weights, a small BPE tokenizer trained on the toy
corpus) and the toy data (ThinkMorph parquet layout) are made by the project's scripts under
`results_dir` the first time, then reused. Option names follow the PyTorch trainer.
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    config = common.base_config()

    # --- model: an HF directory in BAGEL's layout; the toy one is made if absent ---------------
    config.model_path = ""  # empty: <results_dir>/toy_model, written by opsd_jax/toy/model.py
    # CPU choices, measured with bench/vs_pytorch.py (docs/performance.md, On a CPU): fp32
    # (bf16 matmuls are slower on XLA:CPU), every activation kept, the layer loop unrolled, and
    # 128-token attention tiles (a padded 512 tile is paid in full on a CPU). The attention
    # stays `auto` (chunked): with two samples per row it skips the blocks between them, and
    # bench/train_step.py's toy step took 76.4-76.6 ms with `dense` (the fastest CPU backend
    # for one sample per row) against 60.7-60.9.
    config.compute_dtype = "float32"
    config.remat = "none"
    config.unroll_layers = True
    config.attention_block = 128

    # --- data: the toy task, written by opsd_jax/toy/data.py if absent -------------------------
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
    # Two toy samples per row (2 per micro-batch, 1 row). Measured on the toy data: a teacher
    # context takes 420-459 tokens and 128 patches, a student context 204-241 tokens and 64
    # patches, a completion up to 26 tokens (25 loss entries). So two teacher views always fit
    # 1024 tokens / 256 patches; two student views fit 512 tokens unless both contexts and both
    # completions are near their longest (then a completion is cut; `pack/truncated` counts it).
    # The derived sizes (docs/configuration.md) would be 1024 / 1024 patches, 768 / 128 patches, 128 entries:
    # safe for any data, slower here.
    config.pack_row_tokens = 1024
    config.pack_row_patches = 256
    config.pack_student_row_tokens = 512
    config.pack_student_row_patches = 128
    config.pack_loss_entries = 64

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
    config.results_dir = "results/smoke"
    config.lock()
    return config
