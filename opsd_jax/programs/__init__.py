"""Reading compiled XLA programs: their collectives and matmul FLOPs (hlo_stats.py), the HBM
bytes a GPU program's kernels move (hbm_traffic.py), the launches, CUDA graphs and host syncs
of XLA:GPU's thunk sequence (thunk_launches.py), and the compile-only GPU targets that let a
machine without a GPU compile for an H100 / H200 / H800 (gpu_target.py, gpu_targets/).

Tools for the benches, the layout tests and the compile-only preflight
(opsd_jax/run_config/preflight.py); no runtime package (training, sampling, data, io,
evaluation, toy, parallel, models) imports it (pyproject.toml [tool.importlinter]).
"""
