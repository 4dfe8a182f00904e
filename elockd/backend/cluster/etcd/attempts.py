"""A call's attempts at several etcd members: the next one is asked beside a slow one.

Why not cut a slow attempt short and move on: the node's own link to etcd may be
the slow part (a congested or delayed network), and then every member is as slow
as the first. An attempt cut at a fixed time shorter than the delay never gets an
answer from any member, and the node gives up a lease etcd is still renewing.
Asking the next member beside the slow one, and keeping the slow one open, costs a
hung member one share of the deadline (as cutting it did) and a slow link only its
delay. The first answer wins; the other attempts are cancelled. Every request the
node sends may be applied twice (see :meth:`.client.EtcdClient.call`), so two
attempts in flight at once are as safe as a retry.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn, Protocol

import trio

from elockd.backend.cluster.etcd.transport import Retry

#: After every endpoint refused a call in a row: so a dead cluster is not hammered.
ROUND_BACKOFF = 0.05


class Caller(Protocol):
    """What the attempts use of the etcd client (:class:`.client.EtcdClient`)."""

    endpoints: list[str]
    #: How long an attempt runs alone before the next endpoint is asked too.
    attempt_timeout: float
    #: The endpoint calls stick to: the one that answered last.
    _current: int

    async def _post(self, endpoint: str, path: str, payload: bytes) -> dict[str, Any]: ...

    def _log_failure(self, endpoint: str, failure: str) -> None: ...

    def _give_up(self, path: str, took: float, last: str) -> NoReturn: ...


class Attempts:
    """One call's attempts at the endpoints of ``client``, at most one in flight
    per endpoint, until the call's end."""

    def __init__(self, client: Caller, path: str, payload: bytes) -> None:
        self._client = client
        self._path = path
        self._payload = payload
        self._answer: dict[str, Any] | None = None
        self._error: Exception | None = None
        self._failures = 0
        self._last = "no attempt finished"
        self._in_flight: set[int] = set()
        self._wake = trio.Event()

    async def run(self, end: float) -> dict[str, Any]:
        """The first answer of any endpoint; EtcdUnavailable (from the client) at
        ``end`` (trio time) without one; an error reply that is not "not now", as
        it is."""
        client = self._client
        count = len(client.endpoints)
        started = trio.current_time()
        with trio.move_on_at(end):
            async with trio.open_nursery() as nursery:
                index = latest = client._current
                while True:
                    wait = math.inf  # every endpoint is being asked: wait for one to fail
                    if len(self._in_flight) < count:
                        while index in self._in_flight:
                            index = (index + 1) % count
                        self._in_flight.add(index)
                        nursery.start_soon(self._attempt, index, nursery.cancel_scope)
                        latest = index
                        index = (index + 1) % count
                        wait = client.attempt_timeout
                    failures = self._failures
                    self._wake = trio.Event()
                    with trio.move_on_after(wait):
                        await self._wake.wait()
                    if self._failures == failures:  # slow, not failed: still waited for
                        endpoint = client.endpoints[latest]
                        share = f"{client.attempt_timeout:g}s"
                        client._log_failure(endpoint, f"no answer within {share} (still waiting)")
                    elif self._failures % count == 0:
                        await trio.sleep(ROUND_BACKOFF)  # every member refused: don't spin
        if self._error is not None:
            raise self._error
        if self._answer is not None:
            return self._answer
        last = self._last if self._failures else f"no answer within {end - started:g}s"
        client._give_up(self._path, end - started, last)

    async def _attempt(self, index: int, call: trio.CancelScope) -> None:
        client = self._client
        endpoint = client.endpoints[index]
        try:
            answer = await client._post(endpoint, self._path, self._payload)
        except Retry as exc:
            self._last = str(exc)
            client._log_failure(endpoint, self._last)
            if client._current == index:  # another task may have moved on already
                client._current = (index + 1) % len(client.endpoints)
            self._failures += 1
            self._in_flight.discard(index)
            self._wake.set()
            return
        except Exception as exc:  # an error reply: the call ends with it
            self._error = exc
        else:
            self._answer = answer
            client._current = index  # calls stick to the member that answers
        call.cancel()
