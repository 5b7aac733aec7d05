"""RESULTS.md against benchmarks/results/: every cited file exists and every file is cited.

    python -m benchmarks.check_results

A result counts as cited by its full name, by its short form `-HHMMSS.json` (RESULTS.md
writes "`-222233.json`" after the full name of a sibling) or by a `results/...*...` pattern
(the logs of one run, `chain-...-run2-train-*.log`), which must match at least one file. Exits 1 and lists what is missing;
the figures themselves are checked by reading them against the files.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent


def problems(results_md: str, names: list[str]) -> list[str]:
    """Lines describing cited-but-missing and present-but-uncited result files."""
    cited = set(re.findall(r"results/([\w.\-]+\.(?:json|log))(?![\w*])", results_md))
    patterns = set(re.findall(r"results/([\w.\-]*\*[\w.\-*]*)", results_md))
    out = [f"cited but missing: results/{n}" for n in sorted(cited - set(names))]
    out += [f"cited but missing: results/{p}" for p in sorted(patterns)
            if not fnmatch.filter(names, p)]
    for n in sorted(names):
        short = re.search(r"(-\d{6}\.json)$", n)
        if n in results_md or (short and short.group(1) in results_md) \
                or any(fnmatch.fnmatch(n, p) for p in patterns):
            continue
        out.append(f"not cited: results/{n}")
    return out


def repository_problems() -> list[str]:
    """`problems` of this directory's RESULTS.md and results/."""
    names = [p.name for p in (HERE / "results").iterdir() if p.suffix in (".json", ".log")]
    return problems((HERE / "RESULTS.md").read_text(), names)


def main() -> int:
    found = repository_problems()
    print("\n".join(found) or "every cited file exists and every file is cited")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
