"""elockd: a network lock server on Trio, wire-compatible with elockd/glockd and elock."""

__version__ = "0.1.0"
