"""The reflective proposer over a real HTTP URL: the scripted optimiser server, parsing, token cap, refusals."""

from __future__ import annotations

import pytest

from fulmen.algorithm.prompts import Episode, OptimizerExhausted, ProposalRequest, SearchConfig, optimize
from fulmen.algorithm.prompts.reflect import ReflectiveProposer, parse_proposal, reflection_prompt
from fulmen.optimizer_testing import scripted_optimizer
from fulmen.schemas.errors import ConfigurationError, PoisonInputError

pytestmark = pytest.mark.apo

GOOD = "Reply with one word in UPPERCASE."
DISTRACTORS = ["Be helpful.", "Think carefully.", "Answer politely."]


def _request(rejected=()):
    failing = [Episode("t1", 0.0, "r1", "user: capital of France?\nassistant: paris")]
    return ProposalRequest({"sys": "You are an assistant."}, ["sys"], failing, {"sys": list(rejected)})


def test_parse_takes_marked_texts_of_requested_slots_only():
    answer = 'noise <prompt slot="a">\nfirst\n</prompt> <prompt slot="b">x</prompt> <prompt slot="a">second</prompt>'
    assert parse_proposal(answer, ["a"]) == {"a": "second"}
    assert parse_proposal("no markers here", ["a"]) == {}
    assert parse_proposal('<prompt slot="a">  </prompt>', ["a"]) == {}


def test_reflection_prompt_shows_evidence_and_refused_texts():
    prompt = reflection_prompt(_request(rejected=["Be helpful."]))
    assert "capital of France" in prompt and "reward 0" in prompt
    assert '<refused slot="sys">\nBe helpful.\n</refused>' in prompt
    assert prompt.rstrip().endswith("# Rewrite these slots: sys")


def test_proposer_calls_the_url_skips_refused_and_counts_tokens(monkeypatch):
    monkeypatch.setenv("FULMEN_OPTIMIZER_API_KEY", "sk-test")
    with scripted_optimizer([*DISTRACTORS, GOOD]) as server:
        proposer = ReflectiveProposer(server.url(), model="judge")
        first = proposer.propose(_request())
        second = proposer.propose(_request(rejected=["Think carefully."]))
        assert first.texts == {"sys": "Be helpful."}
        assert second.texts == {"sys": "Answer politely."}  # the refused text is not re-proposed
        assert proposer.tokens_used > 0 and first.tokens > 0
        sent = server.chat_requests()[0]
        assert sent.headers["authorization"] == "Bearer sk-test" and sent.body["model"] == "judge"
        assert "/rollout/" not in sent.path  # straight to the optimiser, never a gateway rollout path


def test_token_cap_stops_the_search():
    with scripted_optimizer(DISTRACTORS * 5) as server:
        proposer = ReflectiveProposer(server.url(), max_tokens_total=1)
        proposer.propose(_request())
        with pytest.raises(OptimizerExhausted, match="token cap"):
            proposer.propose(_request())


def test_invalid_candidate_is_refused_and_remembered():
    def validate(slot, old, new):
        if "{name}" not in new:
            raise PoisonInputError(f"slot {slot} drops placeholder {{name}}")

    with scripted_optimizer(["Hello.", "Hello {name}."]) as server:
        proposer = ReflectiveProposer(server.url(), validate=validate)
        assert proposer.propose(_request()).texts is None
        assert proposer.propose(_request()).texts == {"sys": "Hello {name}."}
        assert "Hello." in server.script.prompts[-1]  # shown as refused the second time


def test_bad_url_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="optimizer-url"):
        ReflectiveProposer("localhost:9999")


def test_gepa_finds_the_good_instruction_through_the_url():
    table = {GOOD: 1.0}

    class Evaluator:
        def run(self, slots, task_ids):
            reward = table.get(slots["sys"], 0.0)
            return [Episode(t, reward, f"r-{t}", f"task {t}: answered in lower case") for t in task_ids]

    with scripted_optimizer([*DISTRACTORS, GOOD]) as server:
        proposer = ReflectiveProposer(server.url())
        result = optimize(
            Evaluator(),
            proposer,
            {"sys": "You are an assistant."},
            train=[f"t{i}" for i in range(6)],
            val=["v0", "v1", "v2"],
            test=["x0", "x1"],
            max_rollouts=60,
            config=SearchConfig(seed=0, minibatch=2),
        )
    assert result.best.slots == {"sys": GOOD}
    assert result.report["heldout_before"] == 0.0 and result.report["heldout_after"] == 1.0
    assert result.report["rollouts_used"] <= 60


def test_a_template_that_drops_a_placeholder_is_refused_with_the_bundle_validator():
    from fulmen.schemas.prompts import validate_slot_text

    request = ProposalRequest({"tpl:greet": "Greet {name} briefly."}, ["tpl:greet"], [Episode("t", 0.0)], {})
    with scripted_optimizer(["Greet the user.", "Greet {name} warmly, in French."]) as server:
        proposer = ReflectiveProposer(server.url(), validate=validate_slot_text)
        assert proposer.propose(request).texts is None  # drops {name}
        assert proposer.propose(request).texts == {"tpl:greet": "Greet {name} warmly, in French."}
        assert proposer.refused == {"tpl:greet": ["Greet the user."]}
