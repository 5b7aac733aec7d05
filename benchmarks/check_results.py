"""RESULTS.md against benchmarks/results/: every cited file exists and every file is cited.

    python -m benchmarks.check_results

A result counts as cited by its full name or by its short form `-HHMMSS.json` (RESULTS.md
writes "`-222233.json`" after the full name of a sibling). Exits 1 and lists what is missing;
the figures themselves are checked by reading them against the files.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).parent


def problems(results_md: str, names: list[str]) -> list[str]:
    """Lines describing cited-but-missing and present-but-uncited result files."""
    cited = set(re.findall(r"results/([\w.\-]+\.(?:json|log))", results_md))
    out = [f"cited but missing: results/{n}" for n in sorted(cited - set(names))]
    for n in sorted(names):
        short = re.search(r"(-\d{6}\.json)$", n)
        if n in results_md or (short and short.group(1) in results_md):
            continue
        out.append(f"not cited: results/{n}")
    return out


def main() -> int:
    names = [p.name for p in (HERE / "results").iterdir() if p.suffix in (".json", ".log")]
    found = problems((HERE / "RESULTS.md").read_text(), names)
    print("\n".join(found) or "every cited file exists and every file is cited")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
