"""benchmarks/RESULTS.md against the files committed beside it: a figure cited from a log or
JSON that was never committed passes locally (the file is on disk) and only a clean clone,
as CI runs, shows it missing (the thirty-ninth session's first commit of its results did so)."""

from __future__ import annotations

from benchmarks import check_results


def test_every_cited_result_is_in_the_repository():
    assert check_results.repository_problems() == []


def test_a_missing_or_uncited_file_is_reported():
    md = "see `results/run-20261206-s39call1.log` and `results/generate-20261206-172507.json`"
    assert check_results.problems(md, ["generate-20261206-172507.json", "extra.log"]) == [
        "cited but missing: results/run-20261206-s39call1.log",
        "not cited: results/extra.log"]
