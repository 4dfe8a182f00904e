"""``make bench-compare BEFORE=DIR``: the hot path of two checkouts, side by side.

Runs the throughput rows of ``make bench`` (the C load generator, server on core 0
and generator on core 1) against the server of another checkout (``--before``, a
directory holding the ``elockd`` package, e.g. a ``git worktree`` of the commit to
compare with, or a commit of this repository, whose ``elockd`` folder is extracted
into ``bench/.build/trees/``) and of this one, alternating, ``--rounds`` times each,
and prints the median requests/s of each and their ratio. Both run on this
interpreter, so only the code differs. Redis, when installed, runs in the same
rounds as the yardstick.

``--rows`` adds the hold row (bytes per held lock, ``--hold-rounds`` times per
checkout) and the burst row (an established client's worst round trip while 10,000
connections arrive). ``--min-ratio`` and ``--max-bytes-rise`` turn the comparison
into a guard (``make bench-guard``): it ends with exit status 1 and one line per
breach when a throughput median falls below the ratio or bytes per lock rise more
than the fraction.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as bench

TREES = bench.BUILD / "trees"


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


def checkout(where: str) -> Path:
    """A directory holding an ``elockd`` package: ``where`` itself, or the ``elockd``
    folder of the commit ``where`` names, extracted once with ``git archive``."""
    if Path(where).is_dir():
        return Path(where).resolve()
    named = subprocess.run(
        ["git", "-C", str(bench.ROOT), "rev-parse", "--verify", "--quiet", where + "^{commit}"],
        capture_output=True,
        text=True,
    )
    if named.returncode != 0:
        raise SystemExit(f"--before {where}: neither a directory nor a commit of this repository")
    commit = named.stdout.strip()
    tree = TREES / commit[:12]
    if not (tree / "elockd" / "__init__.py").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(bench.ROOT), "archive", commit, "elockd"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def imported_from(tree: Path) -> Path:
    """Where a server started with ``tree`` on its path finds ``elockd`` (an
    installed copy must not win over the checkout)."""
    with code_of(tree):
        found = subprocess.run(
            [sys.executable, "-P", "-c", "import elockd; print(elockd.__file__)"],
            capture_output=True,
            text=True,
            check=True,
        )
    return Path(found.stdout.strip()).resolve().parent.parent


def throughput(
    trees: dict[str, Path], loadgen: Path, seconds: float, rounds: int
) -> dict[str, float]:
    """The throughput table; returns each row's after/before ratio of medians."""
    have_redis = shutil.which("redis-server") is not None
    print("| row | before req/s | after req/s | after/before | Redis req/s |")
    print("|---|---|---|---|---|")
    ratios = {}
    for name, args in bench.THROUGHPUT_ROWS:
        results: dict[str, list[float]] = {"before": [], "after": [], "redis": []}
        for _ in range(rounds):
            for label, tree in trees.items():
                port = bench.free_port()
                with code_of(tree), bench.running(bench.elockd_command(port), port) as server:
                    result = bench.run_loadgen(loadgen, "lockd", port, server.pid, seconds, *args)
                results[label].append(result.rps)
            if have_redis:
                port = bench.free_port()
                with bench.running(bench.redis_command(port), port) as redis:
                    result = bench.run_loadgen(loadgen, "redis", port, redis.pid, seconds, *args)
                results["redis"].append(result.rps)
        before, after = (statistics.median(results[k]) for k in ("before", "after"))
        ratios[name] = after / before
        redis = f"{statistics.median(results['redis']):,.0f}" if results["redis"] else "-"
        runs = ", ".join(
            f"{b:,.0f}/{a:,.0f}" for b, a in zip(results["before"], results["after"], strict=True)
        )
        print(
            f"| {name} | {before:,.0f} | {after:,.0f} | {after / before:.2f}x | {redis} |",
            flush=True,
        )
        print(f"<!-- runs before/after: {runs} -->", flush=True)
    return ratios


def hold(trees: dict[str, Path], rounds: int, conns: int, locks: int) -> dict[str, float]:
    """bench/run.py's hold row on each checkout in turn; the median bytes per lock."""
    values: dict[str, list[float]] = {label: [] for label in trees}
    for _ in range(rounds):
        for label, tree in trees.items():
            port = bench.free_port()
            with code_of(tree), bench.running(bench.elockd_command(port), port) as server:
                row = bench.hold_row(port, server.pid, conns, locks)
            values[label].append(row["bytes_per_lock"])
    medians = {label: statistics.median(runs) for label, runs in values.items()}
    runs = "; ".join(
        f"{label} " + ", ".join(f"{value:.0f}" for value in runs) for label, runs in values.items()
    )
    print()
    print(
        f"Hold ({conns:,} connections x {locks} locks, half shared, median of {rounds}): "
        f"before {medians['before']:.0f}, after {medians['after']:.0f} bytes per lock "
        f"({medians['after'] / medians['before']:.3f}x; runs: {runs})",
        flush=True,
    )
    return medians


def burst(trees: dict[str, Path], rounds: int, conns: int) -> None:
    """bench/run.py's burst row on each checkout in turn."""
    for _ in range(rounds):
        for label, tree in trees.items():
            port = bench.free_port()
            with code_of(tree), bench.running(bench.elockd_command(port), port):
                row = bench.burst_row(port, conns)
            print()
            print(f"{label}: ", end="")
            bench.print_burst(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--before", required=True, help="checkout (directory) or commit to compare with"
    )
    parser.add_argument("--after", type=Path, default=bench.ROOT, help="default: this one")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per row")
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=["throughput", "hold", "burst"],
        default=["throughput"],
        help="which rows (default: throughput)",
    )
    parser.add_argument("--hold-rounds", type=int, default=1, help="hold row runs per checkout")
    parser.add_argument("--hold-conns", type=int, default=10_000)
    parser.add_argument("--hold-locks", type=int, default=100, help="locks per connection")
    parser.add_argument("--burst-rounds", type=int, default=1, help="burst row runs per checkout")
    parser.add_argument("--burst-conns", type=int, default=10_000)
    parser.add_argument(
        "--min-ratio",
        type=float,
        help="guard: fail when a throughput median after/before is below this",
    )
    parser.add_argument(
        "--max-bytes-rise",
        type=float,
        help="guard: fail when bytes per lock rise by more than this fraction (0.05: 5 %%)",
    )
    parser.add_argument(
        "--loadgen-src",
        type=Path,
        default=Path(
            os.environ.get("LOADGEN_SRC", bench.ROOT.parent / "shared" / "tools" / "lockbench")
        ),
        help="folder holding the load generator's one C source file ($LOADGEN_SRC)",
    )
    options = parser.parse_args()
    trees = {"before": checkout(options.before), "after": options.after.resolve()}
    for label, tree in trees.items():
        if not (tree / "elockd" / "__init__.py").exists():
            raise SystemExit(f"--{label} {tree}: no elockd package there")
        if imported_from(tree) != tree:
            raise SystemExit(f"--{label} {tree}: servers would import elockd from elsewhere")
    print(f"# before {options.before} ({trees['before']}), after {trees['after']}")
    print(f"# {options.rounds} alternating runs of {options.seconds:g} s per row; medians")
    failures = []
    if "throughput" in options.rows:
        loadgen = bench.build_loadgen(options.loadgen_src)
        ratios = throughput(trees, loadgen, options.seconds, options.rounds)
        if options.min_ratio is not None:
            failures += [
                f"{name}: {ratio:.2f}x the baseline, below {options.min_ratio:.2f}x"
                for name, ratio in ratios.items()
                if ratio < options.min_ratio
            ]
    if "hold" in options.rows:
        held = hold(trees, options.hold_rounds, options.hold_conns, options.hold_locks)
        rise = held["after"] / held["before"] - 1
        if options.max_bytes_rise is not None and rise > options.max_bytes_rise:
            failures.append(
                f"bytes per lock: {held['before']:.0f} -> {held['after']:.0f} "
                f"(+{rise:.1%}, more than {options.max_bytes_rise:.0%})"
            )
    if "burst" in options.rows:
        burst(trees, options.burst_rounds, options.burst_conns)
    if options.min_ratio is not None or options.max_bytes_rise is not None:
        print()
        for failure in failures:
            print(f"bench-guard: FAILED: {failure}")
        if failures:
            raise SystemExit(1)
        print(f"bench-guard: passed against {options.before}")


if __name__ == "__main__":
    main()
