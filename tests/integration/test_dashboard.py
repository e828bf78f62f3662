"""The dashboard's JSON over a real store, read through the read endpoint as ``fulmen dashboard`` reads it:
what each API answers matches SQL, filters are validated and travel as values, and the pages are served
with nothing from elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.dashboard_data import Filled, fill_store
from fulmen.dashboard import Dashboard, DashboardQueries
from fulmen.infra.store import RemoteReader, Store
from fulmen.testing.served import Served, ServedEndpoint

pytestmark = pytest.mark.integration


@pytest.fixture
def filled(store: Store) -> Filled:
    return fill_store(store, rollouts=40, calls=2, steps=4, dead_letters=3)


@pytest.fixture
def http(store: Store, filled: Filled) -> Iterator[httpx.Client]:
    with ServedEndpoint(store) as reads:
        dashboard = Dashboard(DashboardQueries(RemoteReader(reads.url)), "127.0.0.1", 0, poll_s=1.0)
        with Served(dashboard.start, dashboard.stop), httpx.Client(base_url=dashboard.url, timeout=30) as client:
            yield client


def get(http: httpx.Client, path: str, **params: Any) -> Any:
    answer = http.get(path, params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


def sql(store: Store, text: str) -> list[list[Any]]:
    return store.query(text.replace("{db}", store.database)).rows


def test_runs_and_steps_match_the_store(http: httpx.Client, store: Store, filled: Filled) -> None:
    [run] = get(http, "/api/runs")
    assert (run["RunId"], run["Steps"], run["LastStep"]) == (filled.run_id, 4, 4)
    answer = get(http, "/api/steps", run=filled.run_id)
    expected = sql(store, "SELECT Step, RewardMean, Extra['val_accuracy'] FROM {db}.train_steps ORDER BY Step")
    assert [[s["Step"], s["RewardMean"], s["HeldOut"]] for s in answer["steps"]] == expected
    assert [s["Step"] for s in get(http, "/api/steps", run=filled.run_id, after=2)["steps"]] == [3, 4]  # polling


def test_rollouts_filter_by_status_mode_and_attempt(http: httpx.Client, store: Store) -> None:
    everything = get(http, "/api/rollouts", limit=500)
    assert everything["total"] == 40 == len(everything["rollouts"])
    failed = get(http, "/api/rollouts", status="failed", mode="train", attempt=1)
    expected = sql(
        store, "SELECT RolloutId FROM {db}.rollouts WHERE Status = 'failed' AND Mode = 'train' ORDER BY Timestamp DESC"
    )
    assert [[r["RolloutId"]] for r in failed["rollouts"]] == expected and expected
    assert get(http, "/api/rollouts", attempt=2)["total"] == 0
    page = get(http, "/api/rollouts", limit=10, offset=35)
    assert len(page["rollouts"]) == 5 and page["total"] == 40


@pytest.mark.parametrize(
    ("path", "params", "named"),
    [
        ("/api/rollouts", {"status": "failed' OR 1=1 --"}, "status"),
        ("/api/rollouts", {"mode": "x"}, "mode"),
        ("/api/rollouts", {"attempt": "1 OR 1"}, "attempt"),
        ("/api/rollouts", {"limit": "100000"}, "limit"),
        ("/api/rollouts", {"run": "x'; DROP TABLE rollouts; --"}, "run"),
        ("/api/rollout", {"id": "r' OR '1'='1"}, "id"),
        ("/api/rollout", {"id": "r0000001", "credit": "nope"}, "credit"),
        ("/api/rollout", {"id": "r0000001", "gamma": "2"}, "gamma"),
        ("/api/steps", {}, "run"),
        ("/api/dead-letters", {"limit": "-1"}, "limit"),
    ],
)
def test_a_bad_filter_is_a_400_naming_it(http: httpx.Client, path: str, params: dict, named: str) -> None:
    answer = http.get(path, params=params)
    assert answer.status_code == 400 and answer.json()["error"].startswith(named), answer.text


def test_one_rollout_has_its_trace_tree_calls_and_credit(http: httpx.Client, store: Store, filled: Filled) -> None:
    rollout = next(r for r, _, status in filled.rollouts if status == "succeeded")
    answer = get(http, "/api/rollout", id=rollout)
    spans = answer["spans"]
    assert (
        len(spans)
        == 3 + 2 * 2
        == sql(store, f"SELECT count() FROM {{db}}.otel_traces WHERE RolloutId = '{rollout}'")[0][0]
    )
    assert spans[0]["Depth"] == 0 and spans[0]["SpanName"] == "fulmen.rollout"
    assert {s["Depth"] for s in spans[1:]} == {1, 2}  # the agent under the rollout, calls and tools under the agent
    calls = [s for s in spans if s["InputMessages"]]
    assert len(calls) == 2 and calls[0]["InputMessages"][0]["content"].startswith("Ann has")
    assert calls[0]["PromptTokens"] == 80 and calls[0]["ResponseTokens"] == 12 and calls[0]["ModelVersion"] is not None
    reward = sql(store, f"SELECT Reward FROM {{db}}.rollouts WHERE RolloutId = '{rollout}'")[0][0]
    assert [t["Credited"] for t in answer["transitions"]] == [reward, reward]  # broadcast
    discounted = get(http, "/api/rollout", id=rollout, credit="discounted", gamma="0.5")["transitions"]
    assert [t["Credited"] for t in discounted] == [0.5 * reward, reward]


def test_models_show_each_version_its_score_and_decision_and_which_serves(http: httpx.Client, store: Store) -> None:
    from fulmen.consumers.event_sinks import EVENT_SINKS
    from fulmen.schemas import ModelPromotion, ModelVersion, PromotionAction

    versions = [ModelVersion(model_name="gated", version=n, uri=f"/ckpt/v{n}", run_id="g-run") for n in (1, 2)]
    decisions = [
        ModelPromotion(action=PromotionAction.PROMOTE, model=versions[0], score=0.6),
        ModelPromotion(action=PromotionAction.REJECT, model=versions[1], score=0.4),
    ]
    for name, events in (("model_versions", versions), ("promotions", decisions)):
        sink = EVENT_SINKS[name]
        store.insert_batch(sink.table, sink.to_batch([sink.rows(e) for e in events]))
    answer = get(http, "/api/models", model="gated")
    assert "gated" in answer["models"] and answer["model"] == "gated"
    shown = [(v["version"], v["decision"], v["score"], v["serving"]) for v in answer["versions"]]
    assert shown == [(1, "promoted", 0.6, True), (2, "rejected", 0.4, False)]
    assert http.get("/api/models", params={"model": "no'quote"}).status_code == 400


@dataclass(frozen=True)
class PromptData:
    base: Any
    child: Any
    hand: Any
    long: str


def insert_prompt_data(store: Store) -> PromptData:
    """Three bundles (a search's base and child, one made by hand), a promotion of the child for agent ``write``,
    and rollouts naming the child, inserted through the real sinks."""
    from fulmen.consumers.event_sinks import EVENT_SINKS
    from fulmen.schemas import PromotionAction
    from fulmen.schemas.events import RolloutEvent, RolloutMode, RolloutStatus
    from fulmen.schemas.prompts import PromptBundle, PromptPromotion

    long = "Answer in French. " * 30  # shortened on the page
    base = PromptBundle.create(
        {"fp-0123456789ab": "You are helpful."}, source="gepa", run_id="s-run", scores={"v1": 0.0, "v2": 0.0}
    )
    child = PromptBundle.create(
        {"fp-0123456789ab": long},
        parents=[base.bundle_id],
        source="gepa",
        run_id="s-run",
        scores={"v1": 1.0, "v2": 0.5},
        agent="write",
    )
    hand = PromptBundle.create({"fp-0123456789ab": "Be brief."})
    promoted = PromptPromotion(action=PromotionAction.PROMOTE, bundle_id=child.bundle_id, agent="write")

    def rollout(n: int, mode: RolloutMode, status: RolloutStatus, reward: float | None) -> RolloutEvent:
        return RolloutEvent(
            rollout_id=f"pr{n}",
            attempt=1,
            status=status,
            task_id=f"t{n}",
            group_id=f"g{n}",
            mode=mode,
            reward=reward,
            model_version=3,
            prompt_bundle=child.bundle_id,
            error="agent raised" if status is RolloutStatus.FAILED else None,
        )

    rollouts = [
        rollout(1, RolloutMode.VAL, RolloutStatus.SUCCEEDED, 1.0),
        rollout(2, RolloutMode.VAL, RolloutStatus.SUCCEEDED, 0.0),
        rollout(3, RolloutMode.TRAIN, RolloutStatus.SUCCEEDED, 1.0),
        rollout(4, RolloutMode.TRAIN, RolloutStatus.FAILED, None),
        rollout(5, RolloutMode.TRAIN, RolloutStatus.RUNNING, None),  # not ended: not counted
    ]
    for name, events in (
        ("prompt_bundles", [base, child, hand]),
        ("prompt_promotions", [promoted]),
        ("rollouts", rollouts),
    ):
        sink = EVENT_SINKS[name]
        store.insert_batch(sink.table, sink.to_batch([sink.rows(e) for e in events]))
    return PromptData(base, child, hand, long)


def test_prompts_show_each_bundle_its_lineage_scores_rollouts_and_where_it_serves(
    http: httpx.Client, store: Store
) -> None:
    data = insert_prompt_data(store)
    base, child, hand, long = data.base, data.child, data.hand, data.long
    answer = get(http, "/api/prompts")
    assert answer["serving"] == {"write": child.bundle_id} and answer["runs"] == ["s-run"]
    shown = {b["bundle_id"]: b for b in answer["bundles"]}
    assert set(shown) == {base.bundle_id, child.bundle_id, hand.bundle_id}
    b = shown[child.bundle_id]
    assert (b["agent"], b["parents"], b["serving"], b["val_mean"], b["val_tasks"]) == (
        "write",
        [base.bundle_id],
        ["write"],
        0.75,
        2,
    )
    assert b["scores"] == {"v1": 1.0, "v2": 0.5}
    [text] = b["slots"].values()
    assert text.startswith("Answer in French.") and text.endswith("…") and len(text) < len(long)
    assert b["rollouts"] == {
        "train": {"rollouts": 2, "rewarded": 1, "mean": 1.0},
        "val": {"rollouts": 2, "rewarded": 2, "mean": 0.5},
    }
    made_by_hand = shown[hand.bundle_id]
    assert (made_by_hand["val_mean"], made_by_hand["rollouts"], made_by_hand["serving"]) == (None, {}, [])
    one_run = get(http, "/api/prompts", run="s-run")["bundles"]
    assert [b["bundle_id"] for b in one_run] == [child.bundle_id, base.bundle_id]  # newest first, no hand-made one
    assert http.get("/api/prompts", params={"run": "x' OR 1=1"}).status_code == 400


def test_dead_letters_and_health(http: httpx.Client) -> None:
    answer = get(http, "/api/dead-letters")
    assert answer["total"] == 3 and answer["records"][0]["ErrorType"] == "DecodeError"
    assert get(http, "/healthz") == {"status": "ok", "store": True}


def test_the_pages_need_nothing_from_elsewhere(http: httpx.Client) -> None:
    for path in ("/", "/rollouts", "/rollout?id=x", "/models", "/prompts", "/dead-letters"):
        page = http.get(path)
        assert page.status_code == 200 and "default-src 'self'" in page.headers["Content-Security-Policy"]
        assert "http://" not in page.text and "https://" not in page.text
    for asset in ("/static/dashboard.js", "/static/vendor/uPlot.iife.min.js", "/static/vendor/uPlot.min.css"):
        assert http.get(asset).status_code == 200, asset
    assert http.get("/static/../app.py").status_code in (403, 404)
    assert http.post("/api/runs").status_code == 405


def test_only_this_machine_may_ask(http: httpx.Client) -> None:
    rebinding = http.get("/api/runs", headers={"Host": "evil.example:8890"})
    assert rebinding.status_code == 403 and "loopback" in rebinding.json()["error"]
    assert http.get("/", headers={"Host": "evil.example"}).status_code == 403
    assert http.get("/api/runs", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert http.get("/api/runs", headers={"Sec-Fetch-Site": "same-origin"}).status_code == 200


def test_health_says_when_the_store_does_not_answer(store: Store) -> None:
    dashboard = Dashboard(DashboardQueries(RemoteReader("http://127.0.0.1:9", timeout_s=2)), "127.0.0.1", 0)
    with Served(dashboard.start, dashboard.stop), httpx.Client(base_url=dashboard.url, timeout=30) as client:
        assert client.get("/healthz").json() == {"status": "ok", "store": False}
        answer = client.get("/api/runs")
        assert answer.status_code == 503 and "did not answer" in answer.json()["error"]


@pytest.mark.browser
def test_the_prompts_page_draws_in_chromium(http: httpx.Client, store: Store, tmp_path: Path) -> None:
    """The Prompts page in headless Chromium: one row per bundle, the served one marked with its scope, the
    lineage's mean score and the rollouts per mode shown, no script error."""
    chromium = Path("/usr/bin/chromium")
    if not chromium.is_file():
        pytest.skip("Debian's chromium is not installed at /usr/bin/chromium (make install installs it)")
    from playwright.sync_api import sync_playwright

    data = insert_prompt_data(store)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.goto(str(http.base_url.join("/prompts")))
        page.wait_for_selector("#bundles-table tbody tr", timeout=30_000)
        assert page.locator("#bundles-table tbody tr").count() == 3
        row = page.locator(f'tr[data-bundle="{data.child.bundle_id}"]')
        assert "★ write" in row.inner_text() and "0.750 (2 val task(s))" in row.inner_text()
        assert row.locator('[data-mode="train"]').inner_text() == "train: 2 rollout(s), mean reward 1"
        assert "serving calls that name no bundle" in page.locator("#prompts-serving").inner_text().lower()
        page.screenshot(path=str(tmp_path / "prompts.png"), full_page=True)
        browser.close()
    assert not errors, errors
    assert (tmp_path / "prompts.png").stat().st_size > 10_000
