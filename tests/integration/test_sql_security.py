"""The read-only SQL surface is read-only for real: an escape suite, limits, cancellation, and who may ask.

Every payload here was tried from outside against the earlier keyword check; each either wrote a file, read
one, ran a second statement, or broke the consumers' inserts. They run against both doors: the store's
reader (what ``fulmen sql`` uses on the embedded store) and the HTTP endpoint ``fulmen consume`` serves.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fulmen.infra.store import ReadEndpoint, ReadOnlyError, RemoteReader, Store
from fulmen.schemas.errors import ConfigurationError, PoisonInputError
from fulmen.testing.served import ServedEndpoint
from tests.conftest import make_settings

pytestmark = [pytest.mark.integration, pytest.mark.security]

# {db}: the test's database; {out}: a path the payload tries to write.
ESCAPES = [
    "SELECT 1 INTO OUTFILE '{out}'",
    "SELECT 1 INTO OUTFILE '{out}' TRUNCATE FORMAT CSV",
    "SELECT 'import os' INTO OUTFILE '{out}' FORMAT RawBLOB",
    "select 1 into outfile '{out}' and stdout",
    "/* SELECT */ INSERT INTO FUNCTION file('{out}', 'CSV', 'a String') VALUES ('x')",
    "-- SELECT\nINSERT INTO FUNCTION file('{out}', 'CSV', 'a String') SELECT 'x'",
    "WITH x AS (SELECT 1) INSERT INTO {db}.model_versions (ModelName) SELECT 'x'",
    "EXPLAIN PIPELINE INSERT INTO {db}.model_versions (ModelName) SELECT 'x'",
    "EXPLAIN AST INSERT INTO FUNCTION file('{out}', 'CSV', 'a String') SELECT 'x'",
    "SELECT * FROM file('/proc/self/environ', 'RawBLOB')",
    "SELECT * FROM file('/etc/passwd', 'LineAsString')",
    "SELECT * FROM file('/etc/*', 'LineAsString')",
    "SELECT file('/etc/passwd')",
    "SELECT FILE('/etc/passwd')",
    "SELECT count() FROM (SELECT * FROM file('/etc/passwd', 'LineAsString'))",
    "SELECT 1 WHERE 1 IN (SELECT 1 FROM file('/etc/passwd', 'LineAsString'))",
    "DESCRIBE TABLE file('/etc/passwd', 'LineAsString')",
    "SELECT * FROM url('http://127.0.0.1:9/', 'CSV', 'a String')",
    "SELECT * FROM s3('http://127.0.0.1:9/b/k.csv', 'CSV', 'a String')",
    "SELECT * FROM remote('127.0.0.1:9', system.one)",
    "SELECT * FROM remoteSecure('127.0.0.1:9', system.one)",
    "SELECT * FROM cluster('default', system.one)",
    "SELECT * FROM executable('id', 'TSV', 'a String')",
    "SELECT * FROM input('a String')",
    "SELECT * FROM mysql('127.0.0.1:9', 'd', 't', 'u', 'p')",
    "SELECT * FROM postgresql('127.0.0.1:9', 'd', 't', 'u', 'p')",
    "SELECT * FROM merge('system', '.*')",
    "SELECT * FROM {db}.model_versions AS m JOIN url('http://127.0.0.1:9/', 'CSV', 'a String') AS u ON 1",
    "SELECT 1; CREATE TABLE {db}.evil (a Int8) ENGINE = Memory",
    "SELECT 1; INSERT INTO {db}.model_versions (ModelName) VALUES ('forged')",
    "SELECT 1; ALTER TABLE {db}.model_versions DELETE WHERE 1",
    "SELECT 1; SET readonly = 1",
    "SELECT 1;SET readonly=1;",
    "/* /* */ SELECT */ CREATE TABLE {db}.evil (a Int8) ENGINE = Memory",
    "/* SELECT */ DROP TABLE {db}.model_versions",
    "(DROP TABLE {db}.model_versions)",
    "INSERT INTO {db}.model_versions (ModelName) VALUES ('forged')",
    "ALTER TABLE {db}.model_versions DELETE WHERE 1",
    "ALTER TABLE {db}.model_versions UPDATE ModelName = 'x' WHERE 1",
    "DROP TABLE {db}.model_versions",
    "DROP DATABASE {db}",
    "CREATE TABLE {db}.evil (a Int8) ENGINE = Memory",
    "TRUNCATE TABLE {db}.model_versions",
    "RENAME TABLE {db}.model_versions TO {db}.gone",
    "SYSTEM FLUSH LOGS",
    "SYSTEM SHUTDOWN",
    "KILL QUERY WHERE 1",
    "OPTIMIZE TABLE {db}.model_versions FINAL",
    "SET readonly = 1",
    "SET max_execution_time = 0",
    "SELECT 1 SETTINGS readonly = 0",
    "SELECT 1 SETTINGS max_execution_time = 0",
    "SELECT count() FROM numbers(10) SETTINGS max_result_rows = 0",
    "EXPLAIN header = 1 SELECT 1",
    "SHOW PROCESSLIST",
    "SHOW GRANTS",
    "SELECT * FROM system.users",
    "SELECT * FROM system.query_log",
    "SELECT * FROM default.anything",
    "SELECT sleepEachRow(3) FROM numbers(10)",
    "GRANT ALL ON *.* TO default",
    "CREATE USER evil",
    "ATTACH TABLE {db}.x FROM '/tmp' (a Int8) ENGINE = MergeTree ORDER BY a",
    "BACKUP DATABASE {db} TO File('{out}')",
    "",
    "   ",
    "-- only a comment",
]


@pytest.fixture
def db_store(tmp_path: Path, store_path: Path) -> Iterator[Store]:
    settings = make_settings(tmp_path, None, store_path)
    settings.clickhouse.read_max_execution_s = 60.0
    store = Store.open(settings)
    store.migrate()
    yield store
    store.close()
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


def _insert_version(store: Store, version: int) -> None:
    """An insert on the store's own handle, as the consumers make them."""
    store.client.insert(
        store.table("model_versions"), [["m", version, f"/c/{version}"]], column_names=["ModelName", "Version", "Uri"]
    )


def _count(store: Store) -> int:
    return store.query(f"SELECT count() FROM {store.database}.model_versions").rows[0][0]


def test_every_escape_is_refused_by_the_reader(db_store: Store, tmp_path: Path) -> None:
    out = tmp_path / "escaped.pth"
    let_through = []
    for version, payload in enumerate(ESCAPES, start=1):
        try:
            db_store.reader().raw(payload.format(db=db_store.database, out=out), "TabSeparated")
            let_through.append(payload)
        except ReadOnlyError:
            pass
        # The store is neither wedged nor read-only: the consumers' inserts still go in, and reads still work.
        _insert_version(db_store, version)
        assert db_store.query(f"SELECT count() FROM {db_store.database}.model_versions", read_only=True).rows == [
            [version]
        ], payload
    assert not let_through
    assert not out.exists()


@pytest.mark.parametrize(
    ("sql", "fmt", "expected"),
    [
        ("SELECT 1 + 1", "TabSeparated", b"2\n"),
        ("WITH 2 AS x SELECT x * 3", "TabSeparated", b"6\n"),
        ("SELECT 1 AS a FORMAT JSONEachRow", "TabSeparated", b'{"a":1}\n'),  # the query's FORMAT wins
        ("SELECT 1 AS a", "CSVWithNames", b'"a"\n1\n'),
        ("select 'x FORMAT JSON' as s", "TabSeparated", b"x FORMAT JSON\n"),
        ("SELECT number FROM numbers(3) ORDER BY number DESC", "TabSeparated", b"2\n1\n0\n"),
        ("SELECT count() FROM system.tables WHERE database = '{db}' AND name = 'otel_traces'", "TSV", b"1\n"),
        ("EXISTS TABLE {db}.otel_traces", "TabSeparated", b"1\n"),
        ("SELECT count() FROM model_versions", "TabSeparated", b"0\n"),  # unqualified: Fulmen's database
        ("SELECT 1 UNION ALL SELECT 2", "TabSeparated", b"1\n2\n"),
    ],
)
def test_reads_run_and_answer_in_the_right_format(db_store: Store, sql: str, fmt: str, expected: bytes) -> None:
    data, _ = db_store.reader().raw(sql.format(db=db_store.database), fmt)
    assert data == expected


def test_show_describe_and_explain_are_reads(db_store: Store) -> None:
    reader, db = db_store.reader(), db_store.database
    assert b"otel_traces" in reader.raw(f"SHOW TABLES FROM {db}", "TabSeparated")[0]
    assert b"TraceId" in reader.raw(f"DESCRIBE TABLE {db}.otel_traces", "TabSeparated")[0]
    assert reader.raw("EXPLAIN SELECT 1", "TabSeparated")[0]
    assert b"CREATE TABLE" in reader.raw(f"SHOW CREATE TABLE {db}.otel_traces", "TabSeparated")[0]


def test_a_statement_that_passed_is_not_parsed_again_and_a_refusal_stands(
    db_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader, parses = db_store.reader(), []
    sql = f"SELECT count() FROM {db_store.database}.otel_traces"
    first = reader.check(sql)
    with reader._handle(final=False) as client:
        original = type(client).raw_query  # what the check's EXPLAIN AST goes through

    def counting(self, query, *args, **kwargs):  # type: ignore[no-untyped-def]
        parses.append(query)
        return original(self, query, *args, **kwargs)

    monkeypatch.setattr(type(client), "raw_query", counting)
    assert reader.check(sql) is first and not parses
    for _ in range(2):
        with pytest.raises(ReadOnlyError):
            reader.check(f"DROP TABLE {db_store.database}.otel_traces")
    assert len(parses) == 2  # a refusal is judged afresh each time, never remembered
    long = f"SELECT count() FROM {db_store.database}.otel_traces WHERE SpanName IN ({', '.join(['%s'] * 4000)})"
    for _ in range(2):
        reader.check(long % tuple(f"'s{i}'" for i in range(4000)))
    assert len(parses) == 4  # a text too long to keep is checked each time


@pytest.mark.parametrize("fmt", ["TSV; DROP TABLE x", "JSON FORMAT CSV", "", "../etc", "TSV INTO OUTFILE 'x'"])
def test_the_default_format_is_a_name_not_sql(db_store: Store, fmt: str) -> None:
    with pytest.raises(ReadOnlyError, match="output format"):
        db_store.reader().raw("SELECT 1", fmt)


def test_limits_bound_every_read(tmp_path: Path, store_path: Path) -> None:
    settings = make_settings(tmp_path, None, store_path)
    settings.clickhouse.read_max_execution_s = 1.0
    settings.clickhouse.read_max_result_rows = 1000
    store = Store.open(settings)
    try:
        with pytest.raises(PoisonInputError, match="TIMEOUT_EXCEEDED|Timeout exceeded"):
            store.reader().raw("SELECT count() FROM numbers(1000000000000)", "TabSeparated")
        with pytest.raises(PoisonInputError, match="TOO_MANY_ROWS|Limit for result"):
            store.reader().raw("SELECT number FROM numbers(100000)", "TabSeparated")
        # A failed read leaves nothing behind on its handle for the next one to read.
        assert store.reader().raw("SELECT 42", "TabSeparated")[0] == b"42\n"
    finally:
        store.close()


def test_a_long_read_does_not_hold_inserts_back(db_store: Store) -> None:
    """One long read runs while inserts go in: each insert finishes while the read is still running."""
    reader = db_store.reader()
    tag = reader.new_tag()
    ended: list[float] = []

    def long_read() -> None:
        try:
            reader.raw("SELECT count() FROM numbers(1000000000000)", "TabSeparated", tag=tag)
        except PoisonInputError:
            pass
        finally:
            ended.append(time.monotonic())

    thread = threading.Thread(target=long_read)
    thread.start()
    try:
        _wait_running(db_store, tag)
        delays = []
        for version in range(1, 4):
            started = time.monotonic()
            _insert_version(db_store, version)
            delays.append(time.monotonic() - started)
        assert not ended, "the read ended before the inserts: the test proved nothing"
        assert _count(db_store) == 3
        print(f"insert delays while a long read ran: {[round(d, 3) for d in delays]} s")
    finally:
        reader.cancel(tag)
        thread.join(timeout=60)
    assert ended, "the cancelled read did not end"


def _wait_running(store: Store, tag: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = store.query(f"SELECT count() FROM system.processes WHERE query LIKE '%fulmen-read:{tag}%'").rows
        if rows[0][0] > 1:  # the read, and this query that names it
            return
        time.sleep(0.1)
    raise AssertionError("the read never showed in system.processes")


# --- the HTTP endpoint ----------------------------------------------------------------------------------------
def test_every_escape_is_refused_over_http(db_store: Store, tmp_path: Path) -> None:
    out = tmp_path / "escaped.pth"
    let_through = []
    with ServedEndpoint(db_store) as served, httpx.Client(base_url=served.url, timeout=30) as http:
        for version, payload in enumerate(ESCAPES, start=1):
            sql = payload.format(db=db_store.database, out=out)
            answers = (
                http.get("/", params={"query": sql}),
                http.post("/", content=sql.encode()),
                http.post("/query", json={"sql": sql}),
            )
            let_through += [(payload, a.status_code, a.text) for a in answers if a.status_code not in (400, 403)]
            _insert_version(db_store, version)
            assert _count(db_store) == version
        assert http.get("/", params={"query": "SELECT 7"}).text == "7\n"
    assert not let_through
    assert not out.exists()


def test_the_endpoint_answers_in_the_querys_own_format(db_store: Store) -> None:
    with ServedEndpoint(db_store) as served:
        own = httpx.get(f"{served.url}/", params={"query": "SELECT 1 AS a FORMAT JSONEachRow"}, timeout=30)
        default = httpx.get(f"{served.url}/", params={"query": "SELECT 1 AS a", "default_format": "CSV"}, timeout=30)
        injected = httpx.get(
            f"{served.url}/", params={"query": "SELECT 1", "default_format": "TSV; DROP TABLE x"}, timeout=30
        )
    assert (own.status_code, own.text) == (200, '{"a":1}\n')
    assert (default.status_code, default.text) == (200, "1\n")
    assert injected.status_code == 403 and "output format" in injected.text


HOSTILE_VALUES = [
    "x' OR 1=1 --",
    "x\\' OR 1=1 --",
    "'; DROP TABLE model_versions; --",
    "%(other)s",
    "{x:String}",
    "\u00e9\n\t\\",
]


def test_parameters_are_values_never_sql(db_store: Store) -> None:
    """A dashboard's filters travel as parameters: each hostile value comes back as itself, through the
    reader and over HTTP (RemoteReader), and a value that is not a scalar is refused."""
    _insert_version(db_store, 1)
    sql = "SELECT %(value)s AS v, count() AS n FROM model_versions WHERE ModelName = %(value)s"
    with ServedEndpoint(db_store) as served:
        remote = RemoteReader(served.url)
        for value in HOSTILE_VALUES:
            for reader in (db_store.reader(), remote):
                assert reader.query(sql, {"value": value}).rows == [[value, 0]], (reader, value)
        assert remote.query("SELECT count() AS n FROM model_versions WHERE Version IN %(v)s", {"v": [1, 2]}).rows == [
            [1]
        ]
        with pytest.raises(ReadOnlyError, match="only strings, numbers"):
            remote.query(sql, {"value": {"nested": 1}})
        with pytest.raises(ReadOnlyError, match="placeholders"):
            db_store.reader().query(sql, {"other": "x"})
    assert _count(db_store) == 1


def test_who_may_ask(db_store: Store) -> None:
    with ServedEndpoint(db_store) as served:
        query = {"query": "SELECT 1"}
        assert httpx.get(f"{served.url}/", params=query, timeout=30).status_code == 200
        rebinding = httpx.get(f"{served.url}/", params=query, headers={"Host": "evil.example:8124"}, timeout=30)
        assert rebinding.status_code == 403
        cross_origin = httpx.post(
            f"{served.url}/", content=b"SELECT 1", headers={"Origin": "http://evil.example"}, timeout=30
        )
        assert cross_origin.status_code == 403
        cross_site = httpx.get(f"{served.url}/", params=query, headers={"Sec-Fetch-Site": "cross-site"}, timeout=30)
        assert cross_site.status_code == 403
        for method in ("PUT", "DELETE", "PATCH"):
            assert httpx.request(method, f"{served.url}/", params=query, timeout=30).status_code == 405
        # A body that declares 100 MB is refused before a byte of it is read.
        with socket.create_connection(("127.0.0.1", served.endpoint.port), timeout=30) as sock:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 104857600\r\n\r\nSELECT 1")
            assert sock.recv(64).startswith(b"HTTP/1.1 413")


def test_a_token_is_required_when_set(db_store: Store) -> None:
    with ServedEndpoint(db_store, token="s3cret") as served:
        query = {"query": "SELECT 1"}
        assert httpx.get(f"{served.url}/", params=query, timeout=30).status_code == 401
        wrong = httpx.get(f"{served.url}/", params=query, headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401
        good = httpx.get(f"{served.url}/", params=query, headers={"Authorization": "Bearer s3cret"}, timeout=30)
        assert (good.status_code, good.text) == (200, "1\n")
        assert httpx.get(f"{served.url}/ping", timeout=30).json()["token"] is True


def test_listening_beyond_loopback_needs_a_token(db_store: Store) -> None:
    with pytest.raises(ConfigurationError, match="FULMEN_CLICKHOUSE_READ_TOKEN"):
        ReadEndpoint(db_store, "0.0.0.0", 0)


def test_a_read_whose_client_leaves_is_cancelled(db_store: Store) -> None:
    """The client sends a read that would run 60 s and hangs up: the engine stops the read soon after."""
    with ServedEndpoint(db_store) as served:
        sock = socket.create_connection(("127.0.0.1", served.endpoint.port))
        body = b"SELECT count() FROM numbers(1000000000000)"
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not _reads_running(db_store):
            time.sleep(0.1)
        assert _reads_running(db_store), "the read never started"
        sock.close()
        deadline = time.monotonic() + 20  # a liveness bound, far below the read's own 60 s limit
        while time.monotonic() < deadline and _reads_running(db_store):
            time.sleep(0.2)
        assert not _reads_running(db_store), "the read kept running after its client left"


def _reads_running(store: Store) -> bool:
    sql = "SELECT count() FROM system.processes WHERE startsWith(query, '/* fulmen-read:')"
    return store.query(sql).rows[0][0] > 0
