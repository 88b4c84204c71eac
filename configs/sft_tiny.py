"""The SFT baseline on the toy task, CPU-quick: plain CE on the reference text-only thought + answer.

    python train.py --config configs/sft_tiny.py [--config.key=value ...]

Same toy model and data as configs/smoke.py (made under `results_dir` if absent); no sampler, no
teacher (teacher_mode 'self' keeps no EMA copy). The student context only (sft_vt_fraction 0).
"""

import ml_collections

from configs import smoke


def get_config() -> ml_collections.ConfigDict:
    config = smoke.get_config()
    with config.unlocked():
        config.mode = "sft"
        config.sft_vt_fraction = 0.0
        config.teacher_mode = "self"  # SFT has no teacher
        config.lr = 1e-3  # from random init: a higher rate than the OPSD fine-tune
        config.min_lr = 1e-5
        config.total_steps = 12
        config.samples_per_micro_batch = 4
        config.rows_per_micro_batch = 2
        config.gradient_accumulation_steps = 1
        # Two samples per row: measured, a student context takes up to 241 tokens and a
        # reference target up to 100 (99 loss entries), so two fit 768 tokens / 256 entries.
        config.pack_row_tokens = 768
        config.pack_loss_entries = 256
        config.results_dir = "results/sft_tiny"
    config.lock()
    return config
