#!/usr/bin/env python3
"""An example worker pool that never has more than ``--limit`` calls to a partner API
in flight, nor makes more than ``--rate COUNT/PERIOD`` of them, counted across every
process on every machine that uses the same key.

Each call takes a slot of ``RateLimiter(key, limit, rate=(COUNT, PERIOD))`` for
exactly as long as the call runs: first its turn of the rate (``throttle`` on elockd,
waiting in line, first come first served), then one of the ``limit`` places (a shared
lock with a limit). Give either flag, or both. Start it several times, on several
machines: together they still stay under both.

    python contrib/rate_limited_worker.py --limit 3 --workers 10 --jobs 40
    python contrib/rate_limited_worker.py --rate 20/1s --burst 5 --jobs 40
    python contrib/rate_limited_worker.py --limit 3 --rate 100/1m --jobs 40
    python contrib/rate_limited_worker.py --threads ...   # the blocking client
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import trio

from elockd.client import BlockingRateLimiter, RateLimiter
from elockd.ctl.args import rate


class Meter:
    """Counts calls in flight in this process, to show the limit holding."""

    def __init__(self) -> None:
        self.active = self.peak = self.done = 0
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)

    def leave(self) -> None:
        with self.lock:
            self.active -= 1
            self.done += 1


async def run_trio(args: argparse.Namespace, meter: Meter) -> None:
    remaining = args.jobs  # the queue of work

    async def worker() -> None:
        nonlocal remaining
        while remaining:
            remaining -= 1
            async with limiter.slot():
                meter.enter()
                await trio.sleep(random.uniform(0.5, 1.5) * args.call_time)  # the API call
                meter.leave()

    async with (
        RateLimiter(args.key, args.limit, **limiter_options(args)) as limiter,
        trio.open_nursery() as nursery,
    ):
        for _ in range(args.workers):
            nursery.start_soon(worker)


def run_threads(args: argparse.Namespace, meter: Meter) -> None:
    remaining = [args.jobs]
    queue_lock = threading.Lock()

    def take_job() -> bool:
        with queue_lock:
            if remaining[0] == 0:
                return False
            remaining[0] -= 1
            return True

    def worker() -> None:
        while take_job():
            with limiter.slot():
                meter.enter()
                time.sleep(random.uniform(0.5, 1.5) * args.call_time)  # the API call
                meter.leave()

    with BlockingRateLimiter(args.key, args.limit, **limiter_options(args)) as limiter:
        threads = [threading.Thread(target=worker) for _ in range(args.workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def limiter_options(args: argparse.Namespace) -> dict[str, object]:
    """The limiter's settings besides key and limit: the rate, if any, and where."""
    options: dict[str, object] = {"host": args.host, "port": args.port, "wait": args.wait}
    if args.rate is not None:
        options.update(rate=args.rate, burst=args.burst)
    return options


def summary(args: argparse.Namespace, meter: Meter, elapsed: float) -> str:
    limit = f"limit {args.limit}" if args.limit is not None else "no limit"
    line = f"{meter.done} calls, at most {meter.peak} in flight ({limit})"
    if args.rate is not None:
        count, period = args.rate
        burst = args.burst or count
        line += f", in {elapsed:.2f} s (rate {count} per {period:g} s, burst {burst})"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9999)
    parser.add_argument("--key", default="partner-api", help="one key per rate-limited API")
    parser.add_argument(
        "--limit", type=int, help="calls in flight, everywhere (default: 3 without --rate)"
    )
    parser.add_argument(
        "--rate", type=rate, metavar="COUNT/PERIOD", help="calls begun, everywhere (100/1m)"
    )
    parser.add_argument("--burst", type=int, help="with --rate: at most this many at once")
    parser.add_argument("--workers", type=int, default=10, help="workers in this process")
    parser.add_argument("--jobs", type=int, default=40, help="calls to make in total")
    parser.add_argument("--call-time", type=float, default=0.2, help="mean seconds per call")
    parser.add_argument("--wait", type=float, default=60.0, help="longest wait for a slot")
    parser.add_argument("--threads", action="store_true", help="threads + blocking client")
    args = parser.parse_args()
    if args.burst is not None and args.rate is None:
        parser.error("--burst needs --rate")
    if args.limit is None and args.rate is None:
        args.limit = 3
    meter = Meter()
    started = time.monotonic()
    if args.threads:
        run_threads(args, meter)
    else:
        trio.run(run_trio, args, meter)
    print(summary(args, meter, time.monotonic() - started))


if __name__ == "__main__":
    main()
