"""How one sans-IO operation becomes a method of both clients.

The public calls are written once, in :mod:`elockd.client.calls`, as functions
``build(core, now, *args) -> Operation``. :class:`Call` puts one on
:class:`~elockd.client.base.ClientBase` as a descriptor; each client class says in
its ``_method`` how to run an operation (the trio client awaits its replies, the
blocking one waits on a thread event) and gets the call as a real method, named,
documented and with the build's parameters, made once per class. :class:`Block` does
the same for the ``lock``/``shared``/``mlock`` context managers: a :class:`HoldBlock`
is entered with ``async with`` on the trio client and ``with`` on the blocking one.

For the type checker the two kinds of client differ by ``is_async``: the trio client
is :class:`Awaiting` (its calls return coroutines, its blocks are async context
managers), the blocking one :class:`Blocking`. This is what httpcore gets by
generating its sync code from its async code, without a second copy to keep current.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from types import MethodType
from typing import (
    Any,
    ClassVar,
    Concatenate,
    Generic,
    Literal,
    ParamSpec,
    Protocol,
    TypeVar,
    overload,
)

from elockd.client.core import ClientCore, Hold, Operation

P = ParamSpec("P")
T = TypeVar("T")


class Awaiting(Protocol):
    """A client whose calls are awaited (trio)."""

    is_async: ClassVar[Literal[True]]


class Blocking(Protocol):
    """A client whose calls block the calling thread."""

    is_async: ClassVar[Literal[False]]


class Shell(Protocol):
    """What a client class gives :class:`Call`: how to run an operation."""

    is_async: ClassVar[bool]

    @staticmethod
    def _method(build: Callable[..., Operation[Any]]) -> Callable[..., Any]:
        """A method ``(self, *args, **kwargs)`` that builds the operation with this
        client's core and clock, and awaits or waits for its result."""
        ...


class _Made:
    """A descriptor that makes its method once per client class, on first use:
    named, documented and with the parameters of ``build`` after its core and clock."""

    def __init__(self, build: Callable[..., Operation[Any]], doc: str | None) -> None:
        self.build = build
        self.name = build.__name__
        self.__doc__ = doc
        self._functions: dict[type, Callable[..., Any]] = {}

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def function(self, owner: type[Shell]) -> Callable[..., Any]:
        """The method as a plain function of ``owner`` (``self`` first)."""
        function = self._functions.get(owner)
        if function is None:
            function = self._functions[owner] = self._make(owner)
            function.__name__ = self.name
            function.__qualname__ = f"{owner.__qualname__}.{self.name}"
            function.__module__ = owner.__module__
            function.__doc__ = self.__doc__
            parameters = list(inspect.signature(self.build).parameters.values())[2:]
            this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
            function.__signature__ = inspect.Signature([this, *parameters])  # type: ignore[attr-defined]
        return function

    def _bind(self, shell: object, owner: type[Any]) -> Any:
        function = self.function(owner)
        return function if shell is None else MethodType(function, shell)

    def _make(self, owner: type[Shell]) -> Callable[..., Any]:
        raise NotImplementedError


class Call(_Made, Generic[P, T]):
    """One public call, made a method of each client class that reads it."""

    def __init__(self, build: Callable[Concatenate[ClientCore, float, P], Operation[T]]) -> None:
        super().__init__(build, build.__doc__)

    @overload
    def __get__(self, shell: None, owner: type) -> Callable[..., Any]: ...
    @overload
    def __get__(self, shell: Awaiting, owner: type) -> Callable[P, Coroutine[Any, Any, T]]: ...
    @overload
    def __get__(self, shell: Blocking, owner: type) -> Callable[P, T]: ...
    def __get__(self, shell: object, owner: type[Any]) -> Any:
        return self._bind(shell, owner)

    def _make(self, owner: type[Shell]) -> Callable[..., Any]:
        return owner._method(self.build)


class Block(_Made, Generic[P]):
    """``lock``, ``shared``, ``mlock``: the acquire of a :class:`Call` as a block
    that releases the hold on its way out (:class:`HoldBlock`)."""

    def __init__(self, acquire: Call[P, Hold], leave: Call[[Hold, bool], None], doc: str) -> None:
        super().__init__(acquire.build, doc)
        self.acquire, self.leave = acquire, leave

    @overload
    def __get__(self, shell: None, owner: type) -> Callable[..., Any]: ...
    @overload
    def __get__(
        self, shell: Awaiting, owner: type
    ) -> Callable[P, AbstractAsyncContextManager[Hold]]: ...
    @overload
    def __get__(
        self, shell: Blocking, owner: type
    ) -> Callable[P, AbstractContextManager[Hold]]: ...
    def __get__(self, shell: object, owner: type[Any]) -> Any:
        return self._bind(shell, owner)

    def _make(self, owner: type[Shell]) -> Callable[..., HoldBlock]:
        acquire, leave = self.acquire.function(owner), self.leave.function(owner)

        def block(shell: Any, *args: Any, **kwargs: Any) -> HoldBlock:
            start = functools.partial(acquire, shell, *args, **kwargs)
            return HoldBlock(start, functools.partial(leave, shell), owner.is_async)

        return block


class HoldBlock:
    """``async with client.lock(...) as hold:`` (trio) or ``with …`` (blocking).

    Entering acquires; leaving releases. An exception from the block wins over
    :class:`~elockd.client.errors.LockLost` (the flag and callback still report
    the loss); after a clean block a lost hold raises it.
    """

    __slots__ = ("_acquire", "_is_async", "_leave", "hold")
    hold: Hold  # once entered

    def __init__(
        self, acquire: Callable[[], Any], leave: Callable[[Hold, bool], Any], is_async: bool
    ) -> None:
        self._acquire, self._leave, self._is_async = acquire, leave, is_async

    async def __aenter__(self) -> Hold:
        if not self._is_async:
            raise TypeError("the blocking client's blocks are entered with 'with'")
        self.hold = await self._acquire()
        return self.hold

    async def __aexit__(self, kind: object, error: object, traceback: object) -> None:
        await self._leave(self.hold, error is not None)

    def __enter__(self) -> Hold:
        if self._is_async:
            raise TypeError("the trio client's blocks are entered with 'async with'")
        self.hold = self._acquire()
        return self.hold

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        self._leave(self.hold, error is not None)
