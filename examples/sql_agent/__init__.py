"""Text-to-SQL over many generated databases with a write -> check -> rewrite graph, on LangGraph (README.md)."""

from examples.spec import Example
from examples.sql_agent import data, teacher

EXAMPLE = Example(
    name="sql_agent",
    framework="LangGraph",
    agent="examples.sql_agent.agent:run",
    train_tasks=data.train_tasks,
    heldout_tasks=data.heldout_tasks,
    trained_agents=("write", "rewrite"),
    max_calls=6,
    agent_pattern="write|rewrite",
    teacher=teacher.teach,
    unseen_tasks=data.unseen_tasks,
)
