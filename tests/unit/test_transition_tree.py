"""Trace tree, call selection and reward matching on hand-built rollouts (no services)."""

from __future__ import annotations

import re

from fulmen.consumers.transitions.rewards import match_rewards, observe_rewards
from fulmen.consumers.transitions.selection import agent_of, select_calls
from fulmen.consumers.transitions.tree import TraceTree
from tests.unit.transition_spans import call, langgraph_rollout, rollout_root, sid, span, tid


def key(name: str, trace: int = 0) -> tuple[str, str]:
    return (tid(trace), sid(name))


# --- tree ------------------------------------------------------------------------------------------------------
def test_parents_order_and_duplicates() -> None:
    spans = [span("b", 20, 30, "a"), span("a", 10, 90), span("c", 40, 50, "a"), span("b", 20, 30, "a")]
    tree = TraceTree.build(spans)
    assert list(tree.spans) == [key("a"), key("b"), key("c")]
    assert tree.parent == {key("b"): key("a"), key("c"): key("a")}
    assert tree.roots == [key("a")] and not tree.grafted


def test_a_gateway_trace_is_grafted_under_the_deepest_enclosing_span() -> None:
    tree = TraceTree.build(langgraph_rollout())
    assert tree.grafted == {
        key("write-gw", 1): key("write-llm"),
        key("check-gw", 2): key("check-llm"),
        key("rewrite-gw", 3): key("rewrite-llm"),
    }
    assert tree.roots == [key("rollout")]
    assert list(tree.ancestors(key("rewrite-gw", 3))) == [
        key("rewrite-gw", 3),
        key("rewrite-llm"),
        key("rewrite"),
        key("graph"),
        key("rollout"),
    ]


def test_an_orphan_is_grafted_and_what_nothing_encloses_stays_a_root() -> None:
    spans = [
        rollout_root(100, 500),
        span("agent", 110, 400, "rollout", agent="solver"),
        span("orphan", 150, 160, "lost-parent"),  # its parent never arrived
        span("early", 10, 20, trace=2),  # before the rollout: nothing encloses it
    ]
    tree = TraceTree.build(spans)
    assert tree.grafted == {key("orphan"): key("agent")}
    assert tree.roots == [(tid(2), sid("early")), key("rollout")]


def test_on_equal_depth_the_latest_started_enclosing_span_wins() -> None:
    spans = [span("a", 0, 100), span("x", 10, 90, "a"), span("y", 20, 80, "a"), call("gw", 30, 40, trace=1)]
    assert TraceTree.build(spans).grafted == {key("gw", 1): key("y")}


def test_parent_cycles_are_cut() -> None:
    spans = [span("a", 10, 20, "b"), span("b", 15, 25, "a"), span("c", 16, 17, "b")]
    tree = TraceTree.build(spans)
    assert key("a") in tree.roots
    assert list(tree.ancestors(key("c"))) == [key("c"), key("b"), key("a")]


def test_the_rollout_span_is_the_main_root_even_when_something_encloses_it() -> None:
    spans = [span("outer", 0, 2000, trace=5), rollout_root(10, 1000), call("gw", 20, 30, "rollout")]
    tree = TraceTree.build(spans)
    assert key("rollout") in tree.roots and key("rollout") not in tree.grafted


# --- selection -------------------------------------------------------------------------------------------------
def test_langgraph_nodes_selected_by_pattern() -> None:
    tree = TraceTree.build(langgraph_rollout())
    calls, made = select_calls(tree, re.compile("write|rewrite"))
    assert made == 3
    assert [(c.agent, c.key) for c in calls] == [("write", key("write-gw", 1)), ("rewrite", key("rewrite-gw", 3))]
    everything, _ = select_calls(tree)
    assert [c.agent for c in everything] == ["write", "check", "rewrite"]


def test_openai_agents_shape_agent_name_two_levels_up() -> None:
    # As openinference's OpenAIAgentsInstrumentor records it (tests/agents/frameworks report): the workflow span is
    # AGENT-kind without agent.name; agent.name is on "calculator", two levels above each "generation"; no
    # traceparent reaches the gateway, so its spans are traces of their own, grafted under "generation".
    spans = [
        rollout_root(),
        span("workflow", 5, 900, "rollout", span_name="add_numbers"),
        span("task", 6, 890, "workflow", span_name="add_numbers"),
        span("agent", 10, 800, "task", agent="calculator", span_name="calculator"),
        span("turn-1", 20, 350, "agent", span_name="turn"),
        span("generation-1", 25, 200, "turn-1", span_name="generation"),
        call("gw-1", 30, 190, trace=1),
        span("tool", 210, 300, "turn-1", span_name="add"),
        span("turn-2", 360, 700, "agent", span_name="turn"),
        span("generation-2", 370, 600, "turn-2", span_name="generation"),
        call("gw-2", 380, 590, trace=2),
    ]
    tree = TraceTree.build(spans)
    assert tree.grafted == {key("gw-1", 1): key("generation-1"), key("gw-2", 2): key("generation-2")}
    calls, _ = select_calls(tree, re.compile("calculator"))
    assert [(c.agent, c.span.span_id) for c in calls] == [("calculator", sid("gw-1")), ("calculator", sid("gw-2"))]


def test_langgraph_with_the_openai_client_instrumentation_too() -> None:
    # openinference's LangChain spans are not current, so the openai instrumentation's "chat" CLIENT span hangs
    # under the rollout span, beside the node: the gateway span still goes under the deeper ChatOpenAI span.
    spans = langgraph_rollout()
    for i, node in enumerate(("write", "check", "rewrite")):
        base = 100 + 250 * i
        spans.append(span(f"{node}-client", base + 15, base + 185, "rollout", span_name="chat tiny"))
    tree = TraceTree.build(spans)
    assert tree.grafted[key("check-gw", 2)] == key("check-llm")
    calls, _ = select_calls(tree, re.compile("write|rewrite"))
    assert [c.agent for c in calls] == ["write", "rewrite"]


def test_autogen_shape_invoke_agent_spans() -> None:
    # AutoGen 0.7: create_agent (ends at once) and invoke_agent carry gen_ai.agent.name; its client opens no LLM
    # span, so the gateway spans are grafted straight under invoke_agent.
    spans = [
        rollout_root(),
        span("create", 2, 3, "rollout", agent="multiplier", span_name="create_agent multiplier"),
        span("invoke", 10, 900, "rollout", agent="multiplier", span_name="invoke_agent multiplier"),
        call("gw-1", 20, 100, trace=1),
        span("tool", 110, 150, "invoke", span_name="execute_tool multiply"),
        call("gw-2", 160, 300, trace=2),
        span("other", 400, 800, "rollout", agent="critic"),
        call("gw-3", 410, 500, trace=3),
    ]
    tree = TraceTree.build(spans)
    calls, made = select_calls(tree, re.compile("multiplier"))
    assert made == 3 and [c.span.span_id for c in calls] == [sid("gw-1"), sid("gw-2")]
    assert agent_of(tree, key("gw-3", 3)) == "critic"


def test_a_call_s_own_agent_name_wins_over_its_ancestors() -> None:
    spans = [span("agent", 0, 100, agent="outer"), call("gw", 10, 20, "agent", agent="inner")]
    calls, _ = select_calls(TraceTree.build(spans))
    assert calls[0].agent == "inner"


def test_repeated_records_of_one_call_count_once() -> None:
    spans = [
        span("agent", 0, 1000, agent="solver"),
        call("first", 10, 100, "agent", response_id="chatcmpl-1"),
        # the same response recorded twice (the same tokens too)
        call("again", 12, 110, trace=7, response_id="chatcmpl-1", prompt=(10, 11), response=(100,)),
        call("outer", 200, 300, "agent", prompt=(5, 6), response=(7,)),
        call("inner", 210, 290, "outer", prompt=(5, 6), response=(7,)),  # nested, same token ids
        call("nested-other", 400, 500, "agent", prompt=(5, 6), response=(8,)),
    ]
    calls, made = select_calls(TraceTree.build(spans))
    assert made == 3
    assert [c.span.span_id for c in calls] == [sid("first"), sid("outer"), sid("nested-other")]


def test_the_choices_of_one_request_are_calls_of_their_own() -> None:
    # n = 2: the gateway records one span per choice, same response id and times, different response tokens.
    spans = [
        span("agent", 0, 1000, agent="solver"),
        call("choice-0", 10, 100, trace=1, response_id="chatcmpl-9", response=(1, 2)),
        call("choice-1", 10, 100, trace=1, response_id="chatcmpl-9", response=(3,)),
    ]
    calls, made = select_calls(TraceTree.build(spans))
    assert made == 2 and {c.span.response_token_ids for c in calls} == {(1, 2), (3,)}
    assert {c.agent for c in calls} == {"solver"}


def test_unnamed_calls_are_kept_without_a_pattern_and_dropped_by_one() -> None:
    spans = [call("gw", 10, 20)]
    assert len(select_calls(TraceTree.build(spans))[0]) == 1
    assert select_calls(TraceTree.build(spans), re.compile("solver"))[0] == []
    assert len(select_calls(TraceTree.build(spans), re.compile(".*"))[0]) == 1


def test_spans_without_both_token_arrays_are_not_calls() -> None:
    spans = [call("no-response", 10, 20, response=()), call("no-prompt", 30, 40, prompt=()), span("plain", 0, 50)]
    assert select_calls(TraceTree.build(spans)) == ([], 0)


# --- rewards ---------------------------------------------------------------------------------------------------
def test_rewards_follow_the_calls_in_time() -> None:
    spans = [
        rollout_root(reward=1.0),  # the episode reward: not an intermediate one
        span("agent", 5, 900, "rollout", agent="solver"),
        span("too-early", 8, 8, "agent", reward=0.5),
        call("c1", 10, 100, "agent"),
        span("r1", 120, 120, "agent", reward=0.25),
        span("r1b", 130, 130, "agent", reward=0.5),
        call("c2", 200, 300, "agent"),
        call("c3", 400, 500, "agent"),
        span("r3", 600, 600, "agent", reward=-1.0),
    ]
    tree = TraceTree.build(spans)
    calls, _ = select_calls(tree)
    matched = match_rewards(tree, calls)
    assert matched.per_call == [0.75, None, -1.0]
    assert [o.owner for o in matched.unmatched] == [key("too-early")]
    assert len(observe_rewards(tree)) == 4


def test_rewards_inside_linked_and_around_calls() -> None:
    spans = [
        span("agent", 0, 1000, agent="solver"),
        call("c1", 10, 100, "agent", events=((50, 0.1),)),  # an evaluation event on the call itself
        call("c2", 200, 300, "agent"),
        span("judge", 900, 950, "agent", reward=0.3, links=("c1",)),  # linked: goes to c1, not to c3
        span("inside", 250, 260, "c2", reward=0.2),  # a child of c2
        call("c3", 400, 500, "agent"),
    ]
    tree = TraceTree.build(spans)
    calls, _ = select_calls(tree)
    assert match_rewards(tree, calls).per_call == [0.4, 0.2, None]


def test_an_evaluation_that_names_a_response_goes_to_the_call_that_returned_it() -> None:
    """gen_ai.evaluation.result events: one carries gen_ai.response.id (recorded long after, on an unrelated span),
    one is attached to the agent's own LLM span, which carries the response id the gateway answered with."""
    spans = [
        span("agent", 0, 1000, agent="solver"),
        call("c1", 10, 100, "agent", response_id="chatcmpl-1"),
        span("c2-client", 190, 310, "agent", response_id="chatcmpl-2", events=((900, 0.7),)),  # the agent's span
        call("c2", 200, 300, trace=1, response_id="chatcmpl-2"),
        call("c3", 400, 500, "agent", response_id="chatcmpl-3"),
        span("judge", 950, 990, "agent", events=((960, 0.25), (970, 0.5)), event_responses=("chatcmpl-1", "")),
    ]
    tree = TraceTree.build(spans)
    calls, _ = select_calls(tree)
    # by time alone all three would go to c3; the first names c1, the agent-span event rates c2's response
    assert match_rewards(tree, calls).per_call == [0.25, 0.7, 0.5]


def test_a_reward_on_a_span_around_calls_goes_to_the_last_of_them() -> None:
    spans = [
        span("agent", 0, 1000, agent="solver", reward=0.9),  # e.g. gen_ai.evaluation.score.value on the agent span
        call("c1", 10, 100, "agent"),
        call("c2", 200, 300, "agent"),
        span("later", 1100, 1200, events=((1150, 0.5),)),  # an event after everything: the last call
    ]
    tree = TraceTree.build(spans)
    calls, _ = select_calls(tree)
    assert match_rewards(tree, calls).per_call == [None, 1.4]


def test_rewards_go_to_selected_calls_only() -> None:
    spans = langgraph_rollout()
    spans.append(span("verdict", 600, 600, "check", reward=0.5))  # after the check call, before rewrite
    tree = TraceTree.build(spans)
    calls, _ = select_calls(tree, re.compile("write|rewrite"))
    assert match_rewards(tree, calls).per_call == [0.5, None]
