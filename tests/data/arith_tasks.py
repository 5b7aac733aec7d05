"""Helpers of the local lm-eval tasks in this folder (arith_gen.yaml, arith_mc.yaml): the
demo model's addition task (benchmarks/arith.py) as lm-eval data, with no network.

The JSONL files are written by `python -m tests.data.arith_tasks` (deterministic); the YAMLs
load them through `custom_dataset`, so the path does not depend on the working directory.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GEN_FILE, MC_FILE = HERE / "arith_gen.jsonl", HERE / "arith_mc.jsonl"


def _load(path: Path):
    import datasets
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_gen(**_metadata):
    """custom_dataset of arith_gen.yaml (lm-eval passes the model args as keywords)."""
    return _load(GEN_FILE)


def load_mc(**_metadata):
    return _load(MC_FILE)


def process_gen(doc: dict, results: list[str]) -> dict:
    """The demo task's own check (benchmarks/arith.py), so the score is accuracy.py's."""
    from benchmarks import arith
    return {"acc": float(arith.check(doc["a"], doc["b"], results[0]))}


def _bump_last_digit(text: str) -> str:
    return text[:-1] + str((int(text[-1]) + 1) % 10)


def mc_choices(a: int, b: int) -> list[str]:
    """The worked answer and three of the same length that are wrong in one place: the
    sum's last digit, the first column's total, the sum's first digit."""
    from benchmarks import arith
    right = arith.answer_text(a, b)
    steps, total = right.rsplit("#", 1)
    first, rest = steps.split("c", 1)
    wrong_sum = f"{steps}#{_bump_last_digit(total)}"
    wrong_step = f"{_bump_last_digit(first)}c{rest}#{total}"
    lead = str((int(total[0]) % 9) + 1) if len(total) > 1 else str((int(total) + 5) % 10)
    wrong_lead = f"{steps}#{lead}{total[1:]}"
    return [right, wrong_sum, wrong_step, wrong_lead]


def write_data(n_gen: int = 12, n_mc: int = 8) -> None:
    from benchmarks import arith
    gen = [{"a": a, "b": b, "prompt": arith.prompt_text(a, b), "sum": str(a + b)}
           for a, b in arith.sample("test", n_gen, seed=19)]
    mc = []
    # Three-digit problems: every request falls in one length bucket (one compilation).
    problems = [(a, b) for a, b in arith.sample("test", 200, seed=20) if max(a, b) >= 100
                and max(a, b) < 1000][:n_mc]
    for i, (a, b) in enumerate(problems):
        # The right answer rotates through the slots: a scorer that ties everything (argmax
        # takes the first) or favours one slot cannot score well.
        label = (i + 1) % 4
        choices = mc_choices(a, b)
        choices = choices[-label:] + choices[:-label] if label else choices
        mc.append({"a": a, "b": b, "prompt": arith.prompt_text(a, b), "choices": choices,
                   "label": label})
    for path, rows in ((GEN_FILE, gen), (MC_FILE, mc)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    write_data()
