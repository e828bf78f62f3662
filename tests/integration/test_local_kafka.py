"""The local broker's lifecycle and its start-up errors."""

from __future__ import annotations

import pytest

from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.processes import free_port
from fulmen.infra.settings import BrokerSettings
from fulmen.schemas.errors import ConfigurationError

pytestmark = pytest.mark.integration


def test_start_is_idempotent_and_status_tells_where_things_are(kafka_broker: LocalKafka) -> None:
    before = kafka_broker.status()
    assert before.running and before.pid
    after = kafka_broker.start()
    assert after.pid == before.pid
    assert after.log_file.exists() and "Kafka Server started" in after.log_file.read_text()
    assert (kafka_broker.data_dir / "server.properties").read_text().count("auto.create.topics.enable=false") == 1


def test_a_taken_port_is_a_configuration_error(kafka_broker: LocalKafka, tmp_path) -> None:
    clash = LocalKafka(BrokerSettings(port=kafka_broker.broker.port, controller_port=free_port()), tmp_path)
    with pytest.raises(ConfigurationError, match=rf"port {kafka_broker.broker.port} .* is taken.*FULMEN_BROKER_PORT"):
        clash.start()


def test_same_ports_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match="must differ"):
        LocalKafka(BrokerSettings(port=9500, controller_port=9500), tmp_path)


def test_stop_when_not_running_says_so(tmp_path) -> None:
    assert LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), tmp_path).stop() is False


def test_missing_java_is_explained(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port(), cache_dir=tmp_path), tmp_path)
    with pytest.raises(ConfigurationError, match="Java 17\\+ is needed.*FULMEN_KAFKA_BOOTSTRAP"):
        broker.start()
