"""The session-record format of :mod:`elockd.cluster.layout`, without etcd: what one
node writes, every other node (also one of a later version) must read alike."""

from __future__ import annotations

from elockd.cluster.layout import SessionRecord, encode_record, parse_record


def test_record_round_trips() -> None:
    for record in (SessionRecord("a1b2", True, 1500), SessionRecord("c3", False, 0)):
        assert parse_record(encode_record(record)) == record


def test_record_value_is_node_connected_grace() -> None:
    assert encode_record(SessionRecord("a1b2", True, 1500)) == b"a1b2 1 1500"
    assert encode_record(SessionRecord("a1b2", False)) == b"a1b2 0 0"


def test_record_fields_added_later_are_ignored() -> None:
    assert parse_record(b"a1b2 1 250 more fields") == SessionRecord("a1b2", True, 250)


def test_missing_or_malformed_fields_read_as_not_connected_no_grace() -> None:
    assert parse_record(b"a1b2") == SessionRecord("a1b2", False, 0)
    assert parse_record(b"a1b2 1 soon") == SessionRecord("a1b2", True, 0)
    assert parse_record(b"a1b2 yes 10") == SessionRecord("a1b2", False, 10)
