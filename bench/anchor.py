"""The anchor system for side-by-side benches: Agent Lightning 0.3.0 in its own virtualenv, and its store server.

The anchor is a reference, never a test dependency: nothing under ``make test`` imports this module. ``install()``
builds ``~/.cache/fulmen/anchor-venv`` once (``agentlightning==0.3.0`` and LiteLLM's proxy extra, every dependency
resolved as of 2025-12-25, the day after its release) with the project's ``uv``; later calls only check it.
``AnchorStore`` runs the anchor's LightningStore server (``agentlightning.cli.store``, in-memory backend) in its
own process: it serves the store's HTTP API under ``/v1/agl`` and its OTLP/HTTP receiver at ``/v1/traces``.

    .venv/bin/python bench/anchor.py   # installs (if needed) and prints the venv's python
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

VERSION = "0.3.0"
EXCLUDE_NEWER = "2025-12-25"
ROLLOUT_ID_KEY = "agentlightning.rollout_id"  # the resource attributes its OTLP receiver files spans under
ATTEMPT_ID_KEY = "agentlightning.attempt_id"
VENV = Path.home() / ".cache" / "fulmen" / "anchor-venv"
PYTHON = VENV / "bin" / "python"
ROOT = Path(__file__).resolve().parent.parent


def installed() -> bool:
    """True when the anchor's virtualenv imports agentlightning at the pinned version."""
    if not PYTHON.exists():
        return False
    probe = subprocess.run(
        [str(PYTHON), "-c", "import agentlightning, sys; print(agentlightning.__version__)"],
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0 and probe.stdout.strip() == VERSION


def install() -> Path:
    """Build the anchor's virtualenv unless it is already there; returns its python."""
    if installed():
        return PYTHON
    uv = ROOT / ".venv" / "bin" / "uv"
    base = Path(sys.base_prefix) / "bin" / "python3"  # uv would otherwise try to download an interpreter
    subprocess.run([str(uv), "venv", "--allow-existing", "-p", str(base), str(VENV)], check=True)
    subprocess.run(
        [
            str(uv),
            "pip",
            "install",
            "-p",
            str(PYTHON),
            "--exclude-newer",
            EXCLUDE_NEWER,
            f"agentlightning=={VERSION}",
            "litellm[proxy]",
        ],
        check=True,
    )
    if not installed():
        raise RuntimeError(f"agentlightning {VERSION} did not install into {VENV}")
    return PYTHON


class _AnchorProcess:
    """One of the anchor's server processes (started by a subclass's ``__enter__``), stopped on exit: SIGTERM, then
    SIGKILL after 30 s."""

    process: subprocess.Popen | None = None

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0


class AnchorStore(_AnchorProcess):
    """The anchor's LightningStore server on ``port`` (in memory), started and stopped as a context manager."""

    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> AnchorStore:
        python = install()
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [
                    str(python),
                    "-m",
                    "agentlightning.cli.store",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "WARNING",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the anchor's store server exited ({self.process.returncode}); see {self.log}")
            try:
                self.get("/v1/agl/health")
                return self
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"the anchor's store server did not answer in 120 s; see {self.log}")

    @property
    def traces_url(self) -> str:
        return f"{self.url}/v1/traces"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def start_rollout(self, payload: object = None) -> tuple[str, str]:
        """A running rollout and attempt in the anchor's store (its spans are refused without one): their ids."""
        rollout = self.post("/v1/agl/rollouts", {"input": payload})
        return rollout["rollout_id"], rollout["attempt"]["attempt_id"]

    def total_spans(self) -> int:
        """Spans held by the anchor's store now (queryable through its API)."""
        return int(self.get("/v1/agl/statistics")["total_spans"])


class AnchorLLMProxy(_AnchorProcess):
    """The anchor's LiteLLM proxy (``bench/anchor_llm_proxy.py`` in its virtualenv) on ``port``, in front of
    ``upstream`` (an OpenAI base URL), recording spans in ``store``; a context manager like ``AnchorStore``."""

    def __init__(self, port: int, upstream: str, store: AnchorStore, log: Path) -> None:
        self.port = port
        self.upstream = upstream
        self.store = store
        self.log = log
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> AnchorLLMProxy:
        script = Path(__file__).with_name("anchor_llm_proxy.py")
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [str(install()), str(script), str(self.port), self.upstream, self.store.url],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the anchor's LLM proxy exited ({self.process.returncode}); see {self.log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health/liveliness", timeout=5).read()
                return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"the anchor's LLM proxy did not answer in 180 s; see {self.log}")

    def chat_url(self, rollout_id: str, attempt_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions"


if __name__ == "__main__":
    print(install())
