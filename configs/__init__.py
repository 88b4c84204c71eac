"""The run configs: `python train.py --config configs/<name>.py` (every option in common.py)."""
