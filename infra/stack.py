"""The local stack's services, configured one way for every user: ``fulmen consume``, the OTLP gateway, the LLM
gateway, the runners and (when installed) the dashboard, as :class:`fulmen.infra.processes.ServiceSpec` s.

:func:`fulmen.algorithm.local.run_locally` (a training run: the demo, the examples, ``fulmen train --local``)
and ``fulmen up`` both start what :func:`core_services` returns, on the ports of a :class:`StackPorts`, and
hand agents the two settings of :meth:`StackPorts.agent_settings`. Only ``FULMEN_*`` variables configure the
processes, so a service started here behaves as the same command started by hand.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from fulmen.infra.processes import FULMEN, ServiceSpec, free_port

__all__ = ["DASHBOARD_PORT", "StackPorts", "core_services", "dashboard_available", "dashboard_spec", "runner_spec"]

HOST = "127.0.0.1"
DASHBOARD_PORT = 8890  # FULMEN_DASHBOARD_PORT's default (the dashboard's own settings section)


@dataclass(frozen=True)
class StackPorts:
    """Where the stack listens on 127.0.0.1: the store's read-only SQL endpoint (served by ``fulmen consume``),
    OTLP/HTTP, the OpenAI-compatible API, and the dashboard."""

    read: int
    otlp: int
    llm: int
    dashboard: int = DASHBOARD_PORT

    @classmethod
    def free(cls) -> StackPorts:
        """Ports nothing listens on now (a training run's private stack)."""
        return cls(free_port(), free_port(), free_port(), free_port())

    @property
    def llm_url(self) -> str:
        """The LLM gateway's root (the runner adds ``/rollout/<id>/attempt/<n>/v1``)."""
        return f"http://{HOST}:{self.llm}"

    @property
    def otlp_url(self) -> str:
        """The OTLP gateway's root (``OTEL_EXPORTER_OTLP_ENDPOINT``: the SDK adds ``/v1/traces``)."""
        return f"http://{HOST}:{self.otlp}"

    @property
    def read_url(self) -> str:
        return f"http://{HOST}:{self.read}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{HOST}:{self.dashboard}"

    def agent_settings(self) -> dict[str, str]:
        """The two settings an agent needs, as environment variables the stock SDKs read."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_url, "OPENAI_BASE_URL": f"{self.llm_url}/v1"}


def core_services(
    ports: StackPorts,
    *,
    model: str,
    consume_env: Mapping[str, str] | None = None,
    llm_env: Mapping[str, str] | None = None,
    embedded: bool = True,
) -> list[ServiceSpec]:
    """``fulmen consume`` (owns the store, serves reads on ``ports.read``), the OTLP gateway and the LLM gateway
    serving ``model`` as version 0 (it follows the models topic), in start order; ``consume_env`` /
    ``llm_env``: more ``FULMEN_*`` for those two (``FULMEN_LLM_BACKEND``, a device...). ``embedded=False`` (a
    ClickHouse server, ``FULMEN_CLICKHOUSE_URL``): ``fulmen consume`` serves no reads, so it has no probe."""
    read = {"FULMEN_CLICKHOUSE_READ_PORT": str(ports.read)}
    llm = {"FULMEN_LLM_MODEL": model, "FULMEN_LLM_PORT": str(ports.llm), "FULMEN_LLM_MODEL_VERSION": "0"}
    otlp = {"FULMEN_OTLP_PORT": str(ports.otlp)}
    return [
        ServiceSpec(
            "consume", ("consume",), read | dict(consume_env or {}), f"{ports.read_url}/ping" if embedded else None
        ),
        ServiceSpec("otlp-gateway", ("otlp-gateway",), otlp, f"{ports.otlp_url}/readyz"),
        ServiceSpec("llm-gateway", ("llm-gateway",), llm | dict(llm_env or {}), f"{ports.llm_url}/readyz"),
    ]


def runner_spec(index: int, ports: StackPorts, *, agent: str, concurrency: int, group: str) -> ServiceSpec:
    """Runner number ``index`` (from 1) of consumer group ``group``, running ``agent`` against this stack."""
    env = {
        "FULMEN_RUNNER_LLM_BASE_URL": ports.llm_url,
        "FULMEN_RUNNER_OTLP_ENDPOINT": f"{ports.otlp_url}/v1/traces",
        "FULMEN_RUNNER_GROUP": group,
    }
    return ServiceSpec(f"runner-{index}", ("runner", "--agent", agent, "--concurrency", str(concurrency)), env)


def dashboard_available() -> bool:
    """Whether this installation has ``fulmen dashboard`` (``fulmen dashboard --help`` succeeds)."""
    try:
        done = subprocess.run([*FULMEN, "dashboard", "--help"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def dashboard_spec(ports: StackPorts) -> ServiceSpec:
    """``fulmen dashboard`` on ``ports.dashboard``, reading the store through ``fulmen consume``'s read port."""
    args = ("dashboard", "--host", HOST, "--port", str(ports.dashboard))
    env = {"FULMEN_DASHBOARD_PORT": str(ports.dashboard), "FULMEN_CLICKHOUSE_READ_PORT": str(ports.read)}
    return ServiceSpec("dashboard", args, env, f"{ports.dashboard_url}/healthz")
