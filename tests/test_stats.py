"""The plain-int histogram behind /metrics: a batch observes exactly what one-by-one does."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elockd.observe.logthrottle import LogThrottle
from elockd.protocol.stats import HOLD_BUCKETS, Buckets

durations = st.lists(
    st.one_of(st.sampled_from(HOLD_BUCKETS), st.floats(min_value=0, max_value=2e5)), max_size=60
)


@given(durations)
def test_observe_many_counts_like_observe(seconds: list[float]) -> None:
    one_by_one, batched = Buckets(HOLD_BUCKETS), Buckets(HOLD_BUCKETS)
    for value in seconds:
        one_by_one.observe(value)
    batched.observe_many(list(seconds))
    assert batched.counts == one_by_one.counts
    assert batched.count == one_by_one.count == len(seconds)
    assert abs(batched.sum - one_by_one.sum) <= 1e-6 * max(1.0, one_by_one.sum)


def test_a_value_on_a_bound_is_counted_in_that_bound() -> None:
    buckets = Buckets((1.0, 2.0))
    buckets.observe_many([1.0, 2.0, 2.5])
    assert buckets.counts == [1, 1, 1]
    assert buckets.cumulative() == [("1.0", 1), ("2.0", 2), ("+Inf", 3)]


def test_log_throttle_logs_once_per_interval_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    throttle = LogThrottle(logging.getLogger("elockd.test"), interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="elockd.test"):
        assert throttle("refused %s", "a")
        for _ in range(5):
            now[0] += 1.0
            assert not throttle("refused %s", "b")
        now[0] = 10.0
        assert throttle("refused %s", "c")
        now[0] = 25.0
        assert throttle("refused %s", "d")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a",
        "refused c (5 more like this in the last 10 s)",
        "refused d",
    ]
