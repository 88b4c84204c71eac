"""Offline Visual-OPSD on the toy task, CPU-quick: cache the teacher once, then train on it.

    python scripts/collect_traces.py --config configs/offline_tiny.py   # the cache (once)
    python train.py --config configs/offline_tiny.py                    # the student

The toy model of configs/smoke.py (made under `results_dir` if absent) and 16 rows of one of its
toy tasks, toy_count. The collector runs that model over those training rows and writes the cache to `offline_cache_dir`; the
trainer (mode 'offline') trains the student on the text-only view with CE + kd_weight * top-k
KL against it, without a sampler or a teacher forward.
"""

import ml_collections

from configs import smoke


def get_config() -> ml_collections.ConfigDict:
    config = smoke.get_config()
    with config.unlocked():
        config.mode = "offline"
        config.teacher_mode = "self"  # the teacher is the cache: no EMA copy
        config.offline_top_k = 64
        config.offline_shard_samples = 8
        config.ce_weight = 1.0  # the PyTorch offline trainer's CE + kd_weight * KL
        config.data.datasets = [dict(name="toy_count", path="", weight=1.0, num_used_data=16)]
        config.total_steps = 6
        config.save_every = 3
        config.samples_per_micro_batch = 4
        config.rows_per_micro_batch = 2
        # Two samples per row of up to 83-entry reference targets (the text-only thought and
        # answer of toy_count; smoke's 64 fit two 24-token on-policy completions).
        config.pack_loss_entries = 192
        config.gradient_accumulation_steps = 1
        config.results_dir = "results/offline_tiny"
    config.lock()
    return config
