"""`--chat-template` (vLLM's): a Jinja template, given inline or as a file, in place of the tokenizer's own, so a
model whose tokenizer has none can chat, and one whose template is wrong can be fixed without editing it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmserve import LLM, SamplingParams
from llmserve.cli import build_parser
from llmserve.config import EngineConfig, engine_config_kwargs
from llmserve.errors import InvalidRequestError
from llmserve.tokenizer.tokenizer import Tokenizer
from tests.server.conftest import LiveServer, serving_config

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
RENDERED = "[system] Be brief.\n[user] Name a prime.\n[assistant]"


@pytest.fixture(scope="module")
def bare_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with no chat template anywhere in its tokenizer's files."""
    bare = tmp_path_factory.mktemp("bare") / "model"
    shutil.copytree(tiny_llama_dir, bare)
    config_file = bare / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    return bare


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(bare_model_dir: Path, template_file: Path) -> Iterator[LiveServer]:
    args = build_parser().parse_args(["serve", "--chat-template", str(template_file)])
    kwargs = {**engine_config_kwargs(args), "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256}
    with serving_config(EngineConfig(model=str(bare_model_dir), **kwargs), "bare") as server:
        yield server


def test_the_flags_reach_the_engine_config(tmp_path: Path):
    args = build_parser().parse_args(["serve", "--chat-template", TEMPLATE, "--tokenizer", str(tmp_path)])
    assert engine_config_kwargs(args)["chat_template"] == TEMPLATE
    assert engine_config_kwargs(args)["tokenizer"] == str(tmp_path)
    assert engine_config_kwargs(build_parser().parse_args(["serve"]))["chat_template"] is None


def test_a_model_without_a_template_chats_with_the_one_served(server: LiveServer, bare_model_dir: Path):
    tokenizer = Tokenizer.from_pretrained(bare_model_dir)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template(MESSAGES)
    expected = tokenizer.encode(RENDERED, add_special_tokens=False)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        tokenized = client.post("/tokenize", json={"model": "bare", "messages": MESSAGES})
        assert tokenized.status_code == 200 and tokenized.json()["tokens"] == expected
        reply = client.post("/v1/chat/completions", json={
            "model": "bare", "messages": MESSAGES, "max_tokens": 5, "temperature": 0,
        })
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(expected)


def test_an_inline_template_replaces_the_tokenizers_own(tiny_llama_dir: Path):
    """Offline as served: the prompt is the given template's, and the tokens follow from it."""
    long_template = "{#" + " a comment longer than any file name" * 10 + " #}" + TEMPLATE
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=32, max_model_len=256, chat_template=long_template)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == RENDERED
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (chat,) = llm.chat(MESSAGES, params)
    (plain,) = llm.generate([tokenizer.encode(RENDERED, add_special_tokens=False)], params)
    assert chat.prompt_token_ids == plain.prompt_token_ids and chat.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.parametrize(("given", "message"), [
    ("{% for m in messages %}{{ m.content }}", "chat_template does not compile"),
    ("templates/missing.jinja", "is neither a file nor a Jinja template"),
])
def test_a_template_that_cannot_be_used_fails_the_start_naming_it(tiny_llama_dir: Path, given: str, message: str):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, chat_template=given)


def test_offline_chat_takes_a_template_its_variables_and_tools_per_call(tiny_llama_dir: Path, template_file: Path):
    """vLLM's `LLM.chat(..., chat_template=, chat_template_kwargs=, tools=)`: this call's template and variables."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=32, max_model_len=256)
    tokenizer = llm.get_tokenizer()
    with_tools = TEMPLATE + "{% for t in tools %} {{ t.function.name }}{% endfor %} {{ mood }}"
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    (chat,) = llm.chat(MESSAGES, params, chat_template=with_tools, chat_template_kwargs={"mood": "calm"}, tools=tools)
    assert chat.prompt_token_ids == tokenizer.encode(RENDERED + " lookup calm", add_special_tokens=False)
    (from_file,) = llm.chat(MESSAGES, params, chat_template=str(template_file))
    assert from_file.prompt_token_ids == tokenizer.encode(RENDERED, add_special_tokens=False)
    (own,) = llm.chat(MESSAGES, params)  # the model's own template again
    assert own.prompt_token_ids == tokenizer.apply_chat_template(MESSAGES, tokenize=True) != from_file.prompt_token_ids


RAG_TEMPLATE = (
    "{% for d in documents %}<doc {{ d.title }}>{{ d.text }}</doc>\n{% endfor %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
DOCUMENTS = [{"title": "lakes", "text": "Como is deep."}, {"title": "rivers", "text": "The Po is long."}]


def test_a_requests_own_template_and_documents_render_where_the_server_trusts_them(tiny_llama_dir: Path):
    """vLLM's `chat_template` and `documents`: with --trust-request-chat-template a chat renders with its own
    template, which reads its documents; /tokenize and usage count that prompt. Without the flag, a request's
    template is a 400 naming it; documents that the model's template does not read are a 400 naming them."""
    from llmserve.server.app import build_app
    from tests.server.conftest import MODEL_NAME, app_serving, tiny_engine_running

    rendered = "".join(f"<doc {d['title']}>{d['text']}</doc>\n" for d in DOCUMENTS) + RENDERED
    expected = Tokenizer.from_pretrained(tiny_llama_dir).encode(rendered, add_special_tokens=False)
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "chat_template": RAG_TEMPLATE,
            "documents": DOCUMENTS}
    prompt = {k: v for k, v in body.items() if k != "max_tokens"}  # what /tokenize takes
    with tiny_engine_running(tiny_llama_dir, 64, 256) as engine:
        with app_serving(build_app(engine, MODEL_NAME, trust_request_chat_template=True)) as url:
            counted = httpx.post(f"{url}/tokenize", json=prompt)
            assert counted.status_code == 200, counted.text
            assert counted.json()["tokens"] == expected
            chat = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(expected)
            broken = httpx.post(f"{url}/v1/chat/completions", json={**body, "chat_template": "{% for %}"})
            assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template"
        with app_serving(build_app(engine, MODEL_NAME)) as url:
            for path, sent in (("/v1/chat/completions", body), ("/tokenize", prompt)):
                refused = httpx.post(f"{url}{path}", json=sent, timeout=60)
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
            unread = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                                json={k: v for k, v in body.items() if k != "chat_template"})
            assert unread.status_code == 400 and unread.json()["error"]["param"] == "documents"


def test_the_trust_flag_reaches_the_app():
    assert build_parser().parse_args(["serve", "--trust-request-chat-template"]).trust_request_chat_template
    assert not build_parser().parse_args(["serve"]).trust_request_chat_template
