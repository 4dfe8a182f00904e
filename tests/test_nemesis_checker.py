"""The nemesis's checker (tests/support/nemesis_checker.py) on small made-up
histories: each rule broken once and caught, and the same history without the
break passes (so each test can fail both ways)."""

from __future__ import annotations

from tests.support.nemesis_checker import RECEIPT_SLACK, check, report
from tests.support.nemesis_history import Fault, History, Throttle, WatchLine

TOKEN = 1000


def ask(
    history: History, session: str, request: str, sent: float, reply: str | None, *more: str
) -> None:
    """One exchange answered 1 ms after it was sent (``reply`` None: never)."""
    exchange = history.record(session, session[0], request, sent)
    if reply is not None:
        exchange.reply, exchange.received = reply, sent + 0.001
        exchange.more = list(more)


def handover(history: History, late: float | None = None) -> None:
    """ah1 holds x0 from 1 s (token 1000) and polls; etcd lets it go; bh2 gets x0
    at 5 s (token 1001) and polls until 6 s. ``late``: ah1's ``token`` sent at 3 s
    is answered ``late`` seconds after bh2's grant (a node that sent it past its
    deadline)."""
    ask(history, "ah1", "lock x0 2", 1.0, "200 Acquired")
    for step in range(5):
        ask(history, "ah1", "token x0", 1.1 + 0.2 * step, f"200 {TOKEN}")
    if late is not None:
        exchange = history.record("ah1", "a", "token x0", 3.0)
        exchange.reply, exchange.received = f"200 {TOKEN}", 5.001 + late
    ask(history, "bh2", "lock x0 5", 2.0, None)  # the wait, answered below
    history.exchanges[-1].reply, history.exchanges[-1].received = "200 Acquired", 5.0
    for step in range(5):
        ask(history, "bh2", "token x0", 5.1 + 0.2 * step, f"200 {TOKEN + 1}")
    ask(history, "bh2", "unlock x0", 6.05, "200 Unlocked")


def kinds(history: History) -> list[str]:
    return sorted({v.rule for v in check(history)})


def test_a_clean_hand_over_passes() -> None:
    history = History(seed=7, ttl=2)
    handover(history)
    assert check(history) == []


def test_two_holders_confirmed_at_once_are_an_overlap() -> None:
    history = History(seed=7, ttl=2)
    handover(history)
    ask(history, "ah1", "token x0", 5.5, f"200 {TOKEN}")  # A still says yes
    assert kinds(history) == ["overlap"]
    text = report(history, check(history))
    assert "seed 7" in text and "timeline of x0" in text and "bh2@B" in text


def test_a_confirmation_received_well_after_the_next_grant_is_late() -> None:
    """Sent before the other grant, received after it: not an overlap of sure
    intervals, but the holder was told it held the key while another did."""
    history = History(seed=7, ttl=2)
    handover(history, late=RECEIPT_SLACK / 2)
    assert check(history) == []  # within the slack: the reply's trip
    history = History(seed=7, ttl=2)
    handover(history, late=0.8)
    assert kinds(history) == ["late"]


def test_a_report_naming_the_old_holder_during_the_new_hold_is_an_overlap() -> None:
    history = History(seed=7, ttl=2)
    handover(history)
    line = f"x0 exclusive=ah1 shared=0 waiting=0 age=1.000 token={TOKEN} ttl=-"
    ask(history, "ao3", "ls x", 5.4, "END", line)
    assert kinds(history) == ["overlap"]
    history = History(seed=7, ttl=2)
    handover(history)
    ask(history, "ao3", "ls x", 2.4, "END", line)  # while ah1 did hold it
    ask(history, "bo4", "d x0", 5.4, "END", "x0: bh2")
    ask(history, "bo4", "info x0", 5.6, f"200 key=x0 exclusive=bh2 token={TOKEN + 1}")
    assert check(history) == []


def test_a_token_that_goes_back_is_caught() -> None:
    history = History(seed=7, ttl=2)
    handover(history)
    for exchange in history.exchanges:
        if exchange.session == "bh2" and exchange.verb == "token":
            exchange.reply = f"200 {TOKEN - 1}"
    assert kinds(history) == ["token"]


def throttled(history: History, admitted: int, seconds: float) -> None:
    history.throttles["t0"] = Throttle(10, 1.0, 10)
    for number in range(admitted):
        at = seconds * number / (admitted - 1)
        ask(history, "at1", "throttle t0 10 1 wait=1", at, "200 limit=10 remaining=0 reset=1000")


def test_throttle_admissions_above_the_rate_are_caught() -> None:
    history = History(seed=7, ttl=2)
    throttled(history, 10 + 20 + 1, 2.0)  # B + W·rate + 1 in 2 s
    assert check(history) == []
    history = History(seed=7, ttl=2)
    throttled(history, 10 + 20 + 4, 2.0)
    assert kinds(history) == ["throttle"]
    # A wall-clock jump of 0.5 s that came back allows 2 · 5 more.
    history.faults.append(Fault("clock", "b", 0.5, 1.0, "+0.5"))
    assert check(history) == []


def watched(history: History, *lines: str) -> None:
    for number, line in enumerate(lines):
        history.watch_lines.append(WatchLine("aw9", "a", line, 1.0 + number))


def test_a_watch_stream_that_shows_two_holders_is_caught() -> None:
    history = History(seed=7, ttl=2)
    handover(history)
    watched(
        history,
        "SYNCED",
        f"+ x0 exclusive ah1 token={TOKEN}",
        "- x0 exclusive ah1 expired",
        f"+ x0 exclusive bh2 token={TOKEN + 1}",
    )
    assert check(history) == []
    history.watch_lines.pop(2)  # the stream never said ah1 lost it
    assert kinds(history) == ["watch"]


def test_a_watch_event_for_a_grant_nobody_asked_for_is_caught() -> None:
    history = History(seed=7, ttl=2)
    handover(history)
    watched(history, "SYNCED", f"+ x0 exclusive zz9 token={TOKEN + 5}")
    assert kinds(history) == ["watch"]


def test_a_crashed_holders_key_not_granted_within_the_bound_is_caught() -> None:
    history = History(seed=7, ttl=2)
    ask(history, "ah1", "lock x0 2", 1.0, "200 Acquired")
    ask(history, "ah1", "token x0", 1.2, f"200 {TOKEN}")
    history.crashes["ah1"] = 1.5
    ask(history, "bc2", "lock x0 30", 1.6, None)
    got = 1.5 + 2 * history.ttl + 2.0  # within 2 TTL + 3 s
    history.exchanges[-1].reply, history.exchanges[-1].received = "200 Acquired", got
    ask(history, "bh3", "ping", 30.0, "200 PONG")  # the run went on past the bound
    assert check(history) == []
    history.exchanges[2].received = 1.5 + 2 * history.ttl + 3.5
    assert kinds(history) == ["freed"]


def test_a_key_not_free_after_the_run_is_caught() -> None:
    history = History(seed=7, ttl=2)
    ask(history, "ap1", "lock x0 12", 1.0, "200 Acquired")
    assert check(history) == []
    ask(history, "bp2", "lock x1 12", 1.0, "409 Unavailable")
    assert kinds(history) == ["freed"]


def test_shared_holders_above_the_limit_are_caught() -> None:
    history = History(seed=7, ttl=2)
    for number, start in enumerate((1.0, 1.2, 2.5)):
        session = f"as{number}"
        ask(history, session, "lock_shared s0 2 limit=2", start, "200 1")
        ask(history, session, "renew s0 ttl=3", start + 0.5, "200 Renewed")
        ask(history, session, "unlock_shared s0", start + 0.9, "200 0")
    assert check(history) == []
    ask(history, "as9", "lock_shared s0 2 limit=2", 1.3, "200 3")  # a third at once
    ask(history, "as9", "renew s0 ttl=3", 1.45, "200 Renewed")
    assert kinds(history) == ["shared"]
    assert len(check(history)) == 2  # the reply's count, and the holders at once


def test_a_hold_killed_and_taken_again_by_its_session_is_a_new_hold() -> None:
    """``lock K`` again after a kill of K is a new grant with a new token, not
    the old hold's token changing."""
    history = History(seed=7, ttl=2)
    ask(history, "bh2", "lock x0 2", 1.0, "200 Acquired")
    ask(history, "bh2", "token x0", 1.1, f"200 {TOKEN}")
    ask(history, "bk3", "kill x0", 1.2, "200 Killed 1")
    ask(history, "bh2", "lock x0", 1.3, "200 Acquired")
    ask(history, "bh2", "token x0", 1.4, f"200 {TOKEN + 1}")
    assert check(history) == []
    history.exchanges[2].reply = "403 Forbidden"  # no kill: the token changed
    assert kinds(history) == ["token"]
