"""What a chat request asks of the chat template (vLLM's fields): its own template (`chat_template`, refused unless
the server trusts request templates: `--trust-request-chat-template`, as vLLM's flag), the documents a RAG template
reads (`documents`: Command-R's, Granite's), and more variables (`chat_template_kwargs`). A field the template would
not read is a 400 naming it rather than a prompt silently without it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jinja2

from llmserve.errors import InvalidRequestError
from llmserve.server import errors
from llmserve.tokenizer.tokenizer import Tokenizer, compile_chat_template


@dataclass(frozen=True)
class TemplateOptions:
    """The template a request renders with (None: the model's) and the variables it adds."""

    template: str | None = None
    variables: dict[str, Any] = field(default_factory=dict)

    def reads(self, tokenizer: Tokenizer, variable: str) -> bool:
        return tokenizer.template_reads(variable, self.template)


def template_options(tokenizer: Tokenizer, trusted: bool, chat_template: str | None,
                     documents: list[dict[str, str]] | None, kwargs: dict[str, Any] | None) -> TemplateOptions:
    """A request's template options, checked: its own template where the server trusts request templates (`trusted`)
    and it compiles; its documents where that template reads them."""
    template = None
    if chat_template is not None:
        if not trusted:
            raise errors.unsupported("chat_template", "A request's own chat_template is refused here: this server "
                                                      "renders the model's template only (start it with "
                                                      "--trust-request-chat-template to take them).")
        try:
            compile_chat_template(chat_template)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat_template does not compile: {exc}", param="chat_template") from None
        template = chat_template
    options = TemplateOptions(template, dict(kwargs or {}))
    if documents is not None:
        if not options.reads(tokenizer, "documents"):
            raise errors.unsupported("documents", "documents are not read by this chat template (RAG templates, "
                                                  "such as Command-R's and Granite's, read them).")
        options.variables["documents"] = documents
    return options
