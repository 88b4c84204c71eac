"""Offline Visual-OPSD on ThinkMorph-7B with the PyTorch offline trainer's defaults
(scripts/visual_opsd/run_collect_traces.sh + run_visual_opsd_offline.sh).

    python scripts/collect_traces.py --config configs/offline_7b.py \
        --config.model_path=/path/to/ThinkMorph-7B --config.data_root=/path/to/ThinkMorph_data
    python train.py --config configs/offline_7b.py \
        --config.model_path=/path/to/ThinkMorph-7B --config.data_root=/path/to/ThinkMorph_data

Cache: top-256 teacher log-probs in float16 + int32 ids + VT weights, 200 samples per shard.
Training: CE (weight 1) + 0.5 * VT-weighted top-k KL at temperature 2 (tau^2 scaled), lr 1e-5
cosine to 1e-7 after 200 warm-up steps, 8000 steps, a checkpoint every 1000, no sampler and no
teacher copy. Data, optimiser betas / eps and mesh as configs/thinkmorph_7b.py. Differences
that remain: the PyTorch trainer packs micro-batches by a 10240-token budget (here 8 samples in
8 rows, one micro-batch per step), takes the CE as a token mean (here `loss_reduction`, the
sequence mean, for both terms) and aligns its two views from their ends (here both views score
the same target, the reference completion the PyTorch student trains on, and the teacher sees the
VT images in its context before it; `offline_target`, opsd_jax/training/offline/cache.py).
"""

import ml_collections

from configs import thinkmorph_7b


def get_config() -> ml_collections.ConfigDict:
    config = thinkmorph_7b.get_config()
    with config.unlocked():
        config.mode = "offline"
        config.teacher_mode = "self"  # the teacher is the cache: no EMA copy in memory
        config.offline_cache_dir = "traces/visual_opsd_teacher_cache"
        config.offline_top_k = 256
        config.offline_logprob_dtype = "float16"
        config.offline_shard_samples = 200
        config.kd_weight = 0.5
        config.kd_temperature = 2.0
        config.kd_use_vt_weights = True
        config.kd_student_norm = "full"
        config.ce_weight = 1.0
        config.gradient_accumulation_steps = 1
        config.total_steps = 8000
        config.save_every = 1000
        config.results_dir = "results/offline_7b"
    config.lock()
    return config
