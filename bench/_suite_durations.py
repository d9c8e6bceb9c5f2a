"""The test suite's time per file, from the junit report `make test` writes (runs/test-report.xml).

    python bench/_suite_durations.py runs/test-report.xml   # a Markdown table, slowest file first

Kept in bench/RESULTS.md so the 45-minute budget of `make test` on 2 cores stays visible as tests are added.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET  # our own pytest report, not untrusted input
from collections import defaultdict
from pathlib import Path


def per_file(report: Path) -> dict[str, tuple[float, int]]:
    """{test file: (seconds, number of tests)} from a pytest junit XML report."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "?").split("::")[0]
        parts = path.split(".")
        name = "/".join(p for p in parts if not p[:1].isupper()) + ".py"  # tests.driver.test_x[.Class]
        totals[name][0] += float(case.get("time", 0.0))
        totals[name][1] += 1
    return {k: (v[0], int(v[1])) for k, v in totals.items()}


def table(totals: dict[str, tuple[float, int]]) -> str:
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    total = sum(s for s, _ in totals.values())
    lines = ["| test file | tests | time | share |", "|---|---|---|---|"]
    lines += [f"| {f} | {n} | {s:.0f} s | {s / total:.0%} |" for f, (s, n) in rows]
    lines.append(f"| **total** | {sum(n for _, n in totals.values())} | **{total / 60:.1f} min** | |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(per_file(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/test-report.xml"))))
