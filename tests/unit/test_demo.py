"""The demo's pure parts: the safe calculator, the generated tasks, the warm-up samples, the reward shuffle."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fulmen.algorithm.demo.calc import CalcError, evaluate
from fulmen.algorithm.demo.tasks import (
    TAUGHT,
    UNTAUGHT,
    WORDINGS,
    apply,
    generate,
    heldout_tasks,
    train_tasks,
    warmup_problems,
)
from fulmen.algorithm.service.groups import ClosedGroup, shuffle_rewards
from fulmen.schemas.events import RolloutMode, RolloutStatus, Transition, TransitionBatch


@pytest.mark.parametrize(("expr", "value"), [("23+45", 68), (" 71 - 64 ", 7), ("-3*(2+1)", -9), ("10-99", -89)])
def test_calc_evaluates_integer_arithmetic(expr: str, value: int) -> None:
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr", ["__import__('os')", "a+1", "2**8", "1.5+1", "len('x')", "", "9" * 41, "99999*99999", "(1", None]
)
def test_calc_refuses_everything_else(expr: object) -> None:
    with pytest.raises(CalcError):
        evaluate(expr)  # type: ignore[arg-type]


def test_tasks_are_deterministic_disjoint_and_correct() -> None:
    train, heldout = train_tasks(500), heldout_tasks(64, train_count=500)
    assert [t.input for t in train] == [t.input for t in train_tasks(500)]
    assert len(heldout) == 64 and all(t.input["greedy"] for t in heldout)
    assert not {t.input["question"] for t in train} & {t.input["question"] for t in heldout}
    for task in train + heldout:
        assert evaluate(task.input["expr"]) == task.input["answer"] >= 0
        a, b = re.split(r"[-+*]", task.input["expr"])
        assert re.search(rf"\b{a}\b.*\b{b}\b", task.input["question"])
        assert 10 <= task.input["answer"] <= 99  # two digits whichever operator is applied (see tasks.py)
    ops = {p.op for p in generate(300, 3)}
    assert ops == {"+", "-", "*"}
    assert {p.wording for p in generate(300, 3)} == set(WORDINGS)
    assert not {p.wording for p in generate(64, 98765, wordings=frozenset(WORDINGS) - TAUGHT)} & TAUGHT


def test_both_sets_take_the_wordings_in_turn() -> None:
    """Both sets are the wordings the warm-up did not explain; every run of three consecutive training tasks has
    one of each (a demo step of 12 groups, dispatched in order, sees each four times); the held-out set has as
    many of each."""
    train = [_wording(t.input["question"]) for t in train_tasks(120)]
    assert all(sorted(train[k : k + 3]) == sorted(UNTAUGHT) for k in range(0, 120, 3))
    heldout = [_wording(t.input["question"]) for t in heldout_tasks(48)]
    assert {w: heldout.count(w) for w in set(heldout)} == dict.fromkeys(UNTAUGHT, 16)
    assert len(UNTAUGHT) == 3 and not UNTAUGHT & TAUGHT


def test_heldout_questions_are_neither_trained_on_nor_in_the_warmup() -> None:
    heldout = {t.input["question"] for t in heldout_tasks(48, train_count=500, warmup_count=4000)}
    assert len(heldout) == 48
    assert not heldout & {t.input["question"] for t in train_tasks(500)}
    assert not heldout & {p.question for p in warmup_problems(4000)}


def _wording(question: str) -> str:
    """The name of the wording ``question`` was made from."""
    for name, (_, template) in WORDINGS.items():
        pattern = re.escape(template).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+")
        if re.fullmatch(pattern.replace(r"\{n\}", r"\w+").replace(r"\{i\}", r"\w+"), question):
            return name
    raise AssertionError(f"no wording makes {question!r}")


def test_warmup_samples_match_the_rendered_conversation() -> None:
    from fulmen.algorithm.demo.agent import TOOLS
    from fulmen.algorithm.demo.warmup import conversation_samples
    from fulmen.algorithm.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    problem = generate(1, 7)[0]
    first, second = conversation_samples(problem, tokenizer)
    assert tokenizer.decode(first.response_token_ids, skip_special_tokens=True) == (
        '<tool_call>{"name": "calc", "arguments": {"expr": "' + problem.expr + '"}}</tool_call>'
    )
    assert first.response_token_ids[-1] == second.response_token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(second.response_token_ids, skip_special_tokens=True) == str(problem.answer)
    prompt = tokenizer.decode(second.prompt_token_ids)
    assert prompt.startswith(tokenizer.decode(first.prompt_token_ids + first.response_token_ids))
    assert prompt.endswith(f"<|im_start|>tool\n{problem.answer}<|im_end|>\n<|im_start|>assistant\n")
    other = next(op for op in "+-*" if op != problem.op)  # the warm-up's episodes use a random operator
    wrong = conversation_samples(problem, tokenizer, other)[1]
    answer = tokenizer.decode(wrong.response_token_ids, skip_special_tokens=True)
    assert answer == str(apply(problem.a, other, problem.b)) != str(problem.answer)
    assert '"name": "calc"' in tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tools=TOOLS, tokenize=False
    )


def _batch(rollout: str, reward: float, calls: int) -> TransitionBatch:
    transitions = [
        Transition(
            rollout_id=rollout,
            attempt=1,
            index=i,
            trace_id="a" * 32,
            span_id=f"{i:016x}",
            prompt_token_ids=[1],
            response_token_ids=[2],
            intermediate_reward=reward,
        )
        for i in range(calls)
    ]
    return TransitionBatch(
        rollout_id=rollout,
        attempt=1,
        task_id="t",
        group_id="g",
        status=RolloutStatus.SUCCEEDED,
        episode_reward=reward,
        transitions=transitions,
    )


def test_shuffle_rewards_permutes_whole_reward_records_across_the_step() -> None:
    rewards = [float(i) for i in range(16)]
    groups = [
        ClosedGroup(
            f"g{g}", "t", RolloutMode.TRAIN, 8, tuple(_batch(f"r{g}{i}", rewards[8 * g + i], 2) for i in range(8))
        )
        for g in range(2)
    ]
    shuffled = shuffle_rewards(groups, seed=1)
    after = [b.episode_reward for g in shuffled for b in g.rollouts]
    assert sorted(after) == rewards and after != rewards
    for group in shuffled:
        for batch in group.rollouts:
            assert [t.intermediate_reward for t in batch.transitions] == [batch.episode_reward] * 2
    assert [b.rollout_id for g in shuffled for b in g.rollouts] == [b.rollout_id for g in groups for b in g.rollouts]
    assert shuffle_rewards(groups, seed=1) == shuffled


@pytest.mark.security
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_demo_service_dies_with_a_killed_demo(tmp_path: Path) -> None:
    """A demo killed by SIGKILL (a test's timeout) used to leave its gateways, runner and consumers running."""
    pid_file = tmp_path / "child.pid"
    parent = (
        "import subprocess, sys, time\n"
        "from fulmen.infra.processes import _die_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " start_new_session=True, preexec_fn=_die_with_parent)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n"
    )
    demo = subprocess.Popen([sys.executable, "-c", parent], cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.1)
    child = int(pid_file.read_text())
    demo.kill()
    demo.wait()
    deadline = time.monotonic() + 20  # a liveness bound
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), "the service outlived the demo"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "gspo", "cispo"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_demo_options_select_the_algorithm_and_the_mode(algorithm: str, mode: str) -> None:
    """`fulmen demo --algorithm X --mode Y` trains with X's recipe in mode Y (DAPO's overlong shaping gets the
    demo agent's call limit, so the recipe is complete)."""
    from fulmen.algorithm.demo.agent import CALL_TOKENS
    from fulmen.algorithm.demo.run import DemoOptions, train_fields
    from fulmen.algorithm.rl.recipes import ALGORITHMS
    from fulmen.algorithm.service.run import check_training_settings
    from fulmen.algorithm.settings import TrainSection

    section = TrainSection(**train_fields(DemoOptions(algorithm=algorithm, mode=mode, max_staleness=2)))
    check_training_settings(section)  # every piece resolves (overlong shaping has its limit)
    assert section.policy_loss == ALGORITHMS.get(algorithm).policy_loss and section.mode == mode
    assert section.correction == ("tis" if mode == "async" else "")
    assert section.overlong_limits is None or section.overlong_limits[0] == CALL_TOKENS
    assert section.max_staleness == 2


def test_a_taken_broker_port_fails_the_demo_before_its_warm_up(tmp_path: Path) -> None:
    """A port another process holds is an error at once, not after minutes of warm-up."""
    import socket

    from fulmen.algorithm.demo.run import DemoOptions, run_demo
    from fulmen.infra.processes import free_port
    from fulmen.infra.settings import BrokerSettings, FulmenSettings
    from fulmen.schemas.errors import ConfigurationError

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        settings = FulmenSettings(home=tmp_path, broker=BrokerSettings(port=port, controller_port=free_port()))
        phases: list[str] = []
        with pytest.raises(ConfigurationError, match=rf"port {port} .* is taken"):
            run_demo(settings, DemoOptions(warmup_dir=tmp_path / "warmup"), on_phase=phases.append)
    assert phases == [] and not (tmp_path / "warmup").exists()
