"""Fuzz inputs for the read-only SQL endpoint: grammar-made reads, random statements, and hostile ones (writes,
files, URLs, other servers, multi-statements, settings, comments, quoting tricks) that must get a 4xx.

Hostile statements write only under ``Target.canary`` and reach only loopback ports nothing listens on
(``Target.closed_port``) or the endpoint itself, so a statement that gets through harms nothing outside the
bench's own directory. ``heavy_case`` makes the few expensive reads that only limits stop (run last).
"""

from __future__ import annotations

import json
import random
from urllib.parse import quote

from bench.fuzz_inputs import CONFUSERS, Case, Target, dumps, http_variant, json_variant, mutate_bytes, random_bytes

__all__ = ["HOSTILE", "good_sql", "heavy_case", "sql_case"]

DB = "fulmen"
TABLES = [
    f"{DB}.otel_traces",
    f"{DB}.rollouts",
    f"{DB}.transitions",
    f"{DB}.model_versions",
    f"{DB}.train_steps",
    "system.one",
    "numbers(100)",
    f"{DB}.nope",
    "(SELECT 1 AS x)",
]
EXPRS = [
    "count()",
    "1",
    "*",
    "SpanName",
    "TraceId",
    "length(SpanName)",
    "max(Timestamp)",
    "toString(now())",
    "arrayJoin([1, 2, 3])",
    "'text'",
    "NULL",
    "rand() % 7",
    "x",
    "sum(1)",
    "uniqExact(TraceId)",
    "1/0",
    "toUInt8(300)",
    "'\\u00e9\u4e2d'",
    "[1, 'a']",
    "map('k', 1)",
    "tuple(1, 2).3",
    "-9223372036854775809",
    "1e400",
    "'" + "a" * 5000 + "'",
    "version()",
    "currentUser()",
    "hostName()",
    "getSetting('readonly')",
]
FORMATS = [
    "TSV",
    "TabSeparated",
    "CSV",
    "JSON",
    "JSONEachRow",
    "Pretty",
    "Native",
    "Parquet",
    "ArrowStream",
    "Vertical",
    "XML",
    "RowBinary",
    "Null",
    "Bogus",
    "TSV;",
    "\ud800",
    "",
]


def select(rng: random.Random) -> str:
    sql = f"SELECT {', '.join(rng.sample(EXPRS, rng.randint(1, 3)))} FROM {rng.choice(TABLES)}"
    if rng.random() < 0.4:
        sql += f" WHERE {rng.choice(['1', 'SpanName = ' + repr('x'), 'x > 0', 'NULL', 'Attempt = 1', '1 = 1 OR'])}"
    if rng.random() < 0.2:
        sql += " GROUP BY 1"
    if rng.random() < 0.2:
        sql += f" ORDER BY {rng.choice(['1', '1 DESC', 'rand()'])}"
    if rng.random() < 0.5:
        sql += f" LIMIT {rng.choice([0, 1, 10, -1, 2**64, 'x'])}"
    if rng.random() < 0.15:
        sql += f" FORMAT {rng.choice(FORMATS)}"
    return sql


def read_statement(rng: random.Random) -> str:
    """A read, mostly well formed."""
    roll = rng.random()
    if roll < 0.55:
        return select(rng)
    if roll < 0.65:
        return f"WITH q AS ({select(rng)}) SELECT * FROM q"
    if roll < 0.72:
        return f"({select(rng)}) UNION ALL ({select(rng)})"
    others = [
        "SHOW TABLES FROM fulmen",
        "SHOW DATABASES",
        "DESCRIBE fulmen.otel_traces",
        "DESC TABLE fulmen.rollouts",
        "EXPLAIN SELECT 1",
        "EXPLAIN AST SELECT count() FROM fulmen.otel_traces",
        "EXISTS fulmen.otel_traces",
        "SHOW CREATE TABLE fulmen.otel_traces",
        "select 1",
        "  \n\tSELECT 1",
        "SELECT 1;",
        "SELECT 1 ;  ",
        "SELECT 1 -- tail",
        "/* head */ SELECT 1",
        "SELECT 'a;b'",
        "SELECT '--'",
        "SELECT `count`() ",
    ]
    return rng.choice(others)


def garble(rng: random.Random, sql: str) -> str:
    roll = rng.random()
    if roll < 0.4:
        return mutate_bytes(rng, sql.encode("utf-8", "surrogatepass")).decode("utf-8", "replace")
    if roll < 0.6:
        at = rng.randrange(len(sql) + 1)
        return (
            sql[:at]
            + rng.choice(["(", ")", "'", '"', "`", "\\", ";", "/*", "*/", "--", "\x00", "\ud800", "$$"])
            + sql[at:]
        )
    if roll < 0.8:
        return " ".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 30)))
    return random_bytes(rng, 4096).decode("latin-1")


TOKENS = [
    "SELECT",
    "FROM",
    "WHERE",
    "INSERT",
    "INTO",
    "VALUES",
    "(",
    ")",
    ",",
    ";",
    "1",
    "'x'",
    "*",
    "AS",
    "WITH",
    "FORMAT",
    "SETTINGS",
    "UNION",
    "ALL",
    "JOIN",
    "ON",
    "GROUP",
    "BY",
    "ORDER",
    "LIMIT",
    "OFFSET",
    "FINAL",
    "ARRAY",
    "[",
    "]",
    "=",
    "OUTFILE",
    "file",
    "numbers",
    "system.one",
    "fulmen.otel_traces",
    "/*",
    "*/",
    "--",
]


def hostile_statements(target: Target, n: int) -> list[str]:
    c, closed, me = target.canary, target.closed_port, target.self_port
    schema = "'a UInt8'"
    return [
        f"SELECT 1 INTO OUTFILE '{c}/outfile_{n}.txt'",
        f"SELECT * FROM system.one INTO OUTFILE '{c}/outfile_{n}.tsv' FORMAT TSV",
        f"SELECT 1 INTO OUTFILE '{c}/outfile_{n}.pth' TRUNCATE FORMAT RawBLOB",
        f"/* x */ INSERT INTO FUNCTION file('{c}/file_{n}.csv', 'CSV', {schema}) SELECT 1",
        f"-- c\nINSERT INTO FUNCTION file('{c}/file_{n}b.csv', 'CSV', {schema}) VALUES (1)",
        f"WITH 1 AS x INSERT INTO FUNCTION file('{c}/with_{n}.csv', 'CSV', {schema}) SELECT x",
        f"EXPLAIN PIPELINE INSERT INTO FUNCTION file('{c}/explain_{n}.csv', 'CSV', {schema}) SELECT 1",
        f"EXPLAIN ESTIMATE INSERT INTO FUNCTION file('{c}/estimate_{n}.csv', 'CSV', {schema}) SELECT 1",
        "SELECT * FROM file('/proc/self/environ', 'RawBLOB')",
        "SELECT * FROM file('/etc/passwd', 'LineAsString')",
        "SELECT * FROM file('/etc/*', 'LineAsString') LIMIT 3",
        "SELECT count() FROM file('/proc/self/cmdline', 'RawBLOB')",
        "WITH (SELECT * FROM file('/etc/hostname', 'RawBLOB')) AS h SELECT h",
        "SELECT * FROM (SELECT * FROM file('/etc/hostname', 'LineAsString'))",
        f"SELECT 1; CREATE TABLE {DB}.fuzz_created_{n} (a UInt8) ENGINE = Memory",
        f"SELECT 1; INSERT INTO {DB}.otel_traces (SpanName, TraceId, SpanId) VALUES ('forged', 'f', 'f')",
        f"SELECT 1; ALTER TABLE {DB}.otel_traces DELETE WHERE SpanName = 'forged'",
        f"SELECT 1; DROP TABLE IF EXISTS {DB}.fuzz_missing_{n}",
        f"SELECT 1; TRUNCATE TABLE IF EXISTS {DB}.fuzz_missing_{n}",
        "SELECT 1; SET readonly = 1",
        "SELECT 1; SET max_memory_usage = 1",
        "SELECT 1; SYSTEM DROP DNS CACHE",
        "SELECT 1; KILL QUERY WHERE 1 SYNC",
        f"SELECT 1; OPTIMIZE TABLE {DB}.rollouts FINAL",
        f"SELECT 1;CREATE DATABASE fuzz_db_{n}",
        f"SELECT 1\n;\nCREATE TABLE {DB}.fuzz_nl_{n} (a UInt8) ENGINE = Memory",
        f"/* /* */ SELECT */ CREATE TABLE {DB}.fuzz_nested_{n} (a UInt8) ENGINE = Memory",
        f"/* SELECT */ CREATE TABLE {DB}.fuzz_comment_{n} (a UInt8) ENGINE = Memory",
        f"-- SELECT\nDROP TABLE IF EXISTS {DB}.fuzz_missing_{n}",
        f"SELECT 'a'';' ; CREATE TABLE {DB}.fuzz_quote_{n} (a UInt8) ENGINE = Memory",
        f"SELECT 'a\\''; CREATE TABLE {DB}.fuzz_bslash_{n} (a UInt8) ENGINE = Memory",
        f"sElEcT 1; cReAtE TABLE {DB}.fuzz_case_{n} (a UInt8) ENGINE = Memory",
        f"\ufeffSELECT 1; CREATE TABLE {DB}.fuzz_bom_{n} (a UInt8) ENGINE = Memory",
        f"SELECT 1\x00; CREATE TABLE {DB}.fuzz_nul_{n} (a UInt8) ENGINE = Memory",
        f"SHOW TABLES; CREATE TABLE {DB}.fuzz_show_{n} (a UInt8) ENGINE = Memory",
        f"INSERT INTO {DB}.otel_traces (SpanName) VALUES ('forged')",
        f"CREATE TABLE {DB}.fuzz_plain_{n} (a UInt8) ENGINE = Memory",
        f"ALTER TABLE {DB}.otel_traces DELETE WHERE 1",
        f"DROP TABLE {DB}.fuzz_missing_{n}",
        "SET readonly = 0",
        "SYSTEM FLUSH LOGS",
        "KILL QUERY WHERE 1",
        f"BACKUP TABLE {DB}.rollouts TO File('{c}/backup_{n}')",
        f"CREATE FUNCTION fuzz_fn_{n} AS (x) -> x + 1",
        f"SELECT * FROM url('http://127.0.0.1:{closed}/x', 'CSV', 'a String')",
        f"SELECT * FROM url('http://127.0.0.1:{me}/?query=SELECT%201', 'TSV', 'a String')",
        f"SELECT * FROM s3('http://127.0.0.1:{closed}/b/k.csv', 'CSV', 'a String')",
        f"SELECT * FROM remote('127.0.0.1:{closed}', system.one)",
        f"SELECT * FROM remoteSecure('127.0.0.1:{closed}', system.one)",
        "SELECT * FROM cluster('default', system.one)",
        "SELECT * FROM executable('id', 'TSV', 'a String')",
        "SELECT * FROM executable('sh -c id', 'TSV', 'a String')",
        f"SELECT * FROM mysql('127.0.0.1:{closed}', 'd', 't', 'u', 'p')",
        f"SELECT * FROM postgresql('127.0.0.1:{closed}', 'd', 't', 'u', 'p')",
        f"SELECT * FROM sqlite('{c}/x_{n}.db', 't')",
        f"SELECT * FROM hdfs('hdfs://127.0.0.1:{closed}/x', 'TSV', 'a String')",
        "SELECT * FROM input('a UInt8')",
        "SELECT 1 SETTINGS max_execution_time = 0",
        "SELECT 1 SETTINGS readonly = 0",
        "SELECT 1 SETTINGS max_result_rows = 0, max_memory_usage = 0",
        f"SELECT * FROM {DB}.otel_traces SETTINGS allow_experimental_analyzer = 0, max_rows_to_read = 0",
        f"SELECT 1 FORMAT TSV; DROP TABLE IF EXISTS {DB}.fuzz_missing_{n}",
    ]


def good_sql(endpoint: str, token: str) -> Case:
    headers = [(b"Authorization", f"Bearer {token}".encode())]
    if endpoint == "sql_query":
        return Case(
            "good",
            "POST",
            "/query",
            json.dumps({"sql": "SELECT 1"}).encode(),
            [(b"Content-Type", b"application/json"), *headers],
        )
    return Case("good", "GET", "/?query=SELECT%201", b"", headers)


def _qs(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def statement(rng: random.Random, target: Target, index: int) -> tuple[str, str, bool]:
    """(kind, sql, hostile)."""
    roll = rng.random()
    if roll < 0.3:
        statements = hostile_statements(target, index)
        pick = rng.randrange(len(statements))
        return f"hostile:{pick}", statements[pick], True
    if roll < 0.65:
        return "read", read_statement(rng), False
    return (
        "garbled",
        garble(rng, read_statement(rng) if rng.random() < 0.7 else rng.choice(hostile_statements(target, index))),
        False,
    )


def sql_case(rng: random.Random, endpoint: str, target: Target, index: int) -> Case:
    """One input for ``sql_query`` (``POST /query`` JSON) or ``sql_http`` (``GET|POST /?query=``)."""
    kind, sql, hostile = statement(rng, target, index)
    auth = [(b"Authorization", f"Bearer {target.token}".encode())]
    if endpoint == "sql_query":
        document = {"sql": sql, "final": rng.choice([True, False])}
        case = Case(kind, "POST", "/query", dumps(document), [(b"Content-Type", b"application/json"), *auth], hostile)
        roll = rng.random()
        if roll < 0.15:
            case.kind, case.body, case.hostile = kind + "+" + (k := json_variant(rng, document))[0], k[1], False
        elif roll < 0.2:
            case.kind, case.body, case.hostile = "random_bytes", random_bytes(rng), False
        elif roll < 0.3:
            case.kind = kind + "+http:" + http_variant(rng, case)
            case.hostile = hostile and case.method == "POST"
        return case
    roll = rng.random()
    params = ""
    if roll < 0.12:
        fmt = rng.choice(
            [*FORMATS, "TSV; DROP TABLE fulmen.otel_traces", "TSV SETTINGS readonly=0", "TSV\nINTO OUTFILE 'x'"]
        )
        params = "&default_format=" + _qs(fmt)
        kind += "+default_format"
        hostile = hostile or ";" in fmt or "SETTINGS" in fmt or "OUTFILE" in fmt
    elif roll < 0.18:
        params = "&final=" + _qs(rng.choice(["0", "1", "false", "x", "\ud800", ""]))
    if rng.random() < 0.5:
        case = Case(kind, "GET", "/?query=" + _qs(sql) + params, b"", list(auth), hostile)
    else:
        case = Case(
            kind,
            "POST",
            "/" + (params.replace("&", "?", 1) if params else ""),
            sql.encode("utf-8", "surrogatepass"),
            list(auth),
            hostile,
        )
    roll = rng.random()
    if roll < 0.08:
        case.method = rng.choice(["PUT", "DELETE", "PATCH", "OPTIONS", "FOO", "TRACE"])
        case.kind += f"+method:{case.method}"
        case.hostile = True  # a method other than GET/POST must not run SQL
    elif roll < 0.14:
        case.headers.append(
            rng.choice(
                [
                    (b"Origin", b"http://evil.example"),
                    (b"Host", b"evil.example:8124"),
                    (b"Host", b"rebind.attacker.example"),
                    (b"Sec-Fetch-Site", b"cross-site"),
                ]
            )
        )
        # A browser cannot add the bearer token: a foreign Host (DNS rebinding) with the token is not an attack.
        case.kind += "+cross_site"
        case.hostile = case.headers[-1][0] != b"Host"
    elif roll < 0.24:
        case.kind += "+http:" + http_variant(rng, case)
        case.hostile = hostile and case.method in ("GET", "POST")
    elif roll < 0.3:
        case.path = (
            "/?query="
            + _qs(rng.choice([str(v) for v in CONFUSERS[:30]]))
            + rng.choice(["", "&query=SELECT%202", "&query"])
        )
        case.kind, case.hostile = "query_param_odd", False
    return case


def heavy_case(index: int, endpoint: str, target: Target) -> Case:
    """An expensive read: limits must stop it with a 4xx before the deadline."""
    sql = [
        "SELECT sum(number) FROM numbers(1000000000000)",
        "SELECT count() FROM numbers_mt(1e12) WHERE number % 7 = 3",
        "SELECT * FROM numbers(1e10) FORMAT TSV",
        "SELECT groupArray(number) FROM numbers(1e9)",
    ][index % 4]
    auth = [(b"Authorization", f"Bearer {target.token}".encode())]
    if endpoint == "sql_query":
        return Case(
            "heavy",
            "POST",
            "/query",
            json.dumps({"sql": sql}).encode(),
            [(b"Content-Type", b"application/json"), *auth],
            True,
        )
    return Case("heavy", "GET", "/?query=" + _qs(sql), b"", auth, True)


HOSTILE = hostile_statements(Target(), 0)
