"""Sanity check: overfit a handful of toy samples (the loss should fall steadily).

    python train.py --config configs/sanity.py

Four toy samples, a constant learning rate and the 'fixed' teacher, so the target does not move:
if the JSD does not go down here, something in the pipeline is broken.
"""

from configs import smoke


def get_config():
    config = smoke.get_config()
    with config.unlocked():
        config.teacher_mode = "fixed"
        config.lr = 1e-3
        config.lr_scheduler = "constant"
        config.warmup_steps = 0
        config.total_steps = 30
        config.save_every = 30
        config.log_every = 5
        config.jsd_token_clip = 0.0
        config.sample_do_sample = False  # the same completions every step
        config.results_dir = "results/sanity"
        config.data.datasets = [dict(name="toy_maze", path="", weight=1.0, num_used_data=4)]
        # Greedy decoding of the starting model fills the whole 24-token budget every step: two
        # such student views (contexts up to 241 tokens) need 532 tokens, more than smoke.py's
        # 512-token student row, which would cut one completion per row every step.
        config.pack_student_row_tokens = 640
    config.lock()
    return config
