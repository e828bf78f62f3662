"""Fuzz inputs for the LLM gateway's ``POST /v1/feedback`` and the check that what it accepted reached the topic.

The mix: random bytes; valid requests at the edges of the contract (each kind of target, ids of the longest length,
non-ASCII response ids, values from the smallest subnormal to 1e308 and the 64-bit integers, comments of 4,096
characters), which must all be answered 202; JSON type confusion of every field (``response_id``, ``rollout_id``,
``trace_id``, ``name``, ``value``, ``comment``: other types, NaN and 1e400, lone surrogates, huge strings,
nesting), byte mutations and JSON tricks; bearer tokens close to the right one; odd paths; and the HTTP-level
spoilers of :func:`bench.fuzz_inputs.http_variant` (methods, content types, encodings, headers, framing).

"Nothing lost": every 202 carries a ``feedback_id``; :func:`topic_check` reads the feedback topic to its end and
says which of those ids are missing from it (``lost``) or on it more than once (``doubled``).
"""

from __future__ import annotations

import json
import random
import string
from collections import Counter
from typing import Any

from bench.fuzz_inputs import Case, Target, base_headers, http_variant, json_variant, random_bytes

__all__ = ["FEEDBACK_PATH", "accepted_id", "feedback_case", "good_feedback", "topic_check"]

FEEDBACK_PATH = "/v1/feedback"
FEEDBACK_BODIES: list[dict[str, Any]] = [
    {"response_id": "chatcmpl-0123456789abcdef", "name": "reward", "value": 1.0, "comment": "thumbs up"},
    {"rollout_id": "r-1", "value": -0.5},
    {"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "name": "user.rating", "value": 3, "comment": "ok"},
    {"response_id": "chatcmpl-x", "rollout_id": None, "trace_id": None, "name": None, "value": 0, "comment": None},
]
FEEDBACK_NUMBERS = [0, -1, 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**308, 10**309, -(10**309)]
_IDENTIFIER = string.ascii_letters + string.digits + "._:-"


def good_feedback(token: str) -> Case:
    body = {"response_id": "chatcmpl-good", "name": "reward", "value": 1.0}
    return Case("good", "POST", FEEDBACK_PATH, json.dumps(body).encode(), base_headers(b"application/json", token))


def valid_body(rng: random.Random) -> dict[str, Any]:
    """A request the contract accepts, at its edges: one target of each kind, odd but valid values."""
    kind = rng.choice(["response_id", "rollout_id", "trace_id"])
    if kind == "trace_id":
        target = rng.randbytes(16).hex() if rng.random() < 0.9 else "0" * 31 + "1"
    elif kind == "rollout_id":
        target = "".join(rng.choice(_IDENTIFIER) for _ in range(rng.choice([1, 8, 128])))
    else:  # any text without spaces or control characters, up to 256 characters
        alphabet = "abcXYZ019-_.:/\u00e9\u4e2d\U0001f600\u200b\ufeff\ud7ff\ue000"
        target = "".join(rng.choice(alphabet) for _ in range(rng.choice([1, 12, 256])))
    body: dict[str, Any] = {kind: target}
    body["value"] = rng.choice([0, -0.0, 1, -1, 0.5, 1e308, -1e308, 5e-324, 2**63 - 1, -(2**63), 123456789.125])
    if rng.random() < 0.7:
        body["name"] = "".join(rng.choice(_IDENTIFIER) for _ in range(rng.choice([1, 6, 128])))
    if rng.random() < 0.6:
        comment = rng.choice(["", "\u00e9 \u2713", "a\x00b\tc\nd", "\U0001f600" * 4096, "x" * 4096, "\u202e\ufeff"])
        body["comment"] = comment
    if rng.random() < 0.2:  # null counts as absent
        body.setdefault(rng.choice(["name", "comment", "rollout_id", "trace_id", "response_id"]), None)
    return body


TOKEN_SPOILS = [
    ("missing", None),
    ("lowercase_scheme", b"bearer {t}"),
    ("no_scheme", b"{t}"),
    ("prefix", b"Bearer {t}"),
    ("suffix", b"Bearer {t}x"),
    ("trailing_space", b"Bearer {t} "),
    ("tab", b"Bearer\t{t}"),
    ("two_spaces", b"Bearer  {t}"),
    ("case", b"Bearer {T}"),
    ("nul", b"Bearer {t}\x00"),
    ("non_utf8", b"Bearer {t}\xff"),
    ("empty", b""),
    ("huge", b"Bearer " + b"{t}" * 2000),
]


def spoil_token(rng: random.Random, case: Case, token: str) -> str:
    """The bearer token nearly right (or missing, or sent twice): a 401, never a 202 or a 5xx."""
    if rng.random() < 0.1:
        case.headers.append((b"Authorization", b"Bearer wrong"))  # a second Authorization header
        return "token:twice"
    name, template = rng.choice(TOKEN_SPOILS)
    if template is None:
        case.set_header(b"Authorization", None)
    else:
        value = template.replace(b"{t}", token.encode()).replace(b"{T}", token.upper().encode())
        case.set_header(b"Authorization", value[:-1] if name == "prefix" else value)
    return f"token:{name}"


ODD_PATHS = [
    "/v1/feedback/",
    "/v1/feedback?x=1",
    "/v1//feedback",
    "/V1/FEEDBACK",
    "/v1/feedback%00",
    "/rollout/r1/attempt/1/v1/feedback",
    "/agent/a/v1/feedback",
    "/v1/feedback/" + "x" * 9000,
]


def feedback_case(rng: random.Random, target: Target) -> Case:
    """One input for ``llm_feedback``."""
    template = rng.choice(FEEDBACK_BODIES)
    headers = base_headers(b"application/json", target.token)
    case = Case("", "POST", FEEDBACK_PATH, json.dumps(template).encode(), headers)
    roll = rng.random()
    if roll < 0.05:
        case.body, kind = random_bytes(rng), "random_bytes"
    elif roll < 0.35:
        case.body, kind = json.dumps(valid_body(rng)).encode(), "valid"
    elif roll < 0.75:
        kind, case.body = json_variant(rng, template, FEEDBACK_NUMBERS)
    elif roll < 0.85:
        case.body = json.dumps(valid_body(rng)).encode()
        kind = spoil_token(rng, case, target.token)
    elif roll < 0.9:
        case.path, kind = rng.choice(ODD_PATHS), "path"
    else:
        case.body = json.dumps(valid_body(rng)).encode()
        kind = "http:" + http_variant(rng, case)
    case.kind = kind
    return case


def accepted_id(body: bytes) -> str:
    """The ``feedback_id`` of a 202's body ('' when it has none: counted as lost)."""
    try:
        found = json.loads(body)
    except ValueError:
        return ""
    return found.get("feedback_id", "") if isinstance(found, dict) else ""


async def topic_check(bootstrap: str, accepted: list[str]) -> dict[str, Any]:
    """The feedback topic read to its end against the ids answered 202: ``lost`` (not on it), ``doubled`` (on it
    more than once), ``on_topic_not_accepted`` (no 202 for them: e.g. a 503 whose record reached Kafka anyway)."""
    from fulmen.infra.kafka.read_all import read_to_end
    from fulmen.infra.settings import FulmenSettings
    from fulmen.schemas import Feedback, TopicKey

    events = await read_to_end(FulmenSettings(kafka={"bootstrap": bootstrap}), TopicKey.FEEDBACK, Feedback)
    on_topic = Counter(event.feedback_id for event in events)
    wanted = Counter(accepted)
    lost = sorted(i for i in wanted if on_topic[i] == 0)
    return {
        "accepted": sum(wanted.values()),
        "on_topic": sum(on_topic.values()),
        "lost": len(lost),
        "doubled": sum(1 for i in wanted if on_topic[i] > 1),
        "accepted_twice": sum(1 for n in wanted.values() if n > 1),
        "on_topic_not_accepted": sum(1 for i in on_topic if i not in wanted),
        "lost_sample": lost[:5],
    }
