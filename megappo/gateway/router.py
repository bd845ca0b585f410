"""One endpoint over several rollout workers' gateways: a session is opened on the least-loaded worker and
every later request under its key goes to that worker (its engine holds the session's prefix cache).

    router = Router([worker_url_0, worker_url_1], admin_key)     # each worker's gateway (app.make_app)
    server = GatewayServer(make_router_app(router)); url = server.start()
    # an agent anywhere (curl, a TypeScript harness): POST {url}/megappo/v1/sessions with the admin key,
    # then {url}/v1/chat/completions with the session's key, as against one gateway

The router parses no OpenAI body: it reads the Bearer key, looks up its worker and forwards the request
as sent (method, path, body, the Authorization header), returning the worker's status, body and content
type (a stream=true answer's server-sent events pass as they are); the worker checks the key itself. A key
the router never handed out is refused here (401) without reaching a worker.
Session ids and keys are the workers' own; the router adds nothing to them. Loopback by default, as the
gateways.
"""

from __future__ import annotations

import asyncio
import secrets
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response


# a worker's answer headers that a client acts on: the OpenAI SDK's retry switch (a session's 409) and a 405's Allow
PASSED_HEADERS = ("x-should-retry", "allow")


class Router:
    def __init__(self, backends: list[str], admin_key: str, timeout_s: float = 600.0):
        if not backends:
            raise ValueError("Router needs at least one gateway URL")
        self.backends = [b.rstrip("/") for b in backends]
        self.admin_key = admin_key
        self.open = [0] * len(self.backends)  # sessions open per backend (the load it balances)
        self.by_key: dict[str, int] = {}  # session key -> backend
        self.by_session: dict[str, int] = {}  # session id -> backend
        self.timeout_s = timeout_s
        self._client = None
        self._lock = asyncio.Lock()

    def client(self):
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        return self._client

    async def open_session(self, body: bytes) -> tuple[int, dict]:
        async with self._lock:  # two opens at once must not both pick the same least-loaded worker
            k = min(range(len(self.backends)), key=lambda i: (self.open[i], i))
            self.open[k] += 1
        r = await self.client().post(self.backends[k] + "/megappo/v1/sessions", content=body,
                                     headers={"Authorization": f"Bearer {self.admin_key}",
                                              "Content-Type": "application/json"})
        out = r.json()
        if r.status_code != 200:
            self.open[k] -= 1
            return r.status_code, out
        self.by_key[out["api_key"]], self.by_session[out["session_id"]] = k, k
        return 200, {**out, "worker": k}

    def is_admin(self, key: Optional[str]) -> bool:
        return key is not None and secrets.compare_digest(key, self.admin_key)

    def backend_for(self, key: Optional[str], session: Optional[str]) -> Optional[int]:
        """The worker of a session key; the admin's calls on a session go to the session's worker."""
        if key is not None and key in self.by_key:
            return self.by_key[key]
        if self.is_admin(key) and session is not None:
            return self.by_session.get(session)
        return None

    def closed(self, session: str) -> None:
        """A session closed on its worker: one less open there. Its key stays mapped, so a late request under
        it gets the worker's own answer (the session is gone) rather than the router's."""
        k = self.by_session.pop(session, None)
        if k is not None:
            self.open[k] -= 1

    async def forward(self, k: int, method: str, path: str, body: bytes,
                      authorization: str) -> tuple[int, bytes, str, dict]:
        """The worker's status, body, content type and the headers a client acts on (PASSED_HEADERS)."""
        r = await self.client().request(method, self.backends[k] + path, content=body,
                                        headers={"Authorization": authorization, "Content-Type": "application/json"})
        passed = {h: r.headers[h] for h in PASSED_HEADERS if h in r.headers}
        return r.status_code, r.content, r.headers.get("content-type", "application/json"), passed

    async def stats(self) -> dict:
        per = []
        for url in self.backends:
            r = await self.client().get(url + "/megappo/v1/stats", headers={"Authorization": f"Bearer {self.admin_key}"})
            per.append(r.json())
        return {"workers": len(self.backends), "open_sessions": list(self.open), "per_worker": per}

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _error(status: int, message: str):
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500 else "api_error",
                                   "code": status}}, status_code=status)


def make_router_app(router: Router):
    @asynccontextmanager
    async def lifespan(_):
        yield
        await router.aclose()

    app = FastAPI(title="megappo rollout router", docs_url=None, redoc_url=None, lifespan=lifespan)

    def bearer(authorization: Optional[str]) -> Optional[str]:
        if authorization and authorization.startswith("Bearer "):
            return authorization[len("Bearer "):].strip()
        return None

    @app.post("/megappo/v1/sessions")
    async def open_session(request: Request, authorization: Optional[str] = Header(None)):
        if not router.is_admin(bearer(authorization)):
            return _error(401, "opening a session needs the admin key: send Authorization: Bearer <admin key>")
        status, out = await router.open_session(await request.body())
        return JSONResponse(out, status_code=status)

    @app.get("/megappo/v1/stats")
    async def stats(authorization: Optional[str] = Header(None)):
        if not router.is_admin(bearer(authorization)):
            return _error(401, "stats need the admin key: send Authorization: Bearer <admin key>")
        return await router.stats()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def proxy(path: str, request: Request, authorization: Optional[str] = Header(None)):
        parts = path.split("/")
        session = parts[3] if len(parts) > 3 and parts[:3] == ["megappo", "v1", "sessions"] else None
        k = router.backend_for(bearer(authorization), session)
        if k is None:
            return _error(401, "unknown API key or session: open a session (POST /megappo/v1/sessions) and send "
                               "its api_key as Authorization: Bearer <key>")
        status, content, kind, headers = await router.forward(k, request.method, "/" + path, await request.body(),
                                                              authorization)
        if status == 200 and session is not None and parts[-1] == "close":
            router.closed(session)
        return Response(content, status_code=status, media_type=kind, headers=headers)

    return app
