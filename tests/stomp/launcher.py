"""Test-only broker launcher with the STOMP listener (independent of the CLI wiring).

``python -m tests.stomp.launcher --data DIR --port P --stomp-port S [--sync MODE]
[--users FILE.toml] [--heartbeat-min-ms N] [--heartbeat-grace G]`` builds a
:class:`~txbroker.server.config.ServerConfig` and the STOMP settings, starts a
:class:`~txbroker.server.app.BrokerServer` (which opens both listeners), prints
``txbroker ready native=<port> stomp=<port>`` and serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import tomllib
from pathlib import Path

from txbroker.server.app import BrokerServer
from txbroker.server.config import ServerConfig
from txbroker.server.edges.stomp.connection import StompSettings


async def main(args: argparse.Namespace) -> None:
    users: dict[str, str] = {}
    if args.users:
        with open(args.users, "rb") as handle:
            users = dict(tomllib.load(handle).get("users", {}))
    config = ServerConfig(host="127.0.0.1", stomp_port=args.stomp_port, port=args.port, amqp_port=0,
                          data=Path(args.data), sync=args.sync, users=users)
    settings = StompSettings(heartbeat_send_min_ms=args.heartbeat_min_ms,
                             heartbeat_receive_min_ms=args.heartbeat_min_ms,
                             heartbeat_grace=args.heartbeat_grace,
                             connect_timeout_s=args.connect_timeout)
    server = BrokerServer(config, stomp_settings=settings)
    await server.start()
    if not server.stomp_port:  # --stomp-port 0: any free port
        await server.listen_stomp("127.0.0.1", 0)
    print(f"txbroker ready native={server.port} stomp={server.stomp_port} "
          f"recovered={server.recovered_messages}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--stomp-port", type=int, default=0)
    parser.add_argument("--sync", default="fdatasync")
    parser.add_argument("--users", default=None)
    parser.add_argument("--heartbeat-min-ms", type=int, default=1000)
    parser.add_argument("--heartbeat-grace", type=float, default=1.5)
    parser.add_argument("--connect-timeout", type=float, default=30.0)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main(args))


if __name__ == "__main__":
    run()
