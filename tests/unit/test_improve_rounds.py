"""``fulmen improve``'s rounds without a broker (:mod:`fulmen.algorithm.service.improve`): the windows, the selection
restricted to one, how a round's groups spread over its steps, and the book that a restart reads."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from fulmen.algorithm.service.improve import ImprovePlan, RoundBook, round_selection, round_steps
from fulmen.cli.improve import seconds
from fulmen.schemas.errors import FulmenError

NOW = datetime(2026, 12, 7, 3, 0, tzinfo=UTC)


def test_each_window_starts_where_the_last_ended_and_leaves_the_settling_rollouts_out(tmp_path: Path) -> None:
    plan = ImprovePlan(settle_s=60, since=NOW - timedelta(hours=1))
    book = RoundBook(tmp_path)
    first = book.next_round(plan, NOW, steps=0)
    assert (first.number, first.since, first.until) == (
        1,
        "2026-12-07T02:00:00.000000+00:00",
        "2026-12-07T02:59:00.000000+00:00",
    )
    first.done = True
    book.save()
    again = RoundBook(tmp_path)  # what a restart reads
    assert again.unfinished is None and again.rounds[0].until == first.until
    second = again.next_round(plan, NOW + timedelta(minutes=10), steps=4)
    assert (second.since, second.until, second.steps_from) == (first.until, "2026-12-07T03:09:00.000000+00:00", 4)
    behind = RoundBook(
        tmp_path / "other"
    )  # a clock behind the last window's end: an empty window, never a reversed one
    behind.rounds = [second]
    third = behind.next_round(plan, NOW, steps=4)
    assert third.since == third.until == second.until
    assert RoundBook(tmp_path).unfinished == second


def test_the_selection_is_the_users_restricted_to_the_window() -> None:
    sql = round_selection(
        "SELECT RolloutId FROM db.rollouts WHERE Reward > 0;",
        "db",
        "2026-12-07T02:00:00+00:00",
        "2026-12-07T03:00:00.5+00:00",
    )
    assert sql == (
        "SELECT RolloutId FROM (SELECT RolloutId FROM db.rollouts WHERE Reward > 0) WHERE RolloutId IN "
        "(SELECT RolloutId FROM db.rollouts FINAL WHERE Timestamp >= toDateTime64('2026-12-07 02:00:00.000000', 6, "
        "'UTC') AND Timestamp < toDateTime64('2026-12-07 03:00:00.500000', 6, 'UTC'))"
    )


@pytest.mark.parametrize(
    ("groups", "per_step", "cap", "expected"),
    [
        (0, 4, 0, (0, 0)),
        (8, 4, 0, (2, 4)),
        (5, 4, 0, (2, 3)),
        (25, 4, 0, (7, 4)),
        (25, 4, 2, (2, 13)),
        (3, 4, 2, (1, 3)),
    ],
)
def test_a_round_is_one_pass_over_its_groups(groups: int, per_step: int, cap: int, expected: tuple[int, int]) -> None:
    steps, each = round_steps(groups, per_step, ImprovePlan(steps_per_round=cap))
    assert (steps, each) == expected
    assert groups <= steps * each < groups + max(steps, 1)  # every group once; fewer than one a step twice


def test_durations() -> None:
    assert [seconds(text, "--every") for text in ("90", "90s", "10m", "1.5h", "250ms")] == [90, 90, 600, 5400, 0.25]
    with pytest.raises(FulmenError, match="--settle '5 minutes'"):
        seconds("5 minutes", "--settle")
