"""The images of a request's content parts, fetched and prepared for a vision-language model: a data: URL's
bytes, or an http(s) URL's body (fetched at once, each within `IMAGE_FETCH_TIMEOUT` seconds and
`MAX_IMAGE_BYTES`); decoding and resizing run on worker threads. And the messages as the model's chat template
takes their images."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from llmserve.errors import InvalidRequestError
from llmserve.multimodal.images import MAX_IMAGE_BYTES, data_url_bytes
from llmserve.multimodal.inputs import PreparedImage
from llmserve.server.messages import IMAGE_PARTS, with_image_parts
from llmserve.server.state import ModelEndpoint, ServerState

IMAGE_FETCH_TIMEOUT = 10.0


async def load_images(state: ServerState, endpoint: ModelEndpoint, urls: Sequence[tuple[str, str]],
                      options: Mapping[str, Any] | None = None) -> list[PreparedImage]:
    """(URL, parameter) pairs as prepared images, in order, under the image processor `options` (the request's
    `mm_processor_kwargs`, checked even without images); a 400 naming the parameter of one that cannot be had or is
    not an image, or when the model reads no images."""
    processor = endpoint.engine.input_processor
    if options is not None:
        processor.vision_options(options)
    if not urls:
        return []
    if processor.vision is None:
        raise InvalidRequestError(f"The model {endpoint.name!r} reads text only, not images.", param=urls[0][1])
    remote = [(url, param) for url, param in urls if not url.startswith("data:")]
    for url, param in remote:
        _check_host(url, param, state.allowed_media_domains)
    fetched = await _fetch_all(remote)

    def prepare() -> list[PreparedImage]:
        images = [fetched[param] if param in fetched else data_url_bytes(url, param) for url, param in urls]
        return processor.prepare_images(images, [param for _, param in urls], options)

    return await state.workers.run(prepare)


def _check_host(url: str, param: str, allowed: frozenset[str]) -> None:
    """A 400 unless `url`'s host is allowed (`--allowed-media-domains`; none given: any)."""
    if allowed and urlsplit(url).hostname not in allowed:
        raise InvalidRequestError(f"This server fetches images from {', '.join(sorted(allowed - {'none'})) or 'no host'}"
                                  " only; send the image as a data: URL.", param=param)


async def _fetch_all(urls: Sequence[tuple[str, str]]) -> dict[str, bytes]:
    if not urls:
        return {}
    timeout = aiohttp.ClientTimeout(total=IMAGE_FETCH_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        bodies = await asyncio.gather(*(_fetch(session, url, param) for url, param in urls))
    return {param: body for (_, param), body in zip(urls, bodies, strict=True)}


async def _fetch(session: aiohttp.ClientSession, url: str, param: str) -> bytes:
    try:
        async with session.get(url) as response:
            if response.status != 200:
                raise InvalidRequestError(f"Fetching the image at {url} answered {response.status}.", param=param)
            body = await response.content.read(MAX_IMAGE_BYTES + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise InvalidRequestError(f"The image at {url} could not be fetched: {exc or type(exc).__name__}.",
                                  param=param) from None
    if len(body) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"The image at {url} is more than {MAX_IMAGE_BYTES} bytes.", param=param)
    return body


def images_placed(endpoint: ModelEndpoint, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the model's chat template takes them: a message's images as parts for a template that writes
    them, else as placeholder lines before its text; a 400 when the model reads no images."""
    vision = endpoint.engine.input_processor.vision
    if vision is None:
        if any(IMAGE_PARTS in message for message in messages):
            raise InvalidRequestError(f"The model {endpoint.name!r} reads text only, not images.", param="messages")
        return messages
    tokenizer = endpoint.engine.tokenizer
    placeholder = tokenizer.convert_ids_to_tokens([vision.image_token_id])[0]
    return with_image_parts(messages, tokenizer.template_places_images(), placeholder)
