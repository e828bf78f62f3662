"""Long array parameters are bound as the same literal text clickhouse-connect would write, only faster."""

from __future__ import annotations

from clickhouse_connect.driver.binding import format_bind_value

from fulmen.infra.store.params import bind_fast

AWKWARD = ["plain", "it's", "back\\slash", "tick`", "tab\there", "new\nline", "", "ünïcode", "\\'", "{ids}"]


def test_long_string_arrays_are_written_as_the_library_writes_them() -> None:
    ids = AWKWARD * 10
    bound = bind_fast({"ids": ids})["ids"]
    assert str(bound) == format_bind_value(ids)


def test_plain_ids_are_written_as_the_library_writes_them() -> None:
    ids = [f"rollout-{i}" for i in range(100)]
    assert str(bind_fast({"ids": ids})["ids"]) == format_bind_value(ids)


def test_long_key_arrays_are_written_as_the_library_writes_them() -> None:
    keys = [(text, number) for number, text in enumerate(AWKWARD * 10)]
    assert str(bind_fast({"keys": keys})["keys"]) == format_bind_value(keys)


def test_anything_else_is_left_to_the_library() -> None:
    mixed = ["a"] * 99 + [1]
    short = ["a", "b"]
    floats = [("a", 1.5)] * 100
    parameters = {"mixed": mixed, "short": short, "floats": floats, "n": 3, "s": "x"}
    assert bind_fast(parameters) == parameters
