"""The session-record format of :mod:`elockd.backend.cluster.layout`, without etcd: what one
node writes, every other node (also one of a later version) must read alike."""

from __future__ import annotations

from elockd.backend.cluster.layout import Layout, SessionRecord, encode_record, parse_record


def test_record_round_trips() -> None:
    for record in (
        SessionRecord("a1b2", True, 1500, 0x7F3A),
        SessionRecord("c3", False, 0, (1 << 63) - 1),
    ):
        assert parse_record(encode_record(record)) == record


def test_record_value_is_node_connected_grace_tag() -> None:
    assert encode_record(SessionRecord("a1b2", True, 1500, 255)) == b"a1b2 1 1500 ff"
    assert encode_record(SessionRecord("a1b2", False)) == b"a1b2 0 0 0"


def test_record_fields_added_later_are_ignored() -> None:
    assert parse_record(b"a1b2 1 250 ff more fields") == SessionRecord("a1b2", True, 250, 255)


def test_missing_or_malformed_fields_read_as_not_connected_no_grace_no_tag() -> None:
    # Written by a node with a lease per session: no tag, so never taken over.
    assert parse_record(b"a1b2 1 250") == SessionRecord("a1b2", True, 250, 0)
    assert parse_record(b"a1b2") == SessionRecord("a1b2", False, 0)
    assert parse_record(b"a1b2 1 soon") == SessionRecord("a1b2", True, 0)
    assert parse_record(b"a1b2 yes 10") == SessionRecord("a1b2", False, 10)
    assert parse_record(b"a1b2 1 10 zz") == SessionRecord("a1b2", True, 10, 0)


def test_an_entry_key_names_its_table_lock_and_session_tag() -> None:
    layout = Layout(b"/p/")
    key = layout.entry(b"x", b"a/b", 0xBEEF)
    assert key == b"/p/q/x/612f62/beef"
    name = layout.parse_entry(key)
    assert name is not None and (name.kind, name.key, name.tag) == (b"x", b"a/b", 0xBEEF)
    assert layout.parse_entry(b"/p/s/abc") is None
