"""The tiny CPU default: a few-layer BAGEL on generated inputs; runs in seconds on 2 cores.

Usage: python train.py --config configs/tiny.py [--config.key=value ...]
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    # Model: a preset of models.configs.BagelConfig ('tiny' or 'bagel_7b').
    config.model_preset = "tiny"
    config.compute_dtype = "bfloat16"  # float32 for parity checks
    config.attention_backend = "chunked"  # chunked | reference | cudnn (GPU)
    config.remat = "full"  # none | full | dots | dots_no_batch
    # Mesh: num_replicate x num_shard x num_tensor devices; num_shard=-1 takes what is left.
    config.num_replicate = 1
    config.num_shard = -1
    config.num_tensor = 1
    config.global_seed = 0
    # The forward-pass job (until the trainer lands): rows of generated [image, question,
    # answer] samples; forward_rows must be divisible by the mesh's data x fsdp size.
    config.forward_rows = 4
    config.forward_tokens = 512
    config.lock()
    return config
