"""Multi-hop question answering with a search tool, on the OpenAI Agents SDK (see README.md)."""

from examples.rag_agent import data, failures, teacher
from examples.spec import Example

EXAMPLE = Example(
    name="rag_agent",
    framework="OpenAI Agents SDK",
    agent="examples.rag_agent.agent:run",
    train_tasks=data.train_tasks,
    heldout_tasks=data.heldout_tasks,
    unseen_tasks=data.unseen_tasks,
    trained_agents=("researcher",),
    max_calls=4,
    agent_pattern="researcher",
    credit="intermediate",
    gamma=1.0,
    teacher=teacher.teach,
    failure_kind=failures.failure_kind,
)
