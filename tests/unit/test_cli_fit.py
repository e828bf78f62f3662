"""`fulmen rollouts`, `fulmen sql` and `fulmen status` in a 100-column terminal: no line is wider, no id or time
wraps; ids are unique prefixes and times are to the second in the zone set; --wide shows every value whole."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fulmen.cli import base
from fulmen.cli.main import app
from fulmen.cli.render import short_ids
from fulmen.infra.store import QueryResult

WIDTH = 100
IDS = ["3f9c2a7e" + str(n) + "5" * 23 for n in range(3)] + ["b41d07c9e2aa4c51a2f0c3d9e8b7a6f5"]
TRACE_ID = "trace-" + "ab" * 16  # a production episode's rollout id
GROUP = "9e107d9d372bb6826bd81d3542a419d6"
AT = datetime(2026, 12, 5, 7, 51, 2, 123456, tzinfo=UTC)


class CannedReader:
    """Answers each query by the table it names, as the store would (rows given directly)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict[str, Any]]] = []

    def query(self, sql: str, parameters: Any = None, *, final: bool = True, read_only: bool = True) -> QueryResult:
        self.asked.append((sql, dict(parameters or {})))
        if "otel_traces" in sql:  # the versions that served each attempt's calls
            served = [[IDS[0], 1, 0, 0], [IDS[1], 2, 0, 1], [IDS[3], 2, 1, 1]]
            return QueryResult(["RolloutId", "Attempt", "low", "high"], served)
        if "count()" in sql:
            return QueryResult(["Status", "Rollouts"], [["failed", 1], ["running", 1], ["succeeded", 3]])
        if "startsWith" in sql:
            prefix = parameters["p"]
            return QueryResult(["RolloutId"], [[i] for i in [*IDS, TRACE_ID] if i.startswith(prefix)])
        if "WHERE RolloutId = %(id)s" in sql:
            error = "agent raised ValueError: " + "the answer was not a number " * 4
            return QueryResult(
                [
                    "Attempt",
                    "Status",
                    "Mode",
                    "Reward",
                    "Dispatched",
                    "TaskId",
                    "GroupId",
                    "RunnerId",
                    "Error",
                    "Timestamp",
                ],
                [
                    [1, "failed", "train", None, None, "task-17", GROUP, "runner-" + "c" * 24, error, AT],
                    [2, "succeeded", "train", 1.0, None, "task-17", GROUP, "runner-" + "c" * 24, "", AT],
                ],
            )
        rows = [
            [rollout, 1 + n % 2, "succeeded", 0.123456789, None, GROUP, AT - timedelta(seconds=n)]
            for n, rollout in enumerate([*IDS, TRACE_ID])
        ]
        rows[-1][4] = 3  # dispatched under 3, no LLM span stored yet
        columns = ["RolloutId", "LastAttempt", "State", "LastReward", "Dispatched", "AnyGroup", "Updated"]
        return QueryResult(columns, rows)


@pytest.fixture
def reader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> CannedReader:
    canned = CannedReader()
    monkeypatch.setattr("fulmen.infra.store.open_reader", lambda settings: canned)
    monkeypatch.setattr(base.console, "_width", WIDTH)  # the terminal's width, as Rich reads COLUMNS
    for name in [n for n in os.environ if n.startswith("FULMEN_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FULMEN_HOME", str(tmp_path))
    monkeypatch.setenv("FULMEN_CLICKHOUSE_READ_PORT", "0")
    monkeypatch.setenv("FULMEN_CLI_TIMEZONE", "UTC")
    return canned


def fulmen(*args: str, code: int = 0) -> list[str]:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, result.output + repr(result.exception)
    return result.output.splitlines()


def fits(lines: list[str]) -> None:
    too_wide = [line for line in lines if len(line) > WIDTH]
    assert not too_wide, "\n".join(too_wide)


def on_one_line(lines: list[str], *values: str) -> None:
    for value in values:
        assert any(value in line for line in lines), f"{value!r} is not whole on any line:\n" + "\n".join(lines)


def test_rollouts_fit_with_unique_id_prefixes_and_times_to_the_second(reader: CannedReader) -> None:
    lines = fulmen("rollouts")
    fits(lines)
    shown = short_ids([*IDS, TRACE_ID])
    assert all(len(short) < len(full) for full, short in shown.items())
    assert len(set(shown.values())) == len(shown)  # still tells them apart
    on_one_line(lines, *shown.values(), short_ids([GROUP])[GROUP], "2026-12-05 07:51:02", "2026-12-05 07:50:58")
    assert not any(full in line for line in lines for full in [*IDS, TRACE_ID, GROUP])
    assert ".123456" not in "\n".join(lines)
    assert "times in UTC" in lines[-1] and "--wide" in lines[-1]
    assert any("│ succeeded │ 3 " in line for line in lines)  # the counts
    versions = {line.split("│")[1].strip(): line.split("│")[5].strip() for line in lines if line.count("│") > 6}
    assert versions[shown[IDS[0]]] == "0" and versions[shown[IDS[1]]] == "0–1"  # what served its calls
    assert versions[shown[TRACE_ID]] == "3" and versions[shown[IDS[2]]] == "–"  # dispatched under; none known


def test_wide_shows_every_id_and_time_whole(reader: CannedReader) -> None:
    lines = fulmen("rollouts", "--wide")
    on_one_line(lines, *IDS, TRACE_ID, GROUP, "2026-12-05 07:51:02.123456+00:00")
    assert any(len(line) > WIDTH for line in lines)  # past the terminal rather than cut or wrapped


def test_a_prefix_shows_that_rollouts_attempts_with_its_ids_whole(reader: CannedReader) -> None:
    lines = fulmen("rollouts", IDS[3][:8])
    fits(lines)
    on_one_line(lines, IDS[3], GROUP, "2026-12-05 07:51:02", "runner-" + "c" * 24, "times in UTC")
    fields = {cells[1].strip(): [c.strip() for c in cells[2:4]] for line in lines if len(cells := line.split("│")) == 5}
    assert fields["version"] == ["–", "1"] and fields["dispatched"] == ["–", "–"]  # attempt 2's calls: version 1
    assert reader.asked[-1][1] == {"ids": [IDS[3]]}  # its versions, read for the one rollout
    ambiguous = fulmen("rollouts", "3f9c2a7e", code=1)
    assert "more than one rollout id" in " ".join(ambiguous)
    assert "no rollout id starts with 'ffff'" in " ".join(fulmen("rollouts", "ffff", code=1))


def test_the_zone_is_the_users(reader: CannedReader, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULMEN_CLI_TIMEZONE", "Asia/Kolkata")  # UTC+05:30, no daylight saving
    lines = fulmen("rollouts")
    on_one_line(lines, "2026-12-05 13:21:02")
    assert "times in Asia/Kolkata" in lines[-1]
    on_one_line(fulmen("rollouts", "--utc"), "2026-12-05 07:51:02", "times in UTC")
    monkeypatch.setenv("FULMEN_CLI_TIMEZONE", "Mars/Olympus")
    assert "FULMEN_CLI_TIMEZONE" in " ".join(fulmen("rollouts", code=1))


def test_sql_tables_fit_and_keep_other_values_whole(reader: CannedReader, monkeypatch: pytest.MonkeyPatch) -> None:
    message = "[bold]not markup[/bold] " + "a long status message that has to wrap inside its cell " * 2
    spans = QueryResult(
        ["TraceId", "SpanId", "RolloutId", "SpanName", "Timestamp", "Duration", "StatusMessage"],
        [
            [IDS[n].replace("3f9c", "7a11"), IDS[n][:16], IDS[n], "gen_ai.chat", AT, 1_234_567, message]
            for n in range(3)
        ],
    )
    monkeypatch.setattr(reader, "query", lambda *args, **kwargs: spans)
    lines = fulmen("sql", "SELECT * FROM otel_traces")
    fits(lines)
    on_one_line(lines, "2026-12-05 07:51:02", *short_ids(IDS[:3]).values())
    cells = "".join(line.split("│")[-2].strip() for line in lines if line.count("│") == 8)
    assert message.replace(" ", "") in cells.replace(" ", "")  # wrapped, never cut, never read as markup
    as_json = json.loads("\n".join(fulmen("sql", "SELECT 1", "--format", "json")))
    assert as_json[0]["TraceId"] == spans.rows[0][0] and as_json[0]["Timestamp"] == AT.isoformat()  # whole


def test_a_result_with_too_many_columns_prints_a_row_after_the_other(
    reader: CannedReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [
        "RolloutId",
        "Attempt",
        "TaskId",
        "GroupId",
        "Mode",
        "Status",
        "StatusRank",
        "Reward",
        "Error",
        "RunnerId",
        "ModelVersion",
        "Timestamp",
        "PromptBundle",
    ]  # SELECT * FROM rollouts
    rows = [[rollout, 1, "task-17", GROUP, "train", "succeeded", 3, 1.0, "", "runner-1", 0, AT, ""] for rollout in IDS]
    monkeypatch.setattr(reader, "query", lambda *args, **kwargs: QueryResult(names, rows))
    lines = fulmen("sql", "SELECT * FROM rollouts")
    fits(lines)
    on_one_line(lines, *IDS, GROUP, "2026-12-05 07:51:02")  # room for every value whole
    cells = [[cell.strip() for cell in line.split("│")[1:4]] for line in lines if line.count("│") == 4]
    assert [name for _, name, _ in cells] == names * len(IDS)
    assert [number for number, _, _ in cells if number] == ["1", "2", "3", "4"]
    assert lines[-1] == "4 rows · times in UTC"


def test_status_fits(reader: CannedReader, tmp_path: Path) -> None:
    stack = tmp_path / "stack"
    stack.mkdir()
    (stack / "up.pid").write_text(str(os.getpid()))  # this process stands in for the supervisor
    started = time.time() - 3725
    services = [
        {
            "name": name,
            "pid": os.getpid(),
            "url": f"http://127.0.0.1:{port}{path}",
            "ready_url": None,
            "started_at": started,
            "restarts": restarts,
            "log": "x",
        }
        for name, port, path, restarts in [
            ("consume", 18124, "", 0),
            ("otlp-gateway", 14318, "/v1/traces", 2),
            ("llm-gateway", 18000, "/v1", 0),
            ("dashboard", 18890, "", 0),
        ]
    ]
    (stack / "state.json").write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "started_at": started,
                "ready": True,
                "services": services,
                "kafka": {"bootstrap": "127.0.0.1:1", "started": True, "data_dir": str(tmp_path)},
            }
        )
    )
    lines = fulmen("status", code=1)  # kafka does not answer on port 1
    fits(lines)
    on_one_line(lines, "http://127.0.0.1:14318/v1/traces", "(2 restarts)", "1h02m0", str(stack))
    assert any(line.split()[1:2] == ["supervisor"] and " up " in line for line in lines)


def test_short_ids_are_the_shortest_unique_prefixes() -> None:
    long = ["abcdef0123456789" * 2, "abcdef0199999999" * 2]
    assert short_ids(long) == {long[0]: "abcdef012", long[1]: "abcdef019"}
    assert short_ids(["task-17", "0123456789abcdef"]) == {"task-17": "task-17", "0123456789abcdef": "0123456789abcdef"}
    assert short_ids([]) == {}
