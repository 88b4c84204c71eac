"""The offline arm of the toy Visual-OPSD experiment: the stage-1 model cached once as teacher.

    python scripts/collect_traces.py --config configs/toy_offline.py \
        --config.resume_from=results/toy_sft/checkpoints
    python train.py --config configs/toy_offline.py --config.resume_from=results/toy_sft/checkpoints

The collector runs the stage-1 model over the toy_majority training rows with the VT image in
context (and without, for the VT weights); the student starts from the same weights and trains
on the text-only view with the PyTorch offline trainer's loss: CE on the reference target plus
0.5 x the VT-weighted top-k KL at temperature 2 against the cache. The CE half alone is SFT on
the reference thought and answer without the VT image, so this arm mixes SFT with distillation
(scripts/toy_experiment.py --offline runs it next to the on-policy arms). Optimiser, steps and
checkpoints as configs/toy_opsd.py.
"""

import ml_collections

from configs import toy_opsd


def get_config() -> ml_collections.ConfigDict:
    config = toy_opsd.get_config()
    with config.unlocked():
        config.mode = "offline"
        config.teacher_mode = "self"  # the teacher is the cache: no EMA copy
        config.offline_top_k = 64  # the toy vocabulary is ~400 ids
        config.offline_shard_samples = 256
        config.kd_weight = 0.5
        config.kd_temperature = 2.0
        config.kd_use_vt_weights = True
        config.ce_weight = 1.0
        # The reference target scores 46 entries (two blocks around the VT image), more than
        # the on-policy completion bound of 32 the rows inherit: one sample per row.
        config.pack_loss_entries = 128
        config.results_dir = "results/toy_offline"
    config.lock()
    return config
