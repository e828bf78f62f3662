"""Shared fixtures: one real Kafka broker and one embedded store per test session, isolated per test.

Each test gets its own topic prefix (fresh topics) and its own database (fresh tables), so tests never see
each other's data although they share the broker and the chdb directory (chdb allows one directory per
process).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fulmen.infra.kafka.admin import ensure_topics
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.processes import free_port
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.infra.store import Store


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests build their settings explicitly: no FULMEN_* from the developer's shell leaks in."""
    for name in list(os.environ):
        if name.startswith("FULMEN_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(Path(__file__).parent)  # no stray .env


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's consoles 200 columns wide in every test that runs a command in this process (CliRunner). Rich fixes
    a console's width when it is created if COLUMNS is set then, so without this the width would depend on which
    test first imported the CLI in this worker (the order differs between runs on several workers)."""
    from fulmen.cli import base

    monkeypatch.setattr(base.console, "_width", 200)
    monkeypatch.setattr(base.err, "_width", 200)


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A real single-node Kafka for the whole session, on free ports."""
    data = tmp_path_factory.mktemp("kafka")
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), data)
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chdb")


def make_settings(tmp_path: Path, bootstrap: str | None, store_path: Path, **kafka: object) -> FulmenSettings:
    unique = uuid.uuid4().hex[:10]
    return FulmenSettings(
        home=tmp_path,
        kafka={"bootstrap": bootstrap, "topic_prefix": f"t{unique}.", "connect_timeout_s": 10.0, **kafka},
        clickhouse={"path": store_path, "database": f"test_{unique}", "read_port": 0},
    )


@pytest.fixture
def settings(tmp_path: Path, kafka_broker: LocalKafka, store_path: Path) -> FulmenSettings:
    """Settings for one test: the session broker, fresh topics (created), a fresh database."""
    settings = make_settings(tmp_path, kafka_broker.bootstrap, store_path)
    asyncio.run(ensure_topics(settings))
    return settings


@pytest.fixture
def store(tmp_path: Path, store_path: Path) -> Iterator[Store]:
    """The embedded store with a fresh, migrated database."""
    settings = make_settings(tmp_path, None, store_path)
    store = Store.open(settings)
    store.migrate()
    yield store
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


@pytest.fixture
def linked_store(settings: FulmenSettings) -> Iterator[Store]:
    """The store of ``settings`` (same database), migrated."""
    store = Store.open(settings)
    store.migrate()
    yield store
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny chat model built offline (random weights): writes noise, but every token is recorded."""
    from fulmen.algorithm.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tool_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model taught to call get_weather for Paris, then answer from the tool's result."""
    from tests.models import taught_copy

    return taught_copy(tiny_model, tmp_path_factory.mktemp("tool-model"))
