"""Prompt bundles (issue 29): content ids, fingerprint and template slots, placeholder validation, apply."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from fulmen.consumers.event_sinks import rollout_rows, transition_rows
from fulmen.consumers.transitions.builder import BuildOptions, build_batch
from fulmen.schemas import PromotionAction, semconv
from fulmen.schemas.prompts import (
    InvalidPromptError,
    PromptBundle,
    PromptPromotion,
    apply,
    bundle_id,
    fingerprint,
    rollback_target,
    serving_bundle,
    validate_candidate,
    validate_slot_text,
)
from tests.unit.test_transition_builder import ended, three_calls_with_a_reward

SYSTEM = "You are a helpful assistant.\n  Answer briefly."
TEMPLATE = "Question: {question}\nContext: {context}"


def test_the_id_is_a_content_hash_independent_of_order_and_metadata() -> None:
    a = PromptBundle.create({"fp-aaaaaaaaaaaa": "x", "fp-bbbbbbbbbbbb": "y"}, source="gepa", parents=["p"])
    b = PromptBundle.create({"fp-bbbbbbbbbbbb": "y", "fp-aaaaaaaaaaaa": "x"})
    c = PromptBundle.create({"fp-aaaaaaaaaaaa": "x", "fp-bbbbbbbbbbbb": "z"})
    assert a.bundle_id == b.bundle_id == bundle_id({"fp-aaaaaaaaaaaa": "x", "fp-bbbbbbbbbbbb": "y"})
    assert a.bundle_id != c.bundle_id
    assert a.bundle_id.startswith("pb-") and len(a.bundle_id) == 15
    assert PromptBundle.model_validate_json(a.model_dump_json()) == a


def test_a_bundle_whose_id_does_not_match_its_content_is_refused() -> None:
    good = PromptBundle.create({"fp-aaaaaaaaaaaa": "x"})
    with pytest.raises(ValidationError, match="does not match its content"):
        PromptBundle(bundle_id=good.bundle_id, slots={"fp-aaaaaaaaaaaa": "other"})
    with pytest.raises(ValidationError, match="neither a fingerprint slot"):
        PromptBundle.create({"system": "x"})
    with pytest.raises(ValidationError, match="original template of slot tpl:q is missing"):
        PromptBundle.create({"tpl:q": "Q: {question}"})


def test_a_fingerprint_ignores_whitespace_but_not_role_or_words() -> None:
    assert fingerprint("system", SYSTEM) == fingerprint("system", "You are a helpful assistant. Answer briefly. ")
    assert fingerprint("system", SYSTEM) != fingerprint("user", SYSTEM)
    assert fingerprint("system", SYSTEM) != fingerprint("system", "You are a helpful assistant.")


def test_a_fingerprint_slot_replaces_the_matching_message_only() -> None:
    slot = fingerprint("system", SYSTEM)
    bundle = PromptBundle.create({slot: "Answer with a number only."})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": SYSTEM}]
    new, applied = apply(bundle, messages)
    assert applied == [slot]
    assert new == [{"role": "system", "content": "Answer with a number only."}, messages[1]]
    assert messages[0]["content"] == SYSTEM  # the input is not modified


def test_nothing_matching_leaves_the_messages_unchanged() -> None:
    bundle = PromptBundle.create(
        {fingerprint("system", "other"): "new", "tpl:q": "Ask {x}"}, templates={"q": "Q: {x}!"}
    )
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Q: 1"},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    new, applied = apply(bundle, messages)
    assert (new, applied) == (messages, [])


def test_a_template_slot_captures_the_values_and_renders_the_candidate() -> None:
    bundle = PromptBundle.create(
        {"tpl:ask": "Context first: {context}\nNow answer: {question}\nUse {{units}}."}, templates={"ask": TEMPLATE}
    )
    text = TEMPLATE.format(question="What is 2+2?", context="line one\nline two")
    new, applied = apply(bundle, [{"role": "user", "content": text}])
    assert applied == ["tpl:ask"]
    assert new[0]["content"] == "Context first: line one\nline two\nNow answer: What is 2+2?\nUse {units}."


def test_a_repeated_placeholder_must_capture_the_same_text() -> None:
    bundle = PromptBundle.create({"tpl:t": "<{a}>"}, templates={"t": "{a} and {a}"})
    assert apply(bundle, [{"role": "user", "content": "x and x"}])[0][0]["content"] == "<x>"
    assert apply(bundle, [{"role": "user", "content": "x and y"}])[1] == []


def test_a_candidate_that_drops_or_adds_placeholders_is_refused() -> None:
    parent = PromptBundle.create({"tpl:ask": TEMPLATE}, templates={"ask": TEMPLATE})
    validate_candidate(parent, {"tpl:ask": "{context} -> {question}?"})
    with pytest.raises(InvalidPromptError, match=r"drops \{context\}"):
        validate_candidate(parent, {"tpl:ask": "Answer {question}"})
    with pytest.raises(InvalidPromptError, match=r"adds \{hint\}"):
        validate_candidate(parent, {"tpl:ask": "{question} {context} {hint}"})
    with pytest.raises(InvalidPromptError, match="not a slot of the parent"):
        validate_candidate(parent, {"fp-aaaaaaaaaaaa": "x"})
    with pytest.raises(InvalidPromptError, match="plain name"):
        validate_slot_text("tpl:ask", TEMPLATE, "{question.__class__} {context}")
    with pytest.raises(InvalidPromptError, match="empty"):
        validate_slot_text("fp-aaaaaaaaaaaa", "", "  ")
    with pytest.raises(ValidationError, match="drops"):
        PromptBundle.create({"tpl:ask": "{question}"}, templates={"ask": TEMPLATE})


def test_content_given_as_text_parts_is_matched_and_kept_as_parts() -> None:
    slot = fingerprint("system", SYSTEM)
    bundle = PromptBundle.create({slot: "new system"})
    parts = [{"type": "text", "text": "You are a helpful assistant."}, {"type": "text", "text": "\n  Answer briefly."}]
    new, applied = apply(bundle, [{"role": "system", "content": parts}])
    assert applied == [slot]
    assert new[0]["content"] == [{"type": "text", "text": "new system"}]
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert apply(bundle, [{"role": "system", "content": image}]) == ([{"role": "system", "content": image}], [])


def test_a_transition_and_its_row_record_the_bundle_its_call_was_served_with() -> None:
    spans = three_calls_with_a_reward()
    spans[2] = dataclasses.replace(spans[2], attributes={semconv.PROMPT_BUNDLE: "pb-0123456789ab"})
    batch = build_batch(ended(), spans, BuildOptions()).batch
    assert [t.prompt_bundle for t in batch.transitions] == ["pb-0123456789ab", "", ""]
    assert [row["PromptBundle"] for row in transition_rows(batch)] == ["pb-0123456789ab", "", ""]
    assert rollout_rows(ended(prompt_bundle="pb-0123456789ab"))[0]["PromptBundle"] == "pb-0123456789ab"
    assert rollout_rows(ended())[0]["PromptBundle"] == ""


def test_the_bundle_in_force_per_scope_and_what_a_rollback_goes_back_to() -> None:
    a, b = "pb-aaaaaaaaaaaa", "pb-bbbbbbbbbbbb"
    promote, rollback = PromotionAction.PROMOTE, PromotionAction.ROLLBACK
    history = [
        PromptPromotion(action=promote, bundle_id=a),
        PromptPromotion(action=promote, bundle_id=b, previous=a),
        PromptPromotion(action=promote, bundle_id=b, agent="solver"),
    ]
    assert (serving_bundle(history, None), serving_bundle(history, "solver"), serving_bundle(history, "other")) == (
        b,
        b,
        b,
    )
    assert rollback_target(history, None) == a and rollback_target(history, "solver") == ""
    history.append(PromptPromotion(action=rollback, bundle_id=a, previous=b))
    assert (serving_bundle(history, None), serving_bundle(history, "solver")) == (a, b)  # an agent's own scope wins
    assert rollback_target(history[-1:], None) == b  # history compacted away: the event's own ``previous``
    with pytest.raises(InvalidPromptError, match="nothing to roll back"):
        rollback_target(history, "other")
    with pytest.raises(ValidationError, match="promote or rollback"):
        PromptPromotion(action=PromotionAction.REJECT, bundle_id=a)
    assert PromptPromotion(action=promote, bundle_id=a).topic_key == "*"
