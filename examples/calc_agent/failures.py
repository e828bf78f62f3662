"""What went wrong in a calc episode, read from what the model wrote at each call (the gateway's spans).

Kinds, checked in this order: ``correct``; ``timed_out`` / ``failed`` (the rollout did not finish); ``no_tool_call``
(the model never called the calculator); ``bad_expression`` (its last call was not arithmetic the calculator takes);
``wrong_expression`` (the calculator computed something other than the answer); ``no_answer`` (the right result came
back but no final text followed: the tool rounds ran out); ``extra_numbers`` (the final text holds the answer but
ends on another number); ``wrong_final_answer`` (the right result came back and the final text does not use it).
"""

from __future__ import annotations

from typing import Any

from examples.calc_agent.calculator import CalcError, calculate
from examples.calc_agent.reward import TOLERANCE, numbers
from examples.outcomes import Episode, argument_of_calls, generic_failure_kind

__all__ = ["KINDS", "failure_kind"]

KINDS = (
    "correct",
    "timed_out",
    "failed",
    "no_tool_call",
    "bad_expression",
    "wrong_expression",
    "no_answer",
    "extra_numbers",
    "wrong_final_answer",
)


def failure_kind(task: dict[str, Any], episode: Episode) -> str:
    """The kind of ``episode``'s outcome on ``task`` (module docstring)."""
    finished = generic_failure_kind(task, episode)
    if finished != "wrong":  # solved, or the rollout did not finish
        return finished
    expressions = [e for message in episode.outputs for e in argument_of_calls(message, "expression")]
    if not expressions:
        return "no_tool_call"
    try:
        value = calculate(expressions[-1])
    except CalcError:
        return "bad_expression"
    if abs(float(value) - float(task["answer"])) > TOLERANCE:
        return "wrong_expression"
    final = next((m.get("content") for m in reversed(episode.outputs) if not m.get("tool_calls")), None)
    if not final:
        return "no_answer"
    right = any(abs(n - float(task["answer"])) <= TOLERANCE for n in numbers(final))
    return "extra_numbers" if right else "wrong_final_answer"
