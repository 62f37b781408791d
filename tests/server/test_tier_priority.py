"""Key tiers set scheduling priority (the config's `tiers`), in `llmserve serve` and behind `llmserve gateway`:
a request runs at its tier's priority plus its own, which may only put it later."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from llmserve.cli import build_parser
from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform.keys import ApiKey
from llmserve.server.errors import APIError
from llmserve.server.gateway import MAX_PRIORITY, Platform
from llmserve.server.serve import make_app
from tests.server.platform_fixtures import MODEL, MODES, PlatformServer, serve_platform

TIERS = {"gold": -10, "free": 10}


@pytest.fixture(scope="module")
def one_at_a_time(tiny_llama_dir: Path) -> Iterator[AsyncLLM]:
    """One sequence runs at a time; the rest wait in the core's queue, in priority order."""
    engine = AsyncLLM.from_config(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64,
                                               max_model_len=256, scheduling_policy="priority", max_num_seqs=1))
    yield engine
    engine.close()


@pytest.fixture(params=MODES)
def server(one_at_a_time: AsyncLLM, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PlatformServer]:
    yield from serve_platform(one_at_a_time, tmp_path, mode=request.param, tier_priorities=TIERS)


def completion(priority: int | None = None, **extra: object) -> dict:
    body: dict = {"model": MODEL, "prompt": [5] * 10, "max_tokens": 2, **extra}
    return body if priority is None else {**body, "priority": priority}


@asynccontextmanager
async def blocker_running(http: httpx.AsyncClient, secret: str) -> AsyncIterator[None]:
    """A long stream of `secret`'s holding the one sequence slot while the block runs; dropped at its end."""
    blocker = completion(max_tokens=200, ignore_eos=True, stream=True)
    async with http.stream("POST", "/v1/completions", json=blocker,
                           headers={"Authorization": f"Bearer {secret}"}) as stream:
        lines = stream.aiter_lines()
        while not (await anext(lines)).startswith("data: "):
            pass  # the blocker runs
        yield


def test_a_gold_keys_request_overtakes_free_ones_that_waited_longer(server: PlatformServer) -> None:
    _, free = server.new_key("free-key", tier="free")
    _, gold = server.new_key("gold-key", tier="gold")

    async def main() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:

            async def send(name: str, secret: str, priority: int | None) -> None:
                response = await http.post("/v1/completions", json=completion(priority),
                                           headers={"Authorization": f"Bearer {secret}"})
                response.raise_for_status()
                finished.append(name)

            async with blocker_running(http, free):
                senders = []
                for name, secret, priority in (("free, later by 3", free, 3), ("free", free, None), ("gold", gold, 0)):
                    senders.append(asyncio.ensure_future(send(name, secret, priority)))
                    while server.engine.num_waiting < len(senders):  # each waits before the next is sent
                        await asyncio.sleep(0.01)
            await asyncio.gather(*senders)
        return finished

    assert asyncio.run(main()) == ["gold", "free", "free, later by 3"]


def test_a_tiered_key_cannot_ask_to_run_earlier_than_its_tier(server: PlatformServer) -> None:
    _, free = server.new_key("free-key", tier="free")
    _, other = server.new_key("untiered", tier="internal")
    with server.client(free) as client:
        refused = client.post("/v1/completions", json=completion(-1))
    with server.client(other) as client:
        untiered = client.post("/v1/completions", json=completion(-1))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "priority" and "tier 'free'" in refused.json()["error"]["message"]
    assert untiered.status_code == 200  # a tier the config does not name: the request's own priority
    assert len(server.wait_for_usage_rows(1)) == 1


def test_the_priority_of_a_request() -> None:
    key = ApiKey(id="k", name="k", prefix="", tier="gold", rpm=None, tpm=None, models=None, is_admin=False,
                 created_at=None, revoked_at=None)  # type: ignore[arg-type]
    platform = Platform(tier_priorities=TIERS)
    assert platform.priority_of(None, -5) == -5  # no key (local mode): its own
    assert platform.priority_of(key, 0) == -10
    assert platform.priority_of(key, 4) == -6
    assert platform.priority_of(replace(key, tier="free"), MAX_PRIORITY - 3) == MAX_PRIORITY  # stays an int64
    with pytest.raises(APIError, match="must not be negative"):
        platform.priority_of(key, -1)


def test_serve_refuses_tier_priorities_a_first_come_first_served_model_would_ignore(tiny_llama_dir: Path) -> None:
    platform = Platform(tier_priorities=TIERS)
    first_come = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir)])
    with pytest.raises(SystemExit, match="the config's tiers set priorities, which need --scheduling-policy priority "
                       rf"\(first come, first served: {tiny_llama_dir.name}\)"):
        make_app(first_come, None, platform)


@pytest.fixture
def small_queue(one_at_a_time: AsyncLLM, tmp_path: Path) -> Iterator[PlatformServer]:
    yield from serve_platform(one_at_a_time, tmp_path, tier_priorities=TIERS, max_waiting_requests=2)


def test_a_full_queue_sheds_a_free_request_but_admits_a_gold_one_that_would_run_first(
    small_queue: PlatformServer,
) -> None:
    server = small_queue
    _, free = server.new_key("free-key", tier="free")
    _, gold = server.new_key("gold-key", tier="gold")

    async def main() -> tuple[int, int, list[str]]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:

            async def send(name: str, secret: str) -> int:
                response = await http.post("/v1/completions", json=completion(),
                                           headers={"Authorization": f"Bearer {secret}"})
                if response.status_code == 200:
                    finished.append(name)
                return response.status_code

            async with blocker_running(http, free):
                queued = [asyncio.ensure_future(send(f"free {i}", free)) for i in range(2)]
                while server.engine.num_waiting < 2:  # the queue is full
                    await asyncio.sleep(0.01)
                shed = await send("free 2", free)
                admitted = asyncio.ensure_future(send("gold", gold))
                while server.engine.num_waiting < 3 and not admitted.done():  # queued, or refused
                    await asyncio.sleep(0.01)
            gold_status = await admitted
            await asyncio.gather(*queued)
        return shed, gold_status, finished

    shed, gold_status, finished = asyncio.run(main())
    assert (shed, gold_status) == (503, 200)
    # the gold request ran before both queued free ones (which of those two reached the server first is the
    # connections' race)
    assert finished[0] == "gold" and sorted(finished[1:]) == ["free 0", "free 1"]
