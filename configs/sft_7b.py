"""The SFT baseline on ThinkMorph-7B: the Visual-OPSD paper recipe's data, optimiser and batch
(configs/thinkmorph_7b.py), trained with plain CE on the reference text-only thought + answer.

    python train.py --config configs/sft_7b.py \
        --config.model_path=/path/to/ThinkMorph-7B --config.data_root=/path/to/ThinkMorph_data

The comparison the paper's SFT baseline makes: same samples per step, same steps, same learning
rate schedule, no sampler and no teacher (teacher_mode 'self' keeps no EMA copy), student context
only (sft_vt_fraction 0).
"""

import ml_collections

from configs import thinkmorph_7b


def get_config() -> ml_collections.ConfigDict:
    config = thinkmorph_7b.get_config()
    with config.unlocked():
        config.mode = "sft"
        config.sft_vt_fraction = 0.0
        config.teacher_mode = "self"  # SFT has no teacher: no EMA copy in memory
        config.results_dir = "results/sft_7b"
    config.lock()
    return config
