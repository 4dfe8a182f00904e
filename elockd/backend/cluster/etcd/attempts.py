"""A call's attempts at the etcd members: a slow one is not cut short, a fresh one
is sent beside it.

Why not cut a slow attempt short and move on: the node's own link to etcd may be
the slow part (a congested or delayed network), and then every member is as slow
as the first. An attempt cut at a fixed time shorter than the delay never gets an
answer from any member, and the node gives up a lease etcd is still renewing. Why
send a fresh one at all: a member may be hung, and a request that reached a member
during an election may stay stuck in it after the election is over, while the same
request sent again is answered at once.

So a call's span (from when it is sent to its end) is cut into
``max(ATTEMPTS, endpoints)`` equal parts; at the start of each, a fresh attempt
goes to the next member (the same one, with one endpoint), and every earlier
attempt whose request went out stays open until the call's end (a first attempt
still connecting or sending when its part ends is dropped: nothing of it reached
etcd). The first answer wins; the other attempts
are cancelled. An attempt that fails (a refused connection, "no leader") is
followed by the next one at once. Every request the node sends may be applied
twice (see :meth:`.client.EtcdClient.call`), so attempts side by side are as safe
as a retry.

The first attempt runs in the caller's task, and almost every call ends there; only
a call whose first attempt outlives its part starts tasks for the others (and for
the rest of the first one: the request was sent, its reply is read on).
"""

from __future__ import annotations

from typing import Any, NoReturn, Protocol

import trio

from elockd.backend.cluster.etcd.transport import Connection, Retry, Transport

#: A call is tried at least this many times within its span (more with more endpoints).
ATTEMPTS = 3
#: After every endpoint refused a call in a row: so a dead cluster is not hammered.
ROUND_BACKOFF = 0.05


class Caller(Protocol):
    """What the attempts use of the etcd client (:class:`.client.EtcdClient`)."""

    endpoints: list[str]
    _transport: Transport
    #: The endpoint calls stick to: the one that answered last.
    _current: int

    def _decoded(self, endpoint: str, status: int, content: bytes) -> dict[str, Any]: ...

    def _log_failure(self, endpoint: str, failure: str) -> None: ...

    def _give_up(self, path: str, took: float, last: str) -> NoReturn: ...


def attempt_interval(span: float, endpoints: int) -> float:
    """Seconds between two attempts of a call that may take ``span`` seconds."""
    return span / max(ATTEMPTS, endpoints)


class Attempts:
    """One call's attempts, until its end."""

    def __init__(self, client: Caller, path: str, payload: bytes) -> None:
        self._client = client
        self._path = path
        self._payload = payload
        self._answer: dict[str, Any] | None = None
        self._error: Exception | None = None
        self._failures = 0
        self._last = "no attempt finished"
        self._wake = trio.Event()

    async def run(self, end: float, interval: float) -> dict[str, Any]:
        """The first answer of any endpoint, with a fresh attempt every ``interval``
        seconds; EtcdUnavailable (from the client) at ``end`` (trio time) without
        one; an error reply that is not "not now", as it is."""
        client = self._client
        started = trio.current_time()
        index = client._current
        endpoint = client.endpoints[index]
        transport = client._transport
        pending: Connection | None = None
        try:
            with trio.move_on_at(min(started + interval, end)):
                pending = await transport.send(endpoint, self._path, self._payload)
                status, content = await transport.receive(pending)
                pending = None
                return client._decoded(endpoint, status, content)
            late = "no answer within {:g}s (still waiting)" if pending else "not sent within {:g}s"
            client._log_failure(endpoint, late.format(interval))
        except Retry as exc:
            pending = None
            self._failed(index, str(exc))
        except BaseException:
            if pending is not None:
                transport.discard(pending)
            raise
        return await self._others(started, end, interval, index, pending)

    async def _others(
        self, started: float, end: float, interval: float, index: int, pending: Connection | None
    ) -> dict[str, Any]:
        """The attempts after the first, side by side with it if ``pending`` (its
        request sent, its reply not read yet)."""
        client = self._client
        count = len(client.endpoints)
        with trio.move_on_at(end):
            async with trio.open_nursery() as nursery:
                if pending is not None:  # its task reads the reply, or closes it
                    nursery.start_soon(self._attempt, index, nursery.cancel_scope, pending)
                elif self._failures and self._failures % count == 0:
                    await trio.sleep(ROUND_BACKOFF)  # every member refused: don't spin
                while True:
                    index = (index + 1) % count
                    nursery.start_soon(self._attempt, index, nursery.cancel_scope, None)
                    failures = self._failures
                    self._wake = trio.Event()
                    with trio.move_on_after(interval):
                        await self._wake.wait()
                    if self._failures == failures:  # slow, not failed: still waited for
                        late = f"no answer within {interval:g}s (still waiting)"
                        client._log_failure(client.endpoints[index], late)
                    elif self._failures % count == 0:
                        await trio.sleep(ROUND_BACKOFF)
        if self._error is not None:
            raise self._error
        if self._answer is not None:
            return self._answer
        last = self._last if self._failures else f"no answer within {end - started:g}s"
        client._give_up(self._path, end - started, last)

    async def _attempt(
        self, index: int, call: trio.CancelScope, pending: Connection | None
    ) -> None:
        """One attempt at endpoint ``index``; with ``pending``, the rest of one
        whose request was sent on it already."""
        client = self._client
        endpoint = client.endpoints[index]
        transport = client._transport
        try:
            if pending is None:
                status, content = await transport.post(endpoint, self._path, self._payload)
            else:
                status, content = await transport.finish(pending)
            answer = client._decoded(endpoint, status, content)
        except Retry as exc:
            self._failed(index, str(exc))
            self._wake.set()
            return
        except Exception as exc:  # an error reply: the call ends with it
            self._error = exc
        else:
            self._answer = answer
            client._current = index  # calls stick to the member that answers
        call.cancel()

    def _failed(self, index: int, failure: str) -> None:
        client = self._client
        self._last = failure
        client._log_failure(client.endpoints[index], failure)
        if client._current == index:  # another task may have moved on already
            client._current = (index + 1) % len(client.endpoints)
        self._failures += 1
