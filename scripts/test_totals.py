"""Adds up the JUnit XML reports of `make test-all`'s groups into one closing line: `test-all: N passed, N failed,
N skipped` (failed counts errors too). Exits 1 when a report is missing or names no test, so a group that silently
ran nothing is a failure."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def totals(report: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) of one pytest JUnit report."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = failed = skipped = 0
    for suite in suites:
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def main(paths: list[str]) -> int:
    passed = failed = skipped = 0
    status = 0
    for name in paths:
        path = Path(name)
        if not path.is_file():
            print(f"test-all: no report {path}: that group did not run", file=sys.stderr)
            status = 1
            continue
        p, f, s = totals(path)
        print(f"{path.stem}: {p} passed, {f} failed, {s} skipped")
        if p + f + s == 0:
            print(f"test-all: {path.stem} ran no test", file=sys.stderr)
            status = 1
        passed, failed, skipped = passed + p, failed + f, skipped + s
    print(f"test-all: {passed} passed, {failed} failed, {skipped} skipped")
    return status or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
