"""The private nats-server is supervised like every other process: killed, it comes back on the same port
with its JetStream store, and the clients reconnect (finding 8 of the edge review)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import nats

from loom.runtime.natsserver import NatsServer


async def test_a_killed_server_comes_back_with_its_store(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats")
    url = await server.start()
    server.supervise()
    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.a", b"before")
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGKILL)
        for _ in range(200):
            if server.restarts == 1 and server.proc.returncode is None and server.url == url:
                break
            await asyncio.sleep(0.05)
        assert server.restarts == 1 and server.url == url
        # The same client reconnects and finds what it stored before the kill.
        for _ in range(100):
            if nc.is_connected:
                break
            await asyncio.sleep(0.1)
        msg = await js.get_msg("KEEP", seq=1)
        assert msg.data == b"before"
        await js.publish("keep.a", b"after")
        assert (await js.stream_info("KEEP")).state.messages == 2
    finally:
        await nc.close()
        await server.stop()
    assert server.proc is not None and server.proc.returncode is not None and server.restarts == 1
