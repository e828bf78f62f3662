"""Math word problems with a calculator, on AutoGen AgentChat (see README.md)."""

from examples.calc_agent import data, failures, teacher
from examples.spec import Example

EXAMPLE = Example(
    name="calc_agent",
    framework="AutoGen AgentChat",
    agent="examples.calc_agent.agent:run",
    train_tasks=data.train_tasks,
    heldout_tasks=data.heldout_tasks,
    trained_agents=("solver",),
    max_calls=3,
    teacher=teacher.teach,
    unseen_tasks=data.unseen_tasks,
    failure_kind=failures.failure_kind,
)
