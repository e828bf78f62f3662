"""The dashboard in a real headless Chromium (Debian's, driven by Playwright), over a real run.

The system runs on the tiny model (``run_locally``: Kafka from the session's broker, ``fulmen consume``, the two
gateways, a runner with an agent of two LLM calls and a judge, one GRPO step with a held-out validation before
and after it). While the run's store is still served, one poison record goes to its spans topic (the
dead-letters page has something to show), ``fulmen dashboard`` starts as its own process, and Chromium opens
each page: what it shows is checked against SQL on the same store, the rollouts are filtered, a rollout is
clicked into and one of its LLM calls opened. Every page is saved as a screenshot in the test's tmp dir; no
request leaves 127.0.0.1 and no page logs a script error.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from fulmen.algorithm.local import LocalPlan, LocalRun, run_locally
from fulmen.algorithm.service.dispatcher import DatasetTask
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.processes import Services, ServiceSpec, free_port
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import RemoteReader
from fulmen.schemas.topics import TopicKey, topic_name

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(900)]

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
AGENT = "tests.agents.chat:ask_twice_and_rate_the_first"
TRAIN = {
    "steps": 1,
    "group_size": 2,
    "groups_per_step": 2,
    "val_group_size": 1,
    "rollout_timeout_s": 120.0,
    "max_attempts": 2,
    "micro_batch_size": 8,
    "device": "cpu",
    "dtype": "float32",
    "seed": 3,
}
WAIT_MS = 30_000


def tasks(prefix: str, n: int) -> list[DatasetTask]:
    return [
        DatasetTask(f"{prefix}{i}", {"question": f"What is {i} plus {i + 2}?", "score": 0.25 * i}) for i in range(n)
    ]


def shown(value: float | int | None, digits: int = 3) -> str:
    """A number as the page's fmt() writes it."""
    if value is None:
        return "–"
    return str(int(value)) if float(value).is_integer() else f"{value:.{digits}f}"


@pytest.fixture(scope="module")
def chromium_path() -> Path:
    if not CHROMIUM.is_file():
        pytest.skip("Debian's chromium is not installed at /usr/bin/chromium (make install installs it)")
    return CHROMIUM


def test_the_dashboard_shows_a_run_in_chromium(
    chromium_path: Path, kafka_broker: LocalKafka, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the runner imports the agent from tests/
    settings = FulmenSettings(home=tmp_path, kafka={"bootstrap": kafka_broker.bootstrap})
    plan = LocalPlan(AGENT, tiny_model, concurrency=8, run_prefix="dash")
    checked: dict[str, Any] = {}
    run_locally(
        settings,
        plan,
        TRAIN,
        tasks("t", 2),
        tasks("v", 1),
        run_dir=tmp_path / "run",
        after=lambda run: checked.update(browse(run, chromium_path, tmp_path)),
    )
    assert checked["screenshots"] == [
        "runs.png",
        "rollouts.png",
        "rollouts-succeeded.png",
        "rollout.png",
        "llm-call.png",
        "models.png",
        "dead-letters.png",
    ]
    for name in checked["screenshots"]:
        assert (tmp_path / name).stat().st_size > 10_000, name  # a drawn page, not a blank one


def browse(run: LocalRun, chromium: Path, out: Path) -> dict[str, Any]:
    """Runs while the run's services still run: a poison record, the dashboard, Chromium on every page."""
    from playwright.sync_api import sync_playwright

    reads = RemoteReader(f"http://127.0.0.1:{run.env['FULMEN_CLICKHOUSE_READ_PORT']}")
    db = run.env["FULMEN_CLICKHOUSE_DATABASE"]

    def sql(text: str) -> list[list[Any]]:
        return reads.query(text.replace("{db}", db)).rows

    asyncio.run(poison(run))
    settle(sql)
    port = free_port()
    env = run.env | {"FULMEN_DASHBOARD_POLL_S": "1"}
    args = ("dashboard", "--host", "127.0.0.1", "--port", str(port))
    with Services(run.run_dir / "logs", env) as services, sync_playwright() as playwright:
        services.start(ServiceSpec("dashboard", args, {}, f"http://127.0.0.1:{port}/healthz"))
        browser = playwright.chromium.launch(executable_path=str(chromium), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        elsewhere: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        page.on("request", lambda r: None if r.url.startswith(f"http://127.0.0.1:{port}/") else elsewhere.append(r.url))
        base = f"http://127.0.0.1:{port}"
        screenshots: list[str] = []

        def snap(name: str) -> None:
            page.screenshot(path=str(out / name), full_page=True)
            screenshots.append(name)

        check_runs(page, base, run, sql, snap)
        check_rollouts(page, base, sql, snap)
        check_rollout(page, sql, snap)
        check_models(page, base, run, snap)
        check_dead_letters(page, base, sql, snap)
        browser.close()
    assert not errors, errors
    assert not elsewhere, elsewhere
    return {"screenshots": screenshots}


async def poison(run: LocalRun) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=run.env["FULMEN_KAFKA_BOOTSTRAP"])
    await producer.start()
    try:
        spans = topic_name(TopicKey.SPANS, run.env["FULMEN_KAFKA_TOPIC_PREFIX"])
        await producer.send_and_wait(spans, b"\xffnot an OTLP request", key=b"poison")
    finally:
        await producer.stop()


def settle(sql: Any) -> None:
    """Wait until the store stops changing (rollouts finished, the poison record dead-lettered)."""
    query = (
        "SELECT (SELECT count() FROM {db}.rollouts), (SELECT count() FROM {db}.otel_traces), "
        "(SELECT count() FROM {db}.dead_letters), (SELECT countIf(Status IN ('queued', 'claimed', 'running')) "
        "FROM {db}.rollouts)"
    )
    last = None
    for _ in range(120):
        now = sql(query)[0]
        if now == last and now[2] >= 1 and now[3] == 0:
            return
        last = now
        time.sleep(1.0)
    raise AssertionError(f"the store did not settle: {last}")


def check_runs(page: Any, base: str, run: LocalRun, sql: Any, snap: Any) -> None:
    page.goto(base + "/")
    page.wait_for_selector(f'#runs-table tr[data-run="{run.run_id}"]', timeout=WAIT_MS)
    [[step, version, reward, held_out, loss]] = sql(
        f"SELECT Step, ModelVersion, RewardMean, Extra['val_accuracy'], Loss FROM {{db}}.train_steps "
        f"WHERE RunId = '{run.run_id}' ORDER BY Step"
    )
    expected = (
        f"1 step(s); last: step {step}, version {version}, reward {shown(reward)}, "
        f"held-out {shown(held_out)}, loss {shown(loss, 4)}"
    )
    page.locator(".uplot").nth(4).wait_for(timeout=WAIT_MS)  # (the page's CSP forbids wait_for_function's eval)
    assert page.locator(".uplot canvas").count() == 5  # reward, loss, KL, clip fraction, tokens/s
    assert page.locator("#steps-summary").inner_text() == expected
    versions = sql(f"SELECT count() FROM {{db}}.model_versions WHERE RunId = '{run.run_id}'")[0][0]
    assert page.locator("#versions-table tbody tr").count() == versions >= 1
    snap("runs.png")


def check_rollouts(page: Any, base: str, sql: Any, snap: Any) -> None:
    page.goto(base + "/rollouts")
    page.wait_for_selector("#rollouts-table tbody tr", timeout=WAIT_MS)
    total = sql("SELECT count() FROM {db}.rollouts")[0][0]
    assert page.locator("#rollouts-total").inner_text() == str(total)
    assert page.locator("#rollouts-table tbody tr").count() == min(total, 50)
    snap("rollouts.png")
    page.select_option("#filter-status", "succeeded")
    page.click("#filters button[type=submit]")
    page.wait_for_url("**/rollouts?status=succeeded**", timeout=WAIT_MS)
    page.wait_for_selector("#rollouts-table tbody tr", timeout=WAIT_MS)
    succeeded = sql("SELECT count() FROM {db}.rollouts WHERE Status = 'succeeded'")[0][0]
    assert page.locator("#rollouts-total").inner_text() == str(succeeded) and succeeded >= 1
    statuses = [row.get_attribute("data-status") for row in page.locator("#rollouts-table tbody tr").all()]
    assert set(statuses) == {"succeeded"}
    snap("rollouts-succeeded.png")


def check_rollout(page: Any, sql: Any, snap: Any) -> None:
    link = page.locator("#rollouts-table tbody tr:first-child a").first
    rollout = link.inner_text()
    link.click()
    page.wait_for_url("**/rollout?id=**", timeout=WAIT_MS)
    page.wait_for_selector(".span-row", timeout=WAIT_MS)
    attempt = int(page.url.rsplit("attempt=", 1)[1].split("&")[0])
    spans = sql(f"SELECT count() FROM {{db}}.otel_traces WHERE RolloutId = '{rollout}' AND Attempt = {attempt}")[0][0]
    assert page.locator(".span-row").count() == spans >= 4  # the rollout, the agent's calls and judge, the gateway's
    calls = sql(f"SELECT count() FROM {{db}}.transitions WHERE RolloutId = '{rollout}' AND Attempt = {attempt}")[0][0]
    assert page.locator("#transitions-table tbody tr").count() == calls == 2
    snap("rollout.png")
    call = page.locator('.span-row[data-llm="1"]').first
    call.locator(".span-line").click()
    detail = call.locator(".span-detail")
    detail.wait_for(timeout=WAIT_MS)
    text = detail.inner_text()
    question = sql(
        f"SELECT SpanAttributes['gen_ai.input.messages'] FROM {{db}}.otel_traces WHERE RolloutId = "
        f"'{rollout}' AND Attempt = {attempt} AND SpanId = '{call.get_attribute('data-span')}'"
    )[0][0]
    assert "What is" in question and "prompt" in text and "response" in text
    assert text.count("What is") >= 1  # the decoded prompt, as the gateway recorded it
    snap("llm-call.png")


def check_models(page: Any, base: str, run: LocalRun, snap: Any) -> None:
    """The run's one version (not gated: no decision), and that nothing serves the promoted gateways."""
    page.goto(base + "/models")
    page.wait_for_selector("#versions-table tbody tr", timeout=WAIT_MS)
    row = page.locator("#versions-table tbody tr[data-version='1']").inner_text()
    assert run.run_id in row and "checkpoints/v1" in row
    assert "Nothing promoted" in page.locator("#serving").inner_text()
    snap("models.png")


def check_dead_letters(page: Any, base: str, sql: Any, snap: Any) -> None:
    page.goto(base + "/dead-letters")
    page.wait_for_selector("#dead-table tbody tr", timeout=WAIT_MS)
    [[total, reason]] = sql("SELECT count(), any(Error) FROM {db}.dead_letters")
    assert page.locator("#dead-total").inner_text() == str(total) and total >= 1
    assert "not valid OTLP protobuf" in reason and reason in page.locator("#dead-table").inner_text()
    snap("dead-letters.png")
