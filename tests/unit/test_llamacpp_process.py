"""The llama-server child process, with small scripts standing in for the binary: it serves once /health answers,
its log lines reach the log and the error of a server that dies, and stop() leaves no process behind."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from fulmen.producers.llm_gateway.backends.llamacpp_process import LlamaServer, ServerStartError

HEALTHY = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("model loaded", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
DYING = """
import sys
print("loading model", flush=True)
print("error loading model: unknown architecture", file=sys.stderr, flush=True)
sys.exit(1)
"""


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


async def test_a_server_serves_once_healthy_and_stops_without_a_trace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = LlamaServer(script(tmp_path, "ok", HEALTHY), tmp_path / "m.gguf", ["-np", "2"], "test")
    with caplog.at_level(logging.DEBUG, logger="fulmen.producers.llm_gateway.backends.llamacpp_process"):
        await server.start(timeout_s=30)
        assert server.alive and server.url.startswith("http://127.0.0.1:")
        pid = server.process.pid
        await server.stop()
    assert not server.alive and not Path(f"/proc/{pid}").exists()
    assert "llama-server test: model loaded" in caplog.text  # its lines, at DEBUG


async def test_a_server_that_exits_says_why_with_its_last_lines(tmp_path: Path) -> None:
    server = LlamaServer(script(tmp_path, "dies", DYING), tmp_path / "m.gguf", [], "test")
    with pytest.raises(ServerStartError, match="exited with 1") as caught:
        await server.start(timeout_s=30)
    assert "unknown architecture" in caught.value.message and not server.alive


async def test_a_server_that_never_gets_healthy_is_stopped_after_the_timeout(tmp_path: Path) -> None:
    server = LlamaServer(script(tmp_path, "hangs", "import time\ntime.sleep(60)"), tmp_path / "m.gguf", [], "t")
    with pytest.raises(ServerStartError, match="did not load"):
        await server.start(timeout_s=0.5)
    assert not server.alive


async def test_a_log_line_longer_than_the_reader_limit_does_not_stall_the_server(tmp_path: Path) -> None:
    noisy = HEALTHY.replace('print("model loaded", flush=True)', 'print("x" * 3_000_000, flush=True)')
    server = LlamaServer(script(tmp_path, "noisy", noisy), tmp_path / "m.gguf", [], "test")
    await server.start(timeout_s=30)
    try:
        assert server.alive
    finally:
        await server.stop()
