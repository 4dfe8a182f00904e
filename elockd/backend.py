"""What a lock backend may refuse with: the errors both backends raise.

A leaf module, so the cluster backend (:mod:`elockd.cluster`) and the protocol layer
can share them without either importing the other.
"""


class TooManyHolds(Exception):
    """The session already has ``max_holds`` holds; a new one would pass the limit."""


class QueueFull(Exception):
    """A key's queue already holds ``max_waiters`` requests."""


class BackendUnavailable(Exception):
    """The lock backend cannot decide now (etcd has no quorum): the request fails closed."""
