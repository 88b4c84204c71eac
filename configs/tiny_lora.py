"""The tiny CPU default with LoRA: the same Visual-OPSD run as configs/tiny.py, training rank-8
adapters on a frozen base instead of every weight.

    python train.py --config configs/tiny_lora.py

Adapters go on every projection (`lora_targets='.*'`: the ViT's, the connector's and the LM's
und expert): the toy task is read off the image, and with the LM's adapters alone the no-VT
accuracy does not rise (seed 0, lr 1e-3: 34.4% -> 20.3%). The learning rate, 1e-3, is 3.3 times
the full-rank run's 3e-4, as LoRA's small, zero-started update needs a larger one. Measured on 2 cores, 150 steps,
seeds 0 / 1 / 2: the no-VT accuracy rises by +35.2 / +35.9 / +32.0 points (34.4% -> 69.5%,
29.7% -> 65.6%, 25.8% -> 57.8%); the full-rank run: +32.0 at seed 0 (2026-12-04, the rollout's
KV cache in float32).
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
    config = tiny.get_config()
    config.unlock()
    config.lora_rank = 8
    config.lora_alpha = 16.0
    config.lora_targets = ".*"
    config.lr = 1e-3
    config.min_lr = 1e-5
    config.results_dir = "results/tiny_lora"
    config.lock()
    return config
