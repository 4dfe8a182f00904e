"""Settings that are each valid alone but not together.

Checked once every source (file, environment, flags) has been merged, so a problem
may involve settings given in different places: each is named the way its user gave
it (``--session-ttl``, ``ELOCKD_SESSION_TTL`` or the ``--config`` file's key), so the
one-line error points at what to change.
"""

from __future__ import annotations

from collections.abc import Mapping

from elockd.daemon.server import MAX_CLUSTER_KEYS
from elockd.protocol.config import Config

#: The name main() gives each source of settings (``origin``'s values).
COMMAND_LINE = "the command line"
ENVIRONMENT = "the environment"
ENV_PREFIX = "ELOCKD_"


def given_as(key: str, origin: Mapping[str, str]) -> str:
    """A setting named as its user gave it: ``--flag``, ``ELOCKD_FLAG``, or the file
    and its key (a default counts as the command line's flag)."""
    where = origin.get(key, COMMAND_LINE)
    if where == ENVIRONMENT:
        return ENV_PREFIX + key.upper()
    return "--" + key.replace("_", "-") if where == COMMAND_LINE else f"{where}: {key}"


def combination_problem(config: Config, origin: Mapping[str, str]) -> str | None:
    """The first pair of settings that cannot go together, as one line; None if none.
    ``origin``: where each setting that was given came from."""

    def named(key: str) -> str:
        return given_as(key, origin)

    if (config.tls_key or config.tls_client_ca) and not config.tls_cert:
        return f"{named('tls_key')} and {named('tls_client_ca')} need {named('tls_cert')}"
    if config.grace > config.max_ttl:
        # set_timeout refuses more than --max-ttl; the default must not be more either.
        return f"{named('grace')} {config.grace:g}: above {named('max_ttl')} {config.max_ttl:g}"
    if config.throttle_line_grace >= config.session_ttl:
        # A head held for longer is freed by its node's lease running out anyway.
        return (
            f"{named('throttle_line_grace')} {config.throttle_line_grace:g}: "
            f"not under {named('session_ttl')} {config.session_ttl}"
        )
    if config.etcd and config.max_keys > MAX_CLUSTER_KEYS:
        # One mlock is one etcd txn: a put and a count per key, and etcd's default
        # --max-txn-ops is 128.
        return (
            f"{named('max_keys')} {config.max_keys}: at most {MAX_CLUSTER_KEYS} with "
            f"{named('etcd')} (one mlock is one etcd transaction)"
        )
    return None
