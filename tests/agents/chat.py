"""Agents that talk to the LLM gateway with the official ``openai`` client, as a user's agent would."""

from __future__ import annotations

import threading

from openai import OpenAI

_instrumented = False
_lock = threading.Lock()


def ask(task: dict, llm) -> float:
    """One chat call with the task's question; reward 1.0 when the model answered anything."""
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    response = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": task["question"]}],
        max_tokens=12,
        temperature=1.0,
    )
    return 1.0 if response.choices[0].message.content is not None else 0.0


def ask_instrumented(task: dict, llm) -> float:
    """The same agent traced by the OpenTelemetry instrumentation of the openai client."""
    global _instrumented
    with _lock:
        if not _instrumented:
            from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

            OpenAIInstrumentor().instrument()
            _instrumented = True
    return ask(task, llm)


def ask_twice_and_rate_the_first(task: dict, llm) -> float:
    """Two chat calls, then a judge rates the FIRST answer, after both, with the stock OpenTelemetry API: a
    ``gen_ai.evaluation.result`` event (the gen_ai semantic conventions) naming the response it rates by
    ``gen_ai.response.id``, on a span of its own."""
    from opentelemetry import trace

    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(model=llm.model, messages=messages, max_tokens=6)
    client.chat.completions.create(model=llm.model, messages=messages, max_tokens=6)
    with trace.get_tracer("tests.judge").start_as_current_span("judge") as span:
        span.add_event(
            "gen_ai.evaluation.result",
            {
                "gen_ai.evaluation.name": "helpfulness",
                "gen_ai.evaluation.score.value": float(task["score"]),
                "gen_ai.response.id": first.id,
            },
        )
    return 1.0
