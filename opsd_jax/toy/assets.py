"""The toy data and toy model a tiny config trains on, written under its results_dir on the
first run (then reused), and the config pointed at them."""

from __future__ import annotations

import os

from opsd_jax.parallel import distributed
from opsd_jax.toy import data as toy_data
from opsd_jax.toy import model as toy_model


def prepare_toy_assets(config) -> None:
    """Write the toy data and the toy model under results_dir the first time (then reuse).

    With several processes the main one writes first; a process on a host that does not share
    the folder then writes its own (identical: the scripts are deterministic) copy."""
    if not distributed.is_main():
        distributed.barrier("toy assets")
    write_toy_assets(config)
    if distributed.is_main():
        distributed.barrier("toy assets")


def toy_data_dir(results_dir: str) -> str:
    """Where a toy run writes its data sets (one folder per task)."""
    return os.path.join(results_dir, "toy", "data")


def toy_model_dir(results_dir: str) -> str:
    """Where a toy run without a model_path writes its toy model (BAGEL HF layout)."""
    return os.path.join(results_dir, "toy", "model")


def write_toy_assets(config) -> None:
    data_dir = toy_data_dir(config.results_dir)
    tasks = toy_data.tasks_for([spec["name"] for spec in config.data.datasets])
    if not all(os.path.isdir(os.path.join(data_dir, task)) for task in tasks):
        print(f"writing the toy data set to {data_dir}")
        toy_data.write_toy_data(data_dir, seed=config.global_seed, tasks=tasks)
    with config.unlocked():
        config.data.datasets = [
            dict(spec, path=os.path.join(data_dir, spec["name"])) for spec in config.data.datasets
        ]
    if not config.model_path:
        model_dir = toy_model_dir(config.results_dir)
        if not os.path.isfile(os.path.join(model_dir, "llm_config.json")):
            print(f"writing the toy model (BAGEL layout) to {model_dir}")
            corpus = toy_data.toy_corpus_text(seed=config.global_seed, tasks=tasks).splitlines()
            toy_model.write_toy_model(model_dir, seed=config.global_seed, corpus=corpus)
        with config.unlocked():
            config.model_path = model_dir
