"""Fuzz inputs for the HTTP endpoints: a request :class:`Case`, byte mutations, JSON type confusion, HTTP-level
oddities (methods, content types, encodings, headers, framing) and the generators of the OTLP and LLM endpoints.

Every case is made by its own ``random.Random`` seeded from ``(seed, endpoint, index)``, so one failing input
can be made again from its index alone (``bench/fuzz.py --replay ENDPOINT:INDEX``).
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "Raw", "Target", "http_variant", "json_variant", "llm_case", "mutate_bytes", "otlp_case"]


@dataclass
class Target:
    """What the generators need to know about the running servers."""

    token: str = "fuzz-token"
    canary: str = "/tmp/fulmen-fuzz-canary"  # hostile SQL writes aim here, never anywhere else
    closed_port: int = 9  # a loopback port nothing listens on (SSRF probes)
    self_port: int = 0  # the SQL endpoint's own port (url() back into itself)


@dataclass
class Case:
    """One HTTP request, sent raw (so any byte can be in the method, path or headers)."""

    kind: str
    method: str
    path: str
    body: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    hostile: bool = False  # must be refused with a 4xx (SQL escapes, cross-site requests)
    declared_length: int | None = None  # Content-Length to declare when it differs from the body's (-1: none)

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def set_header(self, name: bytes, value: bytes | None) -> None:
        self.headers = [(k, v) for k, v in self.headers if k.lower() != name.lower()]
        if value is not None:
            self.headers.append((name, value))

    def raw(self, port: int) -> bytes:
        head = [f"{self.method} {self.path} HTTP/1.1".encode("utf-8", "surrogatepass")]
        if self.header(b"host") is None:
            head.append(f"Host: 127.0.0.1:{port}".encode())
        head.append(b"Connection: close")
        length = len(self.body) if self.declared_length is None else self.declared_length
        if length >= 0 and self.header(b"transfer-encoding") is None:
            head.append(b"Content-Length: %d" % length)
        head.extend(k + b": " + v for k, v in self.headers)
        return b"\r\n".join(head) + b"\r\n\r\n" + self.body

    def summary(self, limit: int = 300) -> dict[str, Any]:
        """The request, truncated, for a report."""

        def cut(data: bytes | str) -> str:
            text = repr(data)
            return text if len(text) <= limit else f"{text[:limit]}... ({len(data)} in all)"

        return {
            "kind": self.kind,
            "method": cut(self.method),
            "path": cut(self.path),
            "headers": [f"{cut(k)}: {cut(v)}" for k, v in self.headers if k.lower() != b"authorization"][:8]
            + [f"Authorization: {cut(v)}" for k, v in self.headers if k.lower() == b"authorization"],
            "body_bytes": len(self.body),
            "body": cut(self.body),
        }


# --- bytes ---------------------------------------------------------------------------------------------------
def random_bytes(rng: random.Random, limit: int = 65536) -> bytes:
    size = int(2 ** rng.uniform(0, 16)) - 1 if rng.random() < 0.97 else rng.randrange(limit)
    return rng.randbytes(min(size, limit))


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """1 to 8 edits: flip a bit, insert, delete, duplicate a slice, or truncate."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(5)
        at = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[at % len(buf)] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == 2 and buf:
            del buf[at : at + rng.randint(1, 16)]
        elif op == 3 and buf:
            end = min(len(buf), at + rng.randint(1, 64))
            buf[at:at] = buf[at:end] * rng.randint(1, 4)
        else:
            del buf[at:]
    return bytes(buf)


# --- JSON ----------------------------------------------------------------------------------------------------
class Raw:
    """JSON text put as is where a value belongs (NaN, 1e400, nesting too deep for json.dumps)."""

    def __init__(self, text: str) -> None:
        self.text = text


def deep(depth: int, obj: bool = False) -> Raw:
    return Raw(('{"a":' * depth + "1" + "}" * depth) if obj else ("[" * depth + "]" * depth))


def huge_string(rng: random.Random) -> str:
    roll = rng.random()
    size = 10_000_000 if roll < 0.002 else 1_000_000 if roll < 0.05 else 65_536
    return rng.choice("ab\u00e9\u4e2d") * size


CONFUSERS: list[Any] = [
    0,
    1,
    -1,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    2**64 + 1,
    -(2**64),
    10**30,
    0.0,
    -0.0,
    1.5,
    -2.5,
    1e308,
    True,
    False,
    None,
    "",
    "x",
    "0",
    "1",
    "true",
    "null",
    "\ud800",
    "a\udfffb\ud800",
    "a\x00b",
    "\u202e\ufeff",
    [],
    [1],
    [None],
    ["\ud800"],
    [[[]]],
    {},
    {"a": 1},
    {"\ud800": 1},
    {"": None},
    [1.5, "x", None, {}],
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1e400"),
    Raw("-1e400"),
    Raw("9" * 5000),
    Raw("1" + "0" * 30),
    Raw("123456789012345678901234567890.5"),
    deep(1000),
    deep(1000, obj=True),
    deep(100000),
]
ODD_KEYS = ["\ud800", "\udc00x", "", " ", "a" * 10000, "\x00", "__proto__", "model\u0000", "messages "]


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value in a JSON document (dict keys and list indices)."""
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(paths(value, (*prefix, index)))
    return found


def _get(node: Any, path: tuple) -> Any:
    for part in path:
        node = node[part]
    return node


def dumps(document: Any) -> bytes:
    """JSON text with :class:`Raw` values spliced in and lone surrogates escaped (as clients send them)."""
    raws: dict[str, str] = {}

    def swap(node: Any) -> Any:
        if isinstance(node, Raw):
            marker = f"__raw{len(raws)}__"
            raws[f'"{marker}"'] = node.text
            return marker
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        if isinstance(node, list):
            return [swap(v) for v in node]
        return node

    text = json.dumps(swap(document))
    for marker, raw in raws.items():
        text = text.replace(marker, raw, 1)
    return text.encode()


def confuse(rng: random.Random, document: Any, numbers: list[int] | None = None) -> tuple[str, Any]:
    """One structural edit of a copy of ``document``: a value of another type, an odd key, a key dropped."""
    doc = copy.deepcopy(document)
    spots = paths(doc)
    if not spots or rng.random() < 0.04:
        return "top_level", rng.choice([*CONFUSERS[:40], deep(1000)])
    path = rng.choice(spots)
    parent, last = _get(doc, path[:-1]), path[-1]
    roll = rng.random()
    if roll < 0.62:
        value = rng.choice(CONFUSERS)
        if numbers and rng.random() < 0.3:
            value = rng.choice(numbers)
        elif rng.random() < 0.05:
            value = huge_string(rng)
        parent[last] = value
        return f"value:{_name(path)}", doc
    if roll < 0.75 and isinstance(parent, dict):
        parent[rng.choice(ODD_KEYS)] = parent.pop(last)
        return f"odd_key:{_name(path)}", doc
    if roll < 0.87:
        if isinstance(parent, dict):
            del parent[last]
        else:
            parent.pop(last)
        return f"dropped:{_name(path)}", doc
    if isinstance(parent, dict):
        parent[rng.choice([*ODD_KEYS, "extra", "n", "max_tokens", "stream", "seed"])] = rng.choice(CONFUSERS)
    else:
        parent.extend([parent[last]] * rng.choice([2, 100, 5000]))
    return f"extra:{_name(path)}", doc


def _name(path: tuple) -> str:
    return ".".join(str(p) if isinstance(p, str) else "[]" for p in path)[:80]


def json_variant(rng: random.Random, document: Any, numbers: list[int] | None = None) -> tuple[str, bytes]:
    """A malformed or odd JSON body made from a valid ``document``."""
    roll = rng.random()
    if roll < 0.55:
        kind, doc = confuse(rng, document, numbers)
        if rng.random() < 0.2:
            second, doc = confuse(rng, doc, numbers)
            kind = f"{kind}&{second}"
        return f"json_confusion:{kind}", dumps(doc)
    text = dumps(document)
    if roll < 0.8:
        return "json_mutated", mutate_bytes(rng, text)
    tricks = [
        ("bom", b"\xef\xbb\xbf" + text),
        ("trailing_garbage", text + b"}]x"),
        ("invalid_utf8_in_string", text.replace(b'"', b'"\xff\xfe', 1)),
        ("utf16", json.dumps(document).encode("utf-16")),
        ("duplicate_keys", text[:-1] + b', "model": 1, "model": "fulmen"}' if text.endswith(b"}") else text),
        ("empty", b""),
        ("whitespace", b" \t\r\n"),
        ("nul", text + b"\x00"),
        ("truncated", text[: rng.randrange(len(text) + 1)]),
        ("latin1", json.dumps(document, ensure_ascii=False).encode("utf-8", "surrogatepass").replace(b"e", b"\xe9")),
    ]
    kind, body = rng.choice(tricks)
    return f"json_trick:{kind}", body


# --- HTTP ----------------------------------------------------------------------------------------------------
METHODS = ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO", "post", "P\u00d6ST", "POST\x00"]
CONTENT_TYPES = [
    b"text/plain",
    b"application/json",
    b"application/x-protobuf",
    b"application/protobuf",
    b"multipart/form-data; boundary=x",
    b"application/json; charset=latin-1",
    b"",
    b"\xff\xfe",
    b"application/x-www-form-urlencoded",
    b"application/x-protobuf; proto=bogus",
    b"*/*",
    b"a" * 9000,
]
ENCODINGS = [b"gzip", b"deflate", b"br", b"zstd", b"x-unknown", b"gzip, gzip", b"identity", b"GZIP", b"\xff"]


@functools.cache
def gzip_bomb() -> bytes:
    return gzip.compress(b"\0" * (40 * 1024 * 1024), compresslevel=9)


def bad_encoding(rng: random.Random, case: Case) -> str:
    body = case.body
    choices = [
        ("gzip_random", b"gzip", random_bytes(rng, 4096)),
        ("gzip_2_bytes", b"gzip", b"\x1f\x8b"),
        ("gzip_header_only", b"gzip", gzip.compress(body, mtime=0)[:10]),
        ("gzip_truncated", b"gzip", (z := gzip.compress(body, mtime=0))[: rng.randrange(1, len(z))]),
        ("gzip_mutated", b"gzip", mutate_bytes(rng, gzip.compress(body, mtime=0))),
        ("gzip_bad_crc", b"gzip", gzip.compress(body, mtime=0)[:-8] + rng.randbytes(8)),
        ("gzip_twice", b"gzip", gzip.compress(gzip.compress(body, mtime=0), mtime=0)),
        ("gzip_trailing_garbage", b"gzip", gzip.compress(body, mtime=0) + rng.randbytes(rng.randint(1, 64))),
        ("deflate_random", b"deflate", random_bytes(rng, 4096)),
        ("deflate_raw", b"deflate", zlib.compress(body)[2:-4]),
        ("gzip_of_plain_declared_other", rng.choice(ENCODINGS), gzip.compress(body, mtime=0)),
        ("plain_declared_encoding", rng.choice(ENCODINGS), body),
        ("gzip_bomb", b"gzip", gzip_bomb()) if rng.random() < 0.05 else ("gzip_empty", b"gzip", b""),
    ]
    kind, encoding, data = rng.choice(choices)
    case.body = data
    case.set_header(b"Content-Encoding", encoding)
    return kind


def odd_headers(rng: random.Random, case: Case) -> str:
    choices = [
        ("auth_missing", lambda: case.set_header(b"Authorization", None)),
        ("auth_wrong", lambda: case.set_header(b"Authorization", b"Bearer wrong")),
        ("auth_non_utf8", lambda: case.set_header(b"Authorization", b"Bearer \xff\xfe\x80" + rng.randbytes(4))),
        ("auth_latin1", lambda: case.set_header(b"Authorization", b"Bearer fuzz-t\xf6ken")),
        ("auth_basic", lambda: case.set_header(b"Authorization", b"Basic Zm9vOmJhcg==")),
        ("auth_empty_bearer", lambda: case.set_header(b"Authorization", b"Bearer ")),
        ("auth_huge", lambda: case.set_header(b"Authorization", b"Bearer " + b"A" * rng.choice([1000, 8000, 20000]))),
        ("traceparent_junk", lambda: case.set_header(b"traceparent", rng.choice(TRACEPARENTS))),
        ("header_huge", lambda: case.headers.append((b"X-Fuzz", b"x" * rng.choice([4000, 9000, 70000])))),
        ("header_many", lambda: case.headers.extend((b"X-F%d" % i, b"1") for i in range(rng.choice([50, 200])))),
        (
            "header_non_utf8",
            lambda: case.headers.append((b"X-Fuzz", rng.randbytes(16).replace(b"\r", b"").replace(b"\n", b""))),
        ),
        ("header_odd_name", lambda: case.headers.append((b"X-\xff\xfe", b"1"))),
        ("content_type_twice", lambda: case.headers.append((b"Content-Type", rng.choice(CONTENT_TYPES)))),
        ("origin_foreign", lambda: case.headers.append((b"Origin", b"http://evil.example"))),
    ]
    kind, apply = rng.choice(choices)
    apply()
    return kind


TRACEPARENTS = [
    b"00-" + b"0" * 32 + b"-" + b"0" * 16 + b"-01",
    b"zz",
    b"00-abc-def-01",
    b"\xff",
    b"-" * 55,
    b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    b"00-" + b"g" * 32 + b"-" + b"1" * 16 + b"-01",
    b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
    b"0" * 10000,
]


def framing(rng: random.Random, case: Case) -> str:
    roll = rng.random()
    if roll < 0.35:
        size = len(case.body)
        case.body = (b"%x\r\n" % size + case.body + b"\r\n0\r\n\r\n") if size else b"0\r\n\r\n"
        case.set_header(b"Transfer-Encoding", b"chunked")
        return "chunked"
    if roll < 0.6:
        case.body = b"zz\r\n" + case.body + b"\r\n0\r\n\r\n"
        case.set_header(b"Transfer-Encoding", b"chunked")
        return "chunked_bad_size"
    if roll < 0.8:
        case.declared_length = max(0, len(case.body) - rng.randint(1, 64))
        return "content_length_short"
    if roll < 0.9:
        case.set_header(b"Content-Length", b"-1")
        case.declared_length = -1
        return "content_length_negative"
    # Declares far more than it sends: a server that checks Content-Length answers 413 at once; one that
    # reads first waits for bytes that never come (a slow client holding a connection).
    case.declared_length = 100 * 1024 * 1024
    return "content_length_100mb_body_short"


def http_variant(rng: random.Random, case: Case) -> str:
    """Spoil ``case`` at the HTTP level; returns what was done."""
    roll = rng.random()
    if roll < 0.18:
        case.method = rng.choice(METHODS)
        return f"method:{case.method!r}"
    if roll < 0.34:
        case.set_header(b"Content-Type", rng.choice(CONTENT_TYPES) if rng.random() < 0.9 else None)
        return "content_type"
    if roll < 0.6:
        return f"encoding:{bad_encoding(rng, case)}"
    if roll < 0.85:
        return f"header:{odd_headers(rng, case)}"
    if roll < 0.96:
        return f"framing:{framing(rng, case)}"
    case.path = case.path + rng.choice(["?", "?a=%ff", "/", "//", "?x=" + "y" * 9000, "#f", "%00", "/../healthz"])
    return "path_suffix"


def base_headers(content_type: bytes, token: str) -> list[tuple[bytes, bytes]]:
    return [(b"Content-Type", content_type), (b"Authorization", f"Bearer {token}".encode())]


# --- LLM -----------------------------------------------------------------------------------------------------
CHAT_BODIES: list[dict[str, Any]] = [
    {"model": "fulmen", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2},
    {
        "model": "fulmen",
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "n": 2,
        "seed": 1,
        "stop": ["\n", "x"],
        "logprobs": True,
        "top_logprobs": 2,
        "stream": False,
        "user": "u1",
    },
    {
        "model": "fulmen",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    {
        "model": "fulmen",
        "max_completion_tokens": 2,
        "tool_choice": "auto",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "d",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    },
]
COMPLETION_BODIES: list[dict[str, Any]] = [
    {"model": "fulmen", "prompt": "Hello", "max_tokens": 2},
    {
        "model": "fulmen",
        "prompt": "Hi there",
        "max_tokens": 2,
        "temperature": 0.5,
        "n": 2,
        "logprobs": 2,
        "echo": True,
        "seed": 3,
        "stop": "\n",
        "stream": False,
    },
    {
        "model": "fulmen",
        "prompt": [72, 105, 33],
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
]
LLM_NUMBERS = [0, -1, 1, 3, 20, 21, 128, 4096, 2**31, 2**63 - 1, 2**63, 2**64, 10**20, -(2**63)]
ROLLOUT_IDS = [
    "r1",
    "a" * 128,
    "a" * 129,
    "",
    "..",
    ".",
    "%2e%2e",
    "a%2Fb",
    "%00",
    "%ff",
    "%ED%A0%80",
    "\u00e9",
    "\u4e2d",
    "a b",
    "a%20b",
    "x" * 5000,
    "x" * 9000,
    "-",
    ":",
    "r;1",
    "r?1",
    "r#1",
    "{id}",
    "\x7f",
]
ATTEMPTS = [
    "1",
    "2",
    "0",
    "-1",
    "01",
    "1.0",
    "1e3",
    "",
    "99999999999999999999999",
    "\u00b2",
    "\u2460",
    "\u0663",
    "\uff11",
    "1 ",
    "%31",
    "0x1",
    "+1",
    "9" * 5000,
    "NaN",
    "1%00",
]


def good_llm(endpoint: str, token: str) -> Case:
    if endpoint == "llm_completions":
        path, body = "/v1/completions", {"model": "fulmen", "prompt": "Hello", "max_tokens": 2}
    else:
        path = "/rollout/good-1/attempt/1/v1/chat/completions" if endpoint == "llm_rollout_paths" else ""
        path, body = path or "/v1/chat/completions", CHAT_BODIES[0]
    return Case("good", "POST", path, json.dumps(body).encode(), base_headers(b"application/json", token))


def llm_case(rng: random.Random, endpoint: str, target: Target) -> Case:
    """One input for ``llm_chat``, ``llm_completions`` or ``llm_rollout_paths``."""
    completion = endpoint == "llm_completions"
    template = rng.choice(COMPLETION_BODIES if completion else CHAT_BODIES)
    path = "/v1/completions" if completion else "/v1/chat/completions"
    case = Case("", "POST", path, dumps(template), base_headers(b"application/json", target.token))
    parts = []
    if endpoint == "llm_rollout_paths":
        rid = (
            rng.choice(ROLLOUT_IDS) if rng.random() < 0.7 else "".join(rng.choice("aZ9._:-/%\u00e9") for _ in range(8))
        )
        attempt = rng.choice(ATTEMPTS)
        tail = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/chat/completions/", "/v1/x"])
        case.path = f"/rollout/{rid}/attempt/{attempt}{tail}"
        parts.append("path")
        if rng.random() < 0.6:
            case.kind = "rollout_path"
            return case
    roll = rng.random()
    if roll < 0.06:
        case.body, kind = random_bytes(rng), "random_bytes"
    elif roll < 0.75:
        kind, case.body = json_variant(rng, template, LLM_NUMBERS)
    else:
        kind = "http:" + http_variant(rng, case)
    case.kind = "+".join([*parts, kind])
    return case


# --- OTLP ----------------------------------------------------------------------------------------------------
def otlp_json_document(rng: random.Random) -> dict[str, Any]:
    now = 1_700_000_000_000_000_000 + rng.randrange(10**12)
    attributes = [
        {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
        {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "12"}},
        {"key": "fulmen.reward", "value": {"doubleValue": 0.5}},
        {"key": "flag", "value": {"boolValue": True}},
        {"key": "ids", "value": {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": 2}]}}},
        {"key": "map", "value": {"kvlistValue": {"values": [{"key": "k", "value": {"stringValue": "v"}}]}}},
        {"key": "blob", "value": {"bytesValue": "AAEC"}},
    ]
    span = {
        "traceId": rng.randbytes(16).hex(),
        "spanId": rng.randbytes(8).hex(),
        "parentSpanId": "",
        "name": "chat fuzz",
        "kind": 3,
        "startTimeUnixNano": str(now),
        "endTimeUnixNano": str(now + 5_000_000),
        "attributes": attributes,
        "status": {"code": 1, "message": ""},
        "traceState": "",
        "events": [
            {"timeUnixNano": str(now), "name": "e", "attributes": [{"key": "a", "value": {"stringValue": "b"}}]}
        ],
        "links": [{"traceId": rng.randbytes(16).hex(), "spanId": rng.randbytes(8).hex(), "attributes": []}],
    }
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "fuzz"}}]},
                "scopeSpans": [{"scope": {"name": "fuzz", "version": "1"}, "spans": [span]}],
            }
        ]
    }


def good_otlp(endpoint: str, token: str, rng: random.Random | None = None) -> Case:
    """A valid export (fresh ids each time unless ``rng`` is given)."""
    rng = rng or random.Random()
    if endpoint == "otlp_json":
        return Case(
            "good", "POST", "/v1/traces", dumps(otlp_json_document(rng)), base_headers(b"application/json", token)
        )
    from bench.fuzz_otlp import protobuf_body

    return Case("good", "POST", "/v1/traces", protobuf_body(rng), base_headers(b"application/x-protobuf", token))


OTLP_NUMBERS = [0, -1, 2**63, 2**64 - 1, 2**64, 10**25, 99]


def otlp_case(rng: random.Random, endpoint: str, target: Target) -> Case:
    """One input for ``otlp_protobuf`` or ``otlp_json`` (gzip variants included)."""
    from bench.fuzz_otlp import protobuf_variant

    as_json = endpoint == "otlp_json"
    content_type = b"application/json" if as_json else b"application/x-protobuf"
    case = Case("", "POST", "/v1/traces", b"", base_headers(content_type, target.token))
    roll = rng.random()
    if roll < 0.07:
        case.body, kind = random_bytes(rng), "random_bytes"
    elif as_json and roll < 0.75:
        kind, case.body = json_variant(rng, otlp_json_document(rng), OTLP_NUMBERS)
    elif roll < 0.75:
        kind, case.body = protobuf_variant(rng)
    else:  # framing spoils the bytes on the wire: compress first (a Content-Length declared short of the
        # uncompressed body was longer than the gzip one, so the server rightly waited for bytes never sent)
        case.body = good_otlp(endpoint, target.token, rng).body
        gzipped = _maybe_gzip(rng, case)
        case.kind = "http:" + http_variant(rng, case) + gzipped
        return case
    case.kind = kind + _maybe_gzip(rng, case)
    return case


def _maybe_gzip(rng: random.Random, case: Case) -> str:
    """Gzip ``case``'s body 15% of the time (mtime 0, so ``--replay`` gives the same bytes); the kind's suffix."""
    if case.header(b"Content-Encoding") or rng.random() >= 0.15:
        return ""
    case.body = gzip.compress(case.body, compresslevel=1, mtime=0)
    case.set_header(b"Content-Encoding", b"gzip")
    return "+gzip"
