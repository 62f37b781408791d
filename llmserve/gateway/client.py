"""The gateway's HTTP client for its replicas: one aiohttp session per gateway, its connections pooled
and kept alive. aiohttp, not httpx: a proxied request costs several times less CPU through it
(BENCHMARKS.md, "Gateway overhead"), and the gateway spends most of its CPU on these requests."""

from __future__ import annotations

import aiohttp

# A replica that dies mid-request shows up as one of aiohttp's ClientErrors (refused, reset, a body
# broken off) or as an OSError of the socket underneath: all of them are that replica's failure.
REPLICA_ERRORS = (aiohttp.ClientError, OSError)

CONNECT_TIMEOUT_S = 2.0  # connecting is quick or the replica is gone
READ_TIMEOUT_S = 600.0  # generating may take minutes
# Below the replicas' keep-alive (5 s, server/serve.py): an idle connection is closed here first, never
# picked for a request at the moment the replica closes it (which would look like a failing replica).
KEEPALIVE_S = 4.0
# Not added to a forwarded request: a body without a content type stays without one (a replica would
# not read `application/octet-stream` as JSON), and the client's own encodings are what is asked for.
_SKIPPED_AUTO_HEADERS = ("Content-Type", "Accept-Encoding")


class ReplicaClient:
    """The session (opened on the gateway's event loop, at its start) every request to a replica uses."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=_SKIPPED_AUTO_HEADERS,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S),
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("The replica client is used before the gateway started.")
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
