"""Where a synchronous agent runs: in a capped pool of threads (default) or in a process of its own per rollout.

A sync agent cannot be interrupted from outside its thread: when its rollout times out (or the runner shuts
down) the runner reports the attempt and may run the next one, but the thread goes on until the agent returns.
``FULMEN_RUNNER_SYNC_ISOLATION`` chooses:

- ``thread``: the agent runs in a pool of at most ``FULMEN_RUNNER_SYNC_THREADS`` threads (timed-out agents
  still running included; further calls wait for a thread). A timed-out agent is logged as still running.
- ``process``: each call runs in a fresh Python process (``python -m fulmen.producers.runner.isolated``) that imports
  the agent by its ``module:function`` path, traces under the rollout's span (context and rollout attributes
  passed along) and exports its spans itself; on timeout or shutdown its process group is killed. Costs a
  process start per rollout; the agent's task, endpoint and reward cross as JSON.

Async agents always run on the runner's event loop, where cancellation stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from enum import StrEnum
from typing import Any

from opentelemetry import propagate

from fulmen.producers.runner.agent import AgentError, LLMEndpoint, check_reward
from fulmen.producers.runner.tracing import CURRENT_ROLLOUT

__all__ = ["ProcessAgent", "SyncIsolation", "ThreadAgent", "sync_caller"]

log = logging.getLogger(__name__)


class SyncIsolation(StrEnum):
    THREAD = "thread"
    PROCESS = "process"


class ThreadAgent:
    """Runs a sync agent in a pool of at most ``max_threads`` threads (the rollout's context copied in)."""

    def __init__(self, agent: Callable[..., Any], max_threads: int) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be >= 1")
        self.agent = agent
        self.max_threads = max_threads
        self.executor = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="fulmen-agent")
        self.busy = 0
        self._lock = threading.Lock()

    def _run(self, task: dict[str, Any], llm: LLMEndpoint) -> Any:
        with self._lock:
            self.busy += 1
        try:
            return self.agent(task, llm)
        finally:
            with self._lock:
                self.busy -= 1

    async def call(self, task: dict[str, Any], llm: LLMEndpoint) -> float | None:
        context = contextvars.copy_context()
        future = asyncio.get_running_loop().run_in_executor(self.executor, context.run, self._run, task, llm)
        try:
            result = await future
            if inspect.isawaitable(result):  # a plain function that returns a coroutine
                result = await result
        except asyncio.CancelledError:
            request = CURRENT_ROLLOUT.get()
            log.warning(
                "rollout %s attempt %s: the sync agent was given up on (timed out or shutting down) but a thread "
                "cannot be stopped: it runs on until the agent returns (%d of %d agent threads busy). Set "
                "FULMEN_RUNNER_SYNC_ISOLATION=process to run sync agents in a process that is killed instead",
                request.rollout_id if request else "?",
                request.attempt if request else "?",
                self.busy,
                self.max_threads,
            )
            raise
        except Exception as exc:
            raise AgentError(f"{type(exc).__name__}: {exc}") from exc
        return check_reward(result)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class ProcessAgent:
    """Runs a sync agent (by its ``module:function`` path) in a fresh process per call, killed when given up."""

    def __init__(self, path: str, otlp_endpoint: str | None) -> None:
        self.path = path
        self.otlp_endpoint = otlp_endpoint or ""
        self.processes: set[int] = set()  # pids of the agents' processes alive now

    def _payload(self, task: dict[str, Any], llm: LLMEndpoint) -> bytes:
        request = CURRENT_ROLLOUT.get()
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the rollout span, so the agent's spans nest under it
        return json.dumps(
            {
                "agent": self.path,
                "sys_path": sys.path,
                "task": task,
                "llm": asdict(llm),
                "request": request.model_dump(mode="json") if request is not None else None,
                "carrier": carrier,
                "otlp_endpoint": self.otlp_endpoint,
            }
        ).encode()

    async def call(self, task: dict[str, Any], llm: LLMEndpoint) -> float | None:
        payload = self._payload(task, llm)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fulmen.producers.runner.isolated",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self.processes.add(process.pid)
        try:
            out, _ = await process.communicate(payload)
        except BaseException:  # cancelled (timed out, shutting down): the agent is stopped for real
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            log.info("the agent's process %d was killed", process.pid)
            raise
        finally:
            self.processes.discard(process.pid)
        return _reply(out, process.returncode)

    def close(self) -> None:
        return None


def _reply(out: bytes, returncode: int | None) -> float | None:
    try:
        reply = json.loads(out.decode()) if out else None
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        raise AgentError(f"the agent's process ended (exit status {returncode}) without a result")
    if reply.get("error"):
        raise AgentError(str(reply["error"]))
    return check_reward(reply.get("reward"))


def sync_caller(
    isolation: str, agent: Callable[..., Any], path: str, *, max_threads: int, otlp_endpoint: str | None
) -> ThreadAgent | ProcessAgent:
    """The caller for a sync agent under ``isolation`` (``thread`` or ``process``)."""
    if SyncIsolation(isolation) is SyncIsolation.PROCESS:
        if not path:
            raise AgentError("process isolation needs the agent's module:function path (FULMEN_RUNNER_AGENT)")
        return ProcessAgent(path, otlp_endpoint)
    return ThreadAgent(agent, max_threads)
