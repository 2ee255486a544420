"""Count the battery's outcomes: ``python -m tests.reliability.count [--json out.json] [--list]``.

Run from the repository root, with the code to judge first on PYTHONPATH. Every case runs in a child
process that reports one line per case as it goes; when a child dies (a segfault), the case it was in is
counted as a crash and a new child carries on from the next case.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys

from .battery import CRASH, KINDS, run_case
from .cases import all_cases


def child(start: int) -> None:
    import warnings

    warnings.simplefilter("ignore")
    for index, case in enumerate(all_cases()[start:], start):
        try:
            outcome = run_case(case)
            kind, detail = outcome.kind, outcome.detail
        except Exception as error:  # setup itself failed: the object could not even be built
            kind, detail = "obscure", f"setup: {type(error).__name__}: {error}"
        print(json.dumps([index, kind, detail[:300]]), flush=True)


def collect() -> list[tuple[str, str, str, str]]:
    """(id, owner, kind, detail) for every case."""
    cases = all_cases()
    results: dict[int, tuple[str, str]] = {}
    start = 0
    while start < len(cases):
        proc = subprocess.run(
            [sys.executable, "-m", "tests.reliability.count", "--child", str(start)],
            capture_output=True,
            text=True,
        )
        for line in proc.stdout.splitlines():
            index, kind, detail = json.loads(line)
            results[index] = (kind, detail)
        done = max(results, default=-1) + 1
        if done < len(cases) and proc.returncode != 0:
            results[done] = (CRASH, f"child exited with {proc.returncode}")
            done += 1
        start = done
    return [(c.id, c.owner, *results[i]) for i, c in enumerate(cases)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write every case's outcome here")
    parser.add_argument("--list", action="store_true", help="print every case that is not clear")
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    rows = collect()
    counts = collections.Counter(kind for _, _, kind, _ in rows)
    by_owner: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for _, owner, kind, _ in rows:
        by_owner[owner][kind] += 1
    print("tried " + str(len(rows)) + " | " + " | ".join(f"{k} {counts[k]}" for k in KINDS))
    for owner, owner_counts in sorted(by_owner.items()):
        print(f"  {owner:<14}" + " ".join(f"{k}={owner_counts[k]}" for k in KINDS))
    if args.list:
        for case_id, owner, kind, detail in rows:
            if kind != "clear":
                print(f"{kind:<13}{owner:<14}{case_id}  ->  {detail[:160]}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                [dict(zip(("id", "owner", "kind", "detail"), r, strict=True)) for r in rows], handle, indent=1
            )


if __name__ == "__main__":
    main()
