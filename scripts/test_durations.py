"""Where the suite's time goes: the seconds of each test tier, file and test, from a saved ``make test`` log run with
``PYTEST_ARGS=--durations=0`` (docs/development.md, "The test-time budget").

    make test PYTEST_ARGS=--durations=0 2>&1 | tee test.log
    .venv/bin/python scripts/test_durations.py test.log --top 25

A test's seconds are its setup, call and teardown as pytest reports them, each timed beside the other worker's
tests; a tier's figure is the sum over its tests (on two workers the wall time is about half of it). Tiers: ``unit``
(``tests/unit``), ``slurm`` (a test of ``tests/system`` that ran in the Slurm group: its node id ends in ``@slurm``),
``system`` (the rest).
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(.+)$", re.M)


def tier(node: str) -> str:
    if node.startswith("tests/unit/"):
        return "unit"
    return "slurm" if node.endswith("@slurm") else "system"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="the output of a pytest run with --durations=0")
    parser.add_argument("--top", type=int, default=25, help="the slowest tests and files listed")
    args = parser.parse_args(argv)
    tests: dict[str, float] = collections.defaultdict(float)
    for seconds, node in LINE.findall(args.log.read_text(errors="replace")):
        tests[node.strip()] += float(seconds)
    if not tests:
        parser.error(f"{args.log} holds no durations: run the tests with PYTEST_ARGS=--durations=0")
    tiers: dict[str, list[float]] = collections.defaultdict(list)
    files: dict[str, list[float]] = collections.defaultdict(list)
    for node, seconds in tests.items():
        tiers[tier(node)].append(seconds)
        files[node.split("::")[0]].append(seconds)
    print("| tier | tests | seconds (sum) |\n| --- | --- | --- |")
    for name in ("unit", "system", "slurm"):
        print(f"| {name} | {len(tiers[name])} | {sum(tiers[name]):.0f} |")
    print(f"| all | {len(tests)} | {sum(tests.values()):.0f} |")
    print("\n| file | tests | seconds (sum) |\n| --- | --- | --- |")
    for path, times in sorted(files.items(), key=lambda item: -sum(item[1]))[: args.top]:
        print(f"| {path} | {len(times)} | {sum(times):.0f} |")
    print("\n| test | seconds |\n| --- | --- |")
    for node, seconds in sorted(tests.items(), key=lambda item: -item[1])[: args.top]:
        print(f"| {node} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
