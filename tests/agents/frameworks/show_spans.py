"""Print the span tree one framework agent produces, run as the runner runs it, against the fake OpenAI server.

Usage: ``python -m tests.agents.frameworks.show_spans {langgraph|openai_agents|autogen} [script] [--stream]``
(``script``: a name from ``fake_openai.SCRIPTS``, default ``tool_then_text``). Prints each span as
``name kind=... scope=...`` with its attributes (values cut at 300 characters), children indented under their
parent, then each request the server got (path, whether it carried ``traceparent``). The report in this
package's ``__init__`` was read off this output.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fulmen.producers.runner.agent import LLMEndpoint, call_agent
from fulmen.producers.runner.tracing import CURRENT_ROLLOUT, build_tracer_provider
from fulmen.schemas.events import RolloutRequest
from tests.agents.frameworks import autogen_agent, langgraph_agent, openai_agents_agent
from tests.agents.frameworks.fake_openai import SCRIPTS, FakeOpenAI

__all__ = ["AGENTS", "format_tree", "main"]


AGENTS: dict[str, Callable[..., Any]] = {
    "langgraph": langgraph_agent.write_check_rewrite,
    "openai_agents": openai_agents_agent.add_numbers,
    "autogen": autogen_agent.multiply_numbers,
}


def format_tree(spans: list[ReadableSpan], width: int = 300) -> list[str]:
    """One line per span and per attribute, children (by start time) indented under their parent."""
    by_id = {s.context.span_id: s for s in spans}
    lines: list[str] = []

    def visit(span: ReadableSpan, depth: int) -> None:
        pad = "  " * depth
        lines.append(
            f"{pad}- {span.name!r} kind={span.kind.name} status={span.status.status_code.name} "
            f"scope={span.instrumentation_scope.name if span.instrumentation_scope else None}"
        )
        lines.extend(f"{pad}    {key} = {repr(value)[:width]}" for key, value in (span.attributes or {}).items())
        children = [c for c in spans if c.parent is not None and c.parent.span_id == span.context.span_id]
        for child in sorted(children, key=lambda c: c.start_time or 0):
            visit(child, depth + 1)

    for span in spans:
        if span.parent is None or span.parent.span_id not in by_id:
            visit(span, 0)
    return lines


async def _run(framework: str, script: str, stream: bool) -> list[str]:
    memory = InMemorySpanExporter()
    build_tracer_provider(None).add_span_processor(SimpleSpanProcessor(memory))
    request = RolloutRequest(rollout_id="r1", task_id="task", group_id="group", input={"stream": stream})
    with FakeOpenAI(script) as server:
        token = CURRENT_ROLLOUT.set(request)
        try:
            with trace.get_tracer("fulmen.runner").start_as_current_span("rollout"):
                llm = LLMEndpoint(server.url("/rollout/r1/attempt/1"), "tiny")
                reward = await call_agent(AGENTS[framework], request.input, llm)
        finally:
            CURRENT_ROLLOUT.reset(token)
        requests = [f"request {r.path} traceparent={'traceparent' in r.headers}" for r in server.chat_requests()]
    return [f"reward {reward}", *format_tree(list(memory.get_finished_spans())), *requests]


def main(argv: list[str]) -> int:
    """The command line (see the module docstring); 2 on a wrong argument."""
    args = [a for a in argv if a != "--stream"]
    if not args or args[0] not in AGENTS or (len(args) > 1 and args[1] not in SCRIPTS):
        sys.stderr.write(f"usage: show_spans {{{'|'.join(AGENTS)}}} [{'|'.join(SCRIPTS)}] [--stream]\n")
        return 2
    for line in asyncio.run(_run(args[0], args[1] if len(args) > 1 else "tool_then_text", "--stream" in argv)):
        sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
