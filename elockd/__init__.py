"""elockd: a network lock server on Trio, wire-compatible with elockd/glockd and elock."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    #: The installed distribution's version (pyproject.toml is its one source).
    __version__: str


def __getattr__(name: str) -> str:
    """``__version__``, looked up on first use: importing ``importlib.metadata``
    costs elockctl's one-shot commands a tenth of their start-up otherwise."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("elockd")
    except PackageNotFoundError:  # a source tree run without installing it
        found = "0+unknown"
    globals()["__version__"] = found
    return found
