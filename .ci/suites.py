"""One line per test suite (tests/<suite>/) of what ran and what was skipped, from the summaries the
test runs wrote (tests/conftest.py, TOKENFLEET_TEST_SUMMARY); exits 1 when a suite failed, or when
one that must run here ran nothing (a green CI that skipped its tests would prove nothing).

    python .ci/suites.py SUMMARY.json [SUMMARY.json ...]   later files override earlier ones per suite
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def main(paths: list[str]) -> int:
    suites: dict[str, dict] = {}
    for path in paths:
        if not Path(path).exists():
            print(f"no test summary at {path}: that run did not finish")
            return 1
        for name, counts in json.loads(Path(path).read_text()).items():
            # a suite a later run is for (vLLM's, in its venv) replaces the main run's skip of it
            if name not in suites or counts["passed"] or counts["failed"]:
                suites[name] = counts
    required = sorted(d.name for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py")))
    rc = 0
    for name in sorted(set(required) | set(suites)):
        counts = suites.get(name, {"passed": 0, "failed": 0, "skipped": 0, "skips": {}})
        skips = "; ".join(f"{n}x {reason[:100]}" for reason, n in counts["skips"].items())
        verdict = "ok"
        if counts["failed"]:
            verdict, rc = "FAILED", 1
        elif name in required and not counts["passed"]:
            verdict, rc = "RAN NOTHING", 1
        line = f"suite {name:<13} {verdict:<12} {counts['passed']} passed, {counts['failed']} failed, "
        print(line + f"{counts['skipped']} skipped" + (f" ({skips})" if skips else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
