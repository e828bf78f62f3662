"""Raw bytes over a loopback socket, for requests an HTTP client library refuses to send (lying headers, slow bodies)."""

from __future__ import annotations

import asyncio


async def send_raw(port: int, payload: bytes, wait_s: float = 10.0) -> bytes:
    """Send ``payload``, return what the server answers before it closes (or ``wait_s`` passes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    try:
        async with asyncio.timeout(wait_s):
            return await reader.read(65536)
    finally:
        writer.close()
