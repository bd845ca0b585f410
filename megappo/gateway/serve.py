"""`GatewayServer`: a gateway app (app.make_app) served by uvicorn in a background
thread, on loopback and any free port unless told otherwise (tests, the rollout workers' AgentRunner).
The `megappo serve` command is megappo/serve.py."""

from __future__ import annotations

import threading
import time


class GatewayServer:
    """uvicorn in a background thread; `url` once started (port 0: any free port)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="megappo-gateway", daemon=True)
        self.url = ""

    def start(self, timeout: float = 30) -> str:
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the gateway's HTTP server did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
