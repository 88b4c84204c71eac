"""The run's end: the checkpoints and logs closed, then its closing lines (the data used and
skipped, where the checkpoints and logs are, the accuracy summary and its plot, what to run
next). A run stopped by a signal ends here too, after its checkpoint."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax

from opsd_jax.evaluation.run_summary import RunSummary
from opsd_jax.parallel import device_memory, distributed
from opsd_jax.toy import tasks as toy_tasks


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """How a run ended: its closing lines come from here."""

    first_step: int  # where this run started (0, or the step it resumed at)
    last_step: int  # where it ended: total_steps, or the step a signal stopped it after
    stopped: bool  # stopped early by a signal (a checkpoint of last_step was saved)
    samples_used: int  # over all processes
    skipped_rows: dict  # reason -> rows the data pipeline skipped

    def lines(self, config, checkpoint_dir: str, summary: RunSummary) -> list[str]:
        skipped = ", ".join(f"{r} {n}" for r, n in self.skipped_rows.items()) or "none"
        lines = [f"data: {self.samples_used} samples used; skipped rows: {skipped}"]
        if not self.stopped:
            lines.append(
                f"done: {config.total_steps} steps; checkpoints in {checkpoint_dir}, "
                f"logs in {config.results_dir}"
            )
        return lines + list(summary.lines(chance_of(config)))


def chance_of(config) -> float | None:
    """The toy tasks' chance accuracy (a toy run's summary shows it), else None."""
    if not config.toy_data:
        return None
    return toy_tasks.chance_accuracy([s["name"] for s in config.data.datasets])


def next_commands(config, checkpoint_dir: str) -> str:
    """What a user runs on a finished (or stopped) run: evaluate, plot, export."""
    run, quote = config.results_dir, lambda path: path if " " not in path else f"'{path}'"  # noqa: E731
    lines = [
        f"python scripts/evaluate.py --checkpoint {quote(run)}    # held-out accuracy, no VT",
        f"python scripts/evaluate.py --checkpoint {quote(run)} --context teacher    # with VT",
        f"python scripts/plot_run.py {quote(run)}    # curves -> {os.path.join(run, 'plots')}",
    ]
    if config.model_path:
        lines.append(
            f"python scripts/convert_hf.py jax-to-hf --ckpt {quote(checkpoint_dir)} "
            f"--source {quote(config.model_path)} --out "
            f"{quote(os.path.join(run, 'hf'))}    # the BAGEL HF layout"
        )
    return "next:\n  " + "\n  ".join(lines)


def close_run(
    config,
    checkpoint_dir: str,
    checkpointer,
    logger,
    data_state: dict,
    summary: RunSummary,
    end_steps: tuple[int, int | None],
    cache: tuple,
    say: Callable,
) -> RunEnd:
    """Wait for the last save, close the checkpoints and logs, and say the closing lines.
    `data_state`: this process's data iterator state after the last step trained (its samples
    and skipped rows: DataIterator.get_state); `end_steps`: (the first step, the step a signal
    stopped the run after, or None); `cache`: (the compilation cache directory or None, its
    CacheCounter)."""
    (start_step, stopped_at), (cache_dir, cache_counter) = end_steps, cache
    checkpointer.wait_until_finished()
    checkpointer.close()
    logger.close()
    skipped = data_state["skipped"]
    counts = distributed.all_processes([data_state["num_yielded"], *skipped.values()]).sum(axis=0)
    end = RunEnd(
        first_step=start_step,
        last_step=stopped_at or config.total_steps,
        stopped=stopped_at is not None,
        samples_used=int(counts[0]),
        skipped_rows={r: int(n) for r, n in zip(skipped, counts[1:]) if n},
    )
    if cache_dir:
        say(cache_counter.describe(cache_dir))
    peak = device_memory.allocator_peak()
    if peak is not None:  # a GPU's allocator (bench/gpu_check.py reads this line)
        say(
            f"device memory: peak {peak[0] / 2**30:.2f} GiB in use of {peak[1] / 2**30:.2f} GiB "
            f"on {jax.local_devices()[0].device_kind}"
        )
    for line in end.lines(config, checkpoint_dir, summary):
        say(line)
    if distributed.is_main() and (summary.evals or summary.losses):
        png = os.path.join(config.results_dir, "summary.png")
        recorded_from = summary.first_step()  # a resumed run's: its earlier launches' first
        first = end.first_step if recorded_from is None else min(end.first_step, recorded_from)
        summary.plot(
            png,
            title=f"{config.results_dir}: {config.mode}, steps {first}..{end.last_step}",
            chance=chance_of(config),
        )
        say(f"accuracy and loss over the steps: {png}")
    say(next_commands(config, checkpoint_dir))
    return end
