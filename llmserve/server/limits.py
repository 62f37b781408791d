"""Bounds on the work one request can ask for, checked before that work is done: the body's size (at
the ASGI level, before anything parses it) and a prompt's length (from its characters, before it is
tokenized)."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.errors import ContextLengthExceededError
from llmserve.server.errors import BodyTooLarge, body_too_large
from llmserve.tokenizer.tokenizer import Tokenizer

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # an upload's body: the file and the form's other parts and boundaries


def upload_limits(max_file_bytes: int | None) -> dict[str, int]:
    """The body bound of the upload path (/v1/files), when the server takes files."""
    return {"/v1/files": max_file_bytes + MULTIPART_OVERHEAD_BYTES} if max_file_bytes is not None else {}

# A normalizer may shrink text a little before it is split (stripping, NFKC): the character bound
# below allows for halving it, so it only refuses prompts that are too long whatever the normalizer does.
_NORMALIZER_SLACK = 2


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes` (over `path_limits[path]` for those paths: uploads): at once from its
    Content-Length, without reading it, or, for a chunked body, as soon as the bytes received pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.max_bytes)
        declared = content_length(scope)
        if declared is not None and declared > limit:
            await body_too_large(limit).response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counting_receive, send)


def content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class PromptBound:
    """Refuses a text prompt that is certainly longer than the context window, from its length alone.

    No token stands for more characters than the vocabulary's longest token has bytes (a byte-level
    token's characters are one byte each; a SentencePiece "▁" is three bytes for one space), so a text
    has at least len(text) / longest tokens."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        longest = max((len(token.encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab()), default=1)
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * max(longest, 1) * _NORMALIZER_SLACK

    def check(self, text_length: int, param: str = "prompt") -> None:
        if text_length > self.max_chars:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens, and your prompt "
                f"({text_length} characters) is certainly longer. Please reduce the prompt.",
                param=param,
            )
