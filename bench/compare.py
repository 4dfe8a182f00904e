"""``make bench-compare BEFORE=DIR``: the hot path of two checkouts, side by side.

Runs the throughput rows of ``make bench`` (the C load generator, server on core 0
and generator on core 1) against the server of another checkout (``--before``, a
directory holding the ``elockd`` package, e.g. a ``git worktree`` of the commit to
compare with) and of this one, alternating, ``--rounds`` times each, and prints the
median requests/s of each and their ratio. Both run on this interpreter, so only
the code differs. Redis, when installed, runs in the same rounds as the yardstick.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as bench


@contextlib.contextmanager
def code_of(tree: Path) -> Iterator[None]:
    """Servers started in this block import ``elockd`` from ``tree``."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout to compare with")
    parser.add_argument("--after", type=Path, default=bench.ROOT, help="default: this one")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per row")
    parser.add_argument(
        "--loadgen-src", type=Path, default=bench.ROOT.parent / "shared" / "tools" / "lockbench"
    )
    options = parser.parse_args()
    for tree in (options.before, options.after):
        if not (tree / "elockd" / "__init__.py").exists():
            raise SystemExit(f"--before/--after {tree}: no elockd package there")
    loadgen = bench.build_loadgen(options.loadgen_src)
    have_redis = shutil.which("redis-server") is not None
    print(f"# before {options.before}, after {options.after}")
    print(f"# {options.rounds} alternating runs of {options.seconds:g} s per row; medians")
    print("| row | before req/s | after req/s | after/before | Redis req/s |")
    print("|---|---|---|---|---|")
    for name, args in bench.THROUGHPUT_ROWS:
        results: dict[str, list[float]] = {"before": [], "after": [], "redis": []}
        for _ in range(options.rounds):
            for label, tree in (("before", options.before), ("after", options.after)):
                port = bench.free_port()
                with code_of(tree), bench.running(bench.elockd_command(port), port) as server:
                    result = bench.run_loadgen(
                        loadgen, "lockd", port, server.pid, options.seconds, *args
                    )
                results[label].append(result.rps)
            if have_redis:
                port = bench.free_port()
                with bench.running(bench.redis_command(port), port) as redis:
                    result = bench.run_loadgen(
                        loadgen, "redis", port, redis.pid, options.seconds, *args
                    )
                results["redis"].append(result.rps)
        before, after = (statistics.median(results[k]) for k in ("before", "after"))
        redis = f"{statistics.median(results['redis']):,.0f}" if results["redis"] else "-"
        runs = ", ".join(
            f"{b:,.0f}/{a:,.0f}" for b, a in zip(results["before"], results["after"], strict=True)
        )
        print(
            f"| {name} | {before:,.0f} | {after:,.0f} | {after / before:.2f}x | {redis} |",
            flush=True,
        )
        print(f"<!-- runs before/after: {runs} -->", flush=True)


if __name__ == "__main__":
    main()
