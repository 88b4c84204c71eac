"""What a run did, on one screen: held-out accuracy over the run and a PNG of it beside the loss.

train.py records every held-out evaluation (the starting weights at step 0, then every
`eval_every` steps) and every logged step's losses here; at the end it prints `lines()` and
writes `plot()` to `<results_dir>/summary.png`. Both contexts are the student's weights: without
the visual thought (student context, what distillation should raise) and with it (teacher
context, what the teacher sees).

A resumed run starts with what the run did before it (`add_history`), read back from the files
every evaluation and logged step left in the results directory, up to the step it resumed at:
its summary is the whole run's, from step 0. Evaluations and losses the interrupted run logged
after its last complete checkpoint are left out: the resumed run trains those steps again and
logs its own (a file written twice holds the later one, the one of the training that goes on).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

from opsd_jax.io import disk_errors
from opsd_jax.training.metrics import METRICS_FILE

CONTEXT_NAMES = {"student": "no VT (student)", "teacher": "with VT (teacher context)"}
LOSS_KEYS = ("loss", "jsd", "ce", "kd")  # drawn when logged; 'loss' alone where it equals one
EVAL_DIR = "eval"  # under results_dir: each evaluation's files (evaluate.save_results)

log = logging.getLogger(__name__)


def eval_name(step: int, context: str) -> str:
    """The name of one evaluation's files in EVAL_DIR (`<name>_summary.json`, ...)."""
    return f"step{step}_{context}"


_EVAL_SUMMARY = re.compile(r"step(\d+)_([a-z]+)_summary\.json")


@dataclasses.dataclass
class RunSummary:
    # step -> context -> (accuracy, number of held-out samples)
    evals: dict[int, dict[str, tuple[float, int]]] = dataclasses.field(default_factory=dict)
    # loss key -> [(step, value)] at every logged step
    losses: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    # one held-out record of the latest student-context evaluation (question, generation, ...)
    example: dict[str, Any] | None = None
    example_step: int | None = None

    def add_eval(self, step: int, context: str, summary: dict, records: list[dict]) -> None:
        overall = summary["overall"]
        self.evals.setdefault(step, {})[context] = (
            float(overall["accuracy"]),
            int(overall["num_samples"]),
        )
        if context == "student" and records:
            # The first sample answered right, else the first: what the student writes now.
            self.example = next((r for r in records if r["correct"]), records[0])
            self.example_step = step

    def add_logged(self, step: int, record: dict[str, float]) -> None:
        for key in LOSS_KEYS:
            if key in record:
                self.losses.setdefault(key, []).append((step, float(record[key])))

    def add_history(self, results_dir: str, up_to_step: int) -> None:
        """What the run logged in `results_dir` at steps <= `up_to_step` (the step a resumed run
        starts from): its evaluations (EVAL_DIR) and logged losses (METRICS_FILE); a step
        logged twice counts once, as logged last. Call it before this run adds its own."""
        evals = {}  # step -> context -> its summary file
        eval_dir = os.path.join(results_dir, EVAL_DIR)
        for name in sorted(os.listdir(eval_dir)) if os.path.isdir(eval_dir) else []:
            match = _EVAL_SUMMARY.fullmatch(name)
            if match and int(match.group(1)) <= up_to_step and match.group(2) in CONTEXT_NAMES:
                evals.setdefault(int(match.group(1)), {})[match.group(2)] = os.path.join(
                    eval_dir, name
                )
        newest_student = max((s for s in evals if "student" in evals[s]), default=None)
        for step in sorted(evals):
            for context, path in evals[step].items():
                summary = _eval_summary(path)
                if summary is None:
                    continue
                records = []  # the newest no-VT answers: the example, until this run has its own
                if context == "student" and step == newest_student:
                    generations = path.removesuffix("_summary.json") + "_generations.jsonl"
                    records = [r for r in _read_jsonl(generations) if "correct" in r]
                self.add_eval(step, context, summary, records)
        logged = {}  # step -> its record, the last one logged
        for record in _read_jsonl(os.path.join(results_dir, METRICS_FILE)):
            step = record.get("step")
            if isinstance(step, int) and step <= up_to_step:
                logged[step] = record
        for step in sorted(logged):
            self.add_logged(step, logged[step])

    def first_step(self) -> int | None:
        """The first step with an evaluation or a logged loss (None: nothing recorded)."""
        steps = list(self.evals) + [s for points in self.losses.values() for s, _ in points]
        return min(steps, default=None)

    def contexts(self) -> list[str]:
        seen = {c for by_context in self.evals.values() for c in by_context}
        return [c for c in CONTEXT_NAMES if c in seen]

    def lines(self, chance: float | None = None) -> list[str]:
        """The accuracy table, the change of the no-VT accuracy, one held-out answer."""
        if not self.evals:
            return []
        contexts, steps = self.contexts(), sorted(self.evals)
        sizes = {n for by_context in self.evals.values() for _, n in by_context.values()}
        size_text = "/".join(str(n) for n in sorted(sizes))
        chance_text = f", chance {chance:.0%}" if chance is not None else ""
        widths = [max(len(CONTEXT_NAMES[c]), 6) for c in contexts]
        out = [
            f"held-out accuracy ({size_text} samples, greedy{chance_text}):",
            "  step | " + " | ".join(f"{CONTEXT_NAMES[c]:>{w}}" for c, w in zip(contexts, widths)),
        ]
        for step in steps:
            cells = []
            for context, width in zip(contexts, widths):
                value = self.evals[step].get(context)
                cells.append(f"{value[0]:>{width}.1%}" if value else f"{'-':>{width}}")
            out.append(f"  {step:>4} | " + " | ".join(cells))
        student = [(s, self.evals[s]["student"][0]) for s in steps if "student" in self.evals[s]]
        if len(student) > 1:
            (first_step, first), (last_step, last) = student[0], student[-1]
            best_step, best = max(student, key=lambda point: point[1])
            out.append(
                f"  no VT: {first:.1%} at step {first_step} -> {last:.1%} at step "
                f"{last_step} ({100 * (last - first):+.1f} points; best {best:.1%} at "
                f"step {best_step})"
            )
        if self.example is not None:
            verdict = "right" if self.example["correct"] else "wrong"
            out.append(
                f"  a held-out answer without VT (step {self.example_step}, {verdict}; "
                f"reference {self.example['reference']!r}): "
                f"{self.example['generation']!r}"
            )
        return out

    def plot(self, path: str, title: str, chance: float | None = None) -> None:
        """Accuracy (both contexts) and the losses against the step, one PNG."""
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt

        figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        steps = sorted(self.evals)
        for context, style in zip(self.contexts(), ("o-", "s--")):
            points = [(s, self.evals[s][context][0]) for s in steps if context in self.evals[s]]
            left.plot(
                [s for s, _ in points],
                [100 * a for _, a in points],
                style,
                label=CONTEXT_NAMES[context],
            )
        if chance is not None:
            left.axhline(100 * chance, color="gray", linestyle=":", label=f"chance {chance:.0%}")
        left.set(
            xlabel="step",
            ylabel="held-out accuracy (%)",
            ylim=(0, 102),
            title="held-out exact match (greedy)",
        )
        left.grid(alpha=0.3)
        if left.get_legend_handles_labels()[1]:  # a run without evaluations draws no line here
            left.legend(fontsize="small", loc="lower right")  # the with-VT line runs along the top
        drawn = self.loss_lines()
        for key, points in drawn.items():
            right.plot([s for s, _ in points], [v for _, v in points], label=key)
        right.set(xlabel="step", title="training loss (logged steps)")
        right.grid(alpha=0.3)
        if drawn:
            right.legend(fontsize="small")
        figure.suptitle(title)
        figure.tight_layout()
        with disk_errors.naming(path):
            figure.savefig(path, dpi=100)
        plt.close(figure)

    def loss_lines(self) -> dict[str, list[tuple[int, float]]]:
        """The logged losses, 'loss' left out where it is one of the others (OPSD without CE:
        loss = jsd), so no line is drawn twice."""
        lines = dict(self.losses)
        total = lines.get("loss")
        for key in LOSS_KEYS[1:]:
            if total is not None and lines.get(key) == total:
                lines[f"{key} (= loss)"] = lines.pop(key)
                lines.pop("loss", None)
                break
        return lines


def _eval_summary(path: str) -> dict | None:
    """An evaluation's summary file (evaluate.save_results), or None with a warning when it
    cannot be read: the closing summary is not worth stopping a run for."""
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        float(summary["overall"]["accuracy"]), int(summary["overall"]["num_samples"])  # add_eval's
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s: not read for the run's summary (%s)", path, e)
        return None
    return summary


def _read_jsonl(path: str) -> list[dict]:
    """The JSON objects of a JSON-lines file ([] if there is none); a line that does not parse
    (the last one, cut short by a kill) is left out."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records
