"""elockd: a network lock server on Trio, wire-compatible with elockd/glockd and elock."""

from importlib.metadata import PackageNotFoundError, version

try:
    #: The installed distribution's version (pyproject.toml is its one source).
    __version__ = version("elockd")
except PackageNotFoundError:  # a source tree run without installing it
    __version__ = "0+unknown"
