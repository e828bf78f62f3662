"""Prompt bundles: immutable, content-hashed maps from prompt slots to texts, and how one rewrites a chat request.

A bundle changes what an agent's model sees without changing the agent: the LLM gateway applies it to each call
before tokenising (issue 29). A slot is one of two kinds:

- a **fingerprint slot** ``fp-<12 hex>`` names a message an agent already sends, by :func:`fingerprint` of its
  role and its whitespace-normalised text (``fulmen prompts scan`` lists them from stored spans). A message whose
  role and text match is given the slot's text instead.
- a **template slot** ``tpl:<name>`` names a message built from a template with ``{placeholder}`` fields. The
  bundle keeps the *original* template in ``templates[name]`` (the text the agent's code formats); a message that
  matches it in full (each placeholder captures any text) is given the slot's template rendered with the
  captured values. A candidate template must use exactly the original's placeholders
  (:func:`validate_candidate`), so no value the agent supplies is dropped and none is invented.

The bundle id is a hash over the slots and the original templates (canonical JSON, sorted keys): the same
content gives the same id wherever and however often it is built, so publishing a bundle twice is harmless.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from fulmen.schemas.errors import PoisonInputError
from fulmen.schemas.events import BundleIdentifier, Event, PromotionAction, UtcDatetime, utc_now

__all__ = [
    "FINGERPRINT_PREFIX",
    "GLOBAL_SCOPE",
    "TEMPLATE_PREFIX",
    "InvalidPromptError",
    "PromptBundle",
    "PromptPromotion",
    "apply",
    "bundle_id",
    "fingerprint",
    "in_force",
    "message_text",
    "normalise",
    "placeholders",
    "rollback_target",
    "serving_bundle",
    "validate_candidate",
    "validate_slot_text",
]

FINGERPRINT_PREFIX = "fp-"
TEMPLATE_PREFIX = "tpl:"
_FINGERPRINT = re.compile(r"^fp-[0-9a-f]{12}$")
_TEMPLATE = re.compile(r"^tpl:[A-Za-z0-9._\-]{1,100}$")
_PLACEHOLDER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_WHITESPACE = re.compile(r"\s+")
_TEXT_PARTS = ("text", "input_text")


class InvalidPromptError(PoisonInputError):
    """A bundle, slot or candidate text that can never be applied (bad slot name, placeholders changed)."""


def normalise(text: str) -> str:
    """The text with every run of whitespace made one space and the ends stripped (what a fingerprint hashes)."""
    return _WHITESPACE.sub(" ", text).strip()


def fingerprint(role: str, text: str) -> str:
    """The slot name of a message an agent sends: ``fp-`` and 12 hex digits of sha256 over role and normalised
    text, so a reformatted copy of the same prompt (other line breaks or indentation) has the same name."""
    digest = hashlib.sha256(f"{role}\n{normalise(text)}".encode()).hexdigest()
    return f"{FINGERPRINT_PREFIX}{digest[:12]}"


def bundle_id(slots: Mapping[str, str], templates: Mapping[str, str] | None = None) -> str:
    """``pb-`` and 12 hex digits of sha256 over the canonical JSON of the slots and the original templates."""
    blob = json.dumps(
        {"slots": dict(sorted(slots.items())), "templates": dict(sorted((templates or {}).items()))},
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return "pb-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def placeholders(template: str) -> list[str]:
    """The ``{placeholder}`` names of ``template`` in order of first use (``{{`` and ``}}`` are literal braces).

    Raises :class:`InvalidPromptError` for a field that is not a plain name (``{}``, ``{0}``, ``{a.b}``, a format
    spec or a conversion) or for unbalanced braces: the gateway renders templates itself and only names are safe.
    """
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise InvalidPromptError(f"template: {exc} (write a literal brace as {{{{ or }}}})") from exc
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if not _PLACEHOLDER.match(name) or spec or conversion:
            shown = "{" + name + ("!" + conversion if conversion else "") + (":" + spec if spec else "") + "}"
            raise InvalidPromptError(f"template: placeholder {shown} must be a plain name such as {{question}}")
        if name not in names:
            names.append(name)
    return names


def _render(template: str, values: Mapping[str, str]) -> str:
    parts = []
    for literal, name, _spec, _conversion in string.Formatter().parse(template):
        parts.append(literal)
        if name is not None:
            parts.append(values[name])
    return "".join(parts)


def _pattern(template: str) -> re.Pattern[str]:
    """A regex that matches a text formatted from ``template``: literals exact, each placeholder any text (lazy),
    a repeated placeholder the same text again."""
    seen: set[str] = set()
    parts = []
    for literal, name, _spec, _conversion in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if name is None:
            continue
        parts.append(f"(?P={name})" if name in seen else f"(?P<{name}>.*?)")
        seen.add(name)
    return re.compile("".join(parts), re.DOTALL)


def validate_slot_text(slot: str, original: str, candidate: str) -> None:
    """Refuse a candidate text for ``slot`` that cannot replace ``original``: for a template slot the candidate
    must use exactly the original's placeholders; a fingerprint slot takes any non-empty text."""
    if not candidate.strip():
        raise InvalidPromptError(f"slot {slot}: the candidate text is empty")
    if not slot.startswith(TEMPLATE_PREFIX):
        return
    before, after = set(placeholders(original)), set(placeholders(candidate))
    dropped, added = sorted(before - after), sorted(after - before)
    if dropped or added:
        what = "; ".join(
            x
            for x in (
                f"drops {{{'}, {'.join(dropped)}}}" if dropped else "",
                f"adds {{{'}, {'.join(added)}}}" if added else "",
            )
            if x
        )
        raise InvalidPromptError(
            f"slot {slot}: the candidate template {what}; it must use exactly the placeholders of the original "
            f"({', '.join('{' + n + '}' for n in sorted(before)) or 'none'})"
        )


class PromptBundle(Event):
    """An immutable set of prompt texts; published to the compacted prompts topic keyed by ``bundle_id``.

    ``slots`` maps slot names (``fp-…`` or ``tpl:<name>``) to texts; ``templates`` maps each template slot's name
    (without ``tpl:``) to the original template the agent formats. ``parents`` are the bundles it was derived
    from, ``scores`` the per-validation-task scores that chose it (empty when made by hand), ``agent`` the agent
    it is meant for (None: any), ``source`` what made it (``manual``, ``gepa``, ``beam``), ``run_id`` the search
    run. Build one with :meth:`create`, which computes the id; a bundle whose id does not match its content is
    refused.
    """

    schema_version: Literal[1] = 1
    bundle_id: BundleIdentifier
    slots: dict[str, str] = Field(min_length=1)
    templates: dict[str, str] = Field(default_factory=dict)
    parents: list[str] = Field(default_factory=list)
    scores: dict[str, float] = Field(default_factory=dict)
    agent: str | None = None
    source: str = Field(default="manual", max_length=64)
    run_id: str = ""
    created_at: UtcDatetime = Field(default_factory=utc_now)

    @classmethod
    def create(
        cls,
        slots: Mapping[str, str],
        *,
        templates: Mapping[str, str] | None = None,
        parents: Sequence[str] = (),
        scores: Mapping[str, float] | None = None,
        agent: str | None = None,
        source: str = "manual",
        run_id: str = "",
    ) -> PromptBundle:
        """A bundle of these texts, its id computed from ``slots`` and ``templates``."""
        return cls(
            bundle_id=bundle_id(slots, templates),
            slots=dict(slots),
            templates=dict(templates or {}),
            parents=list(parents),
            scores=dict(scores or {}),
            agent=agent,
            source=source,
            run_id=run_id,
        )

    @model_validator(mode="after")
    def _consistent(self) -> PromptBundle:
        for slot, text in self.slots.items():
            if _FINGERPRINT.match(slot):
                continue
            if not _TEMPLATE.match(slot):
                raise ValueError(
                    f"slots: {slot!r} is neither a fingerprint slot (fp-<12 hex>, see `fulmen prompts scan`) nor a "
                    "template slot (tpl:<name>)"
                )
            original = self.templates.get(slot[len(TEMPLATE_PREFIX) :])
            if original is None:
                raise ValueError(f"templates: the original template of slot {slot} is missing")
            try:
                validate_slot_text(slot, original, text)
            except InvalidPromptError as exc:
                raise ValueError(exc.message) from exc
        expected = bundle_id(self.slots, self.templates)
        if self.bundle_id != expected:
            raise ValueError(f"bundle_id: {self.bundle_id} does not match its content (expected {expected})")
        return self

    @property
    def topic_key(self) -> str:
        return self.bundle_id


GLOBAL_SCOPE = "*"
"""The promotions topic key of a bundle promoted for every agent (``agent`` None)."""


class PromptPromotion(Event):
    """Which bundle serves the calls that name none; published to the compacted prompt promotions topic, keyed by
    the agent scope (:attr:`topic_key`: the agent's name, or ``*`` for every agent), so compaction keeps the one in
    force per scope.

    ``action`` is ``promote`` or ``rollback`` (a bundle is never "rejected": a search simply does not promote it).
    ``bundle_id`` is the bundle that serves from now on; ``""`` means the agent's own prompts (a rollback past the
    first promotion). ``previous`` is the bundle that served in this scope before (``""``: the agent's own), so a
    rollback knows where to go even after compaction dropped the history. A call whose agent has a promotion of its
    own gets that bundle; any other call gets the global one.
    """

    schema_version: Literal[1] = 1
    action: PromotionAction
    bundle_id: str = Field(default="", max_length=128, pattern=r"^(pb-[0-9a-f]{12})?$")
    agent: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")
    previous: str = Field(default="", max_length=128, pattern=r"^(pb-[0-9a-f]{12})?$")
    reason: str = Field(default="", max_length=1024)
    created_at: UtcDatetime = Field(default_factory=utc_now)

    @model_validator(mode="after")
    def _serving_action(self) -> PromptPromotion:
        if self.action is PromotionAction.REJECT:
            raise ValueError("action: a prompt promotion is promote or rollback")
        return self

    @property
    def topic_key(self) -> str:
        return self.agent or GLOBAL_SCOPE


def in_force(promotions: Sequence[PromptPromotion], agent: str | None) -> PromptPromotion | None:
    """The latest promotion of exactly this scope among ``promotions`` (topic order); None: never promoted."""
    found = None
    for event in promotions:
        if event.agent == agent:
            found = event
    return found


def serving_bundle(promotions: Sequence[PromptPromotion], agent: str | None) -> str:
    """The bundle a call of ``agent`` gets when it names none: its own scope's bundle in force if the agent has a
    promotion, else the global one; ``""``: the agent's own prompts."""
    own = in_force(promotions, agent) if agent else None
    chosen = own if own is not None else in_force(promotions, None)
    return chosen.bundle_id if chosen is not None else ""


def rollback_target(promotions: Sequence[PromptPromotion], agent: str | None) -> str:
    """What a rollback of ``agent``'s scope goes back to: the bundle that served in the scope before the one in
    force (``""``, the agent's own prompts, when none other did). InvalidPromptError when nothing is in force."""
    history = [event for event in promotions if event.agent == agent]
    scope = f"agent {agent}" if agent else "every agent"
    if not history or not history[-1].bundle_id:
        raise InvalidPromptError(f"no bundle is promoted for {scope}: there is nothing to roll back")
    current = history[-1].bundle_id
    for event in reversed(history[:-1]):
        if event.bundle_id != current:
            return event.bundle_id
    return history[-1].previous if history[-1].previous != current else ""


def validate_candidate(parent: PromptBundle, child_slots: Mapping[str, str]) -> None:
    """Refuse a child's slots that the parent's originals cannot take: an unknown slot, or a template whose
    placeholders differ from the original's. Raises :class:`InvalidPromptError` naming the slot."""
    for slot, text in child_slots.items():
        if slot not in parent.slots:
            raise InvalidPromptError(f"slot {slot}: not a slot of the parent bundle {parent.bundle_id}")
        original = parent.templates.get(slot[len(TEMPLATE_PREFIX) :], "") if slot.startswith(TEMPLATE_PREFIX) else ""
        validate_slot_text(slot, original, text)


def message_text(content: Any) -> str | None:
    """The text of a message's content: a string as is, a list of text parts joined (as the gateway joins them);
    None for no content or a part that is not text (such a message is never substituted)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") not in _TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                return None
            texts.append(part["text"])
        return "".join(texts)
    return None


def _with_text(message: dict[str, Any], text: str) -> dict[str, Any]:
    content = message.get("content")
    new = dict(message)
    new["content"] = [{"type": "text", "text": text}] if isinstance(content, list) else text
    return new


def _substitute(bundle: PromptBundle, role: str, text: str) -> tuple[str, str] | None:
    """The (slot, new text) of the first slot matching this message, or None."""
    slot = fingerprint(role, text)
    if slot in bundle.slots:
        return slot, bundle.slots[slot]
    for name, original in bundle.templates.items():
        slot = TEMPLATE_PREFIX + name
        match = _pattern(original).fullmatch(text)
        if match is not None and slot in bundle.slots:
            return slot, _render(bundle.slots[slot], match.groupdict())
    return None


def apply(bundle: PromptBundle, messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages with each matching slot's text in place of the original, and the slots applied (in message
    order, each once). Messages that match no slot are returned unchanged (copies); the input is not modified."""
    result: list[dict[str, Any]] = []
    applied: list[str] = []
    for message in messages:
        message = dict(message)
        text = message_text(message.get("content"))
        role = message.get("role")
        hit = _substitute(bundle, role, text) if isinstance(role, str) and text is not None else None
        if hit is not None:
            slot, new_text = hit
            message = _with_text(message, new_text)
            if slot not in applied:
                applied.append(slot)
        result.append(message)
    return result, applied
