"""Replicas found by DNS: a pool entry `dns+http://name:port` stands for one replica per address the
name resolves to, `http://address:port` each. In Kubernetes the name is a headless Service's, which
resolves to the pod IP of every ready replica, so each pod is a backend the gateway routes to by its
own cache and load. The names are resolved at start and every `interval_s` after; an address that
appears joins its pool (health-checked before it gets requests), one that disappears leaves it
(requests it is serving finish). A failed lookup keeps the addresses known so far."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

from llmserve.gateway.pool import DNS_SCHEME, Pool

logger = logging.getLogger(__name__)

# A host name -> its addresses (IPv4 or IPv6, as text). Injectable, so tests can point a name anywhere.
Resolver = Callable[[str], Awaitable[list[str]]]


async def resolve_host(host: str) -> list[str]:
    """Every address `host` resolves to now (the system resolver, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def replica_url(entry: str, address: str) -> str:
    """`dns+http://name:port` and one of the name's addresses -> `http://address:port`."""
    parts = urlsplit(entry.removeprefix(DNS_SCHEME))
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path.rstrip('/')}"


def entry_host(entry: str) -> str:
    host = urlsplit(entry.removeprefix(DNS_SCHEME)).hostname
    if not host:
        raise ValueError(f"{entry!r}: a dns+ entry needs a host name, e.g. dns+http://replicas:8000.")
    return host


class Discovery:
    """Keeps the pools' `dns+` entries resolved, on one task, until stopped."""

    def __init__(
        self, pools: Sequence[Pool], *, resolver: Resolver = resolve_host, interval_s: float = 5.0
    ) -> None:
        self.pools = [pool for pool in pools if pool.dns_entries]
        self.resolver = resolver
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    async def resolve_all(self) -> None:
        await asyncio.gather(*(self.resolve(pool, entry) for pool in self.pools for entry in pool.dns_entries))

    def start(self) -> None:
        if self.pools:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.resolve_all()
            except Exception:  # a bug here must not stop discovery
                logger.exception("gateway: resolving the pools' dns+ entries failed")

    async def resolve(self, pool: Pool, entry: str) -> None:
        """Make the pool's replicas from `entry` those its name resolves to now."""
        try:
            addresses = await self.resolver(entry_host(entry))
        except OSError as exc:
            logger.warning("gateway: could not resolve %s (keeping its %d replicas): %s", entry,
                           sum(replica.source == entry for replica in pool.replicas), exc)
            return
        wanted = {replica_url(entry, address) for address in addresses}
        for replica in [replica for replica in pool.replicas if replica.source == entry]:
            if replica.url not in wanted:
                pool.remove(replica)
        for url in sorted(wanted):
            pool.add(url, source=entry)
