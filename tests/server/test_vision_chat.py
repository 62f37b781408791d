"""Images in chat (OpenAI's `image_url` content parts) on a vision-language model: a data: URL or an http(s) URL
gives the tokens the offline API gives for the same image, streamed or not, with the image's tokens in the
prompt's usage; images that cannot be had, and images for a model that reads none, are 400s naming the part."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Response

from llmserve import LLM
from llmserve.sampling.params import SamplingParams
from tests.engine.test_vision import png_bytes, random_image
from tests.hf_reference import build_llava
from tests.server.conftest import (
    MODEL_NAME,
    NUM_KV_BLOCKS,
    LiveServer,
    app_serving,
    serving,
    tiny_engine_running,
)
from tests.server.platform_fixtures import MODES, serve_platform

pytest.importorskip("transformers")

QUESTION = "what is in it"


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    return build_llava(tmp_path_factory.mktemp("llava-http") / "model", tiny_llama_dir)


@pytest.fixture(scope="module")
def server(llava_dir) -> Iterator[LiveServer]:
    with serving(llava_dir) as live:
        yield live


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """An http server of one image (/image.png) and one page that is not an image (/page.html)."""
    app = FastAPI()
    png = png_bytes(random_image(11))

    @app.get("/image.png")
    def image() -> Response:
        return Response(png, media_type="image/png")

    @app.get("/page.html")
    def page() -> Response:
        return Response("<html>no image</html>", media_type="text/html")

    with app_serving(app) as base_url:
        yield base_url


def user_message(*urls: str, text: str = QUESTION) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def offline_tokens(llava_dir: Path, images: list, text: str = QUESTION) -> list[int]:
    llm = LLM(str(llava_dir), dtype="float32", num_kv_blocks=64)
    prompt = "<|begin_of_text|><|im_start|>user\n" + "<image>\n" * len(images) + text + "<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


def test_an_image_by_data_url_or_http_url_gives_the_offline_tokens(server, llava_dir, image_host):
    image = random_image(11)
    expected = offline_tokens(llava_dir, [image])
    client = server.client()
    for url in (data_url(png_bytes(image)), f"{image_host}/image.png"):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=[user_message(url)], max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert reply.choices[0].to_dict()["token_ids"] == expected
        assert reply.usage.prompt_tokens == 16 + len(_text_prompt_ids(server))  # the image's 16 tokens, the text's
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[user_message(f"{image_host}/image.png")],
                                            max_tokens=12, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [t for chunk in stream if chunk.choices for t in (chunk.choices[0].to_dict().get("token_ids") or [])] == expected
    assert server.idle_stats().num_used_blocks == 0


def _text_prompt_ids(server: LiveServer) -> list[int]:
    text = f"<|begin_of_text|><|im_start|>user\n<image>\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    ids = server.engine.tokenizer.encode(text, add_special_tokens=False)
    return [t for t in ids if t != 1024]


def test_two_images_in_two_turns_and_their_order_matter(server, llava_dir):
    first, second = random_image(12), random_image(13)
    messages = [user_message(data_url(png_bytes(first)), text="a"), {"role": "assistant", "content": "b"},
                user_message(data_url(png_bytes(second)), text="c")]
    swapped = [user_message(data_url(png_bytes(second)), text="a"), messages[1],
               user_message(data_url(png_bytes(first)), text="c")]
    client = server.client()
    replies = [client.chat.completions.create(model=MODEL_NAME, messages=m, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
               for m in (messages, swapped)]
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens
    assert replies[0].choices[0].to_dict()["token_ids"] != replies[1].choices[0].to_dict()["token_ids"]


@pytest.mark.parametrize(("content", "param", "message"), [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,not base64!"}}], "messages[0].content[0].image_url",
     "not valid base64"),
    ([{"type": "image_url", "image_url": {"url": data_url(b"GIF89a? no")}}], "messages[0].content[0].image_url",
     "could not be decoded"),
    ([{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}],
     "messages[0].content[1].image_url", "not an image"),
    ([{"type": "image_url", "image_url": {"url": "{host}/page.html"}}], "messages[0].content[0].image_url",
     "could not be decoded"),
    ([{"type": "image_url", "image_url": {"url": "{host}/missing.png"}}], "messages[0].content[0].image_url",
     "answered 404"),
    ([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}], "messages[0].content[0].image_url",
     "could not be fetched"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], "messages", "data: URL"),
    ([{"type": "image_url", "image_url": {"url": "{png}", "detail": "ultra"}}], "messages", "detail"),
    ([{"type": "image_url", "image_url": "{png}"}], "messages", "image_url"),
    ([{"type": "input_audio", "input_audio": {}}], "messages", "not supported"),
    ([{"type": "text", "text": "<image>\nhi"}], "messages", "image placeholder tokens"),
    ([{"type": "image_url", "image_url": {"url": "{png}"}}] * 17, "messages[0].content[16].image_url", "at most 16"),
    ([{"type": "image_url", "image_url": {"url": "{thin}"}}], "messages[0].content[0].image_url", "more than 100 times"),
])
def test_images_that_cannot_be_read_are_400s_naming_the_part(server, image_host, content, param, message):
    png, thin = data_url(png_bytes(random_image(1))), data_url(png_bytes(random_image(1, (303, 3))))

    def filled(part: dict) -> dict:
        if part["type"] != "image_url":
            return part
        inner = part["image_url"]
        if isinstance(inner, str):
            return {**part, "image_url": inner.replace("{png}", png)}
        url = inner["url"].replace("{host}", image_host).replace("{png}", png).replace("{thin}", thin)
        return {**part, "image_url": {**inner, "url": url}}

    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [filled(p) for p in content]}], "max_tokens": 4}
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"].startswith(param) and message in error["message"], error


def test_an_image_in_an_assistant_message_is_a_400(server):
    png = data_url(png_bytes(random_image(1)))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": png}}]}]
    answer = httpx.post(f"{server.base_url}/v1/chat/completions",
                        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 4}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages[1].content"


def test_an_image_for_a_text_model_is_a_400_naming_the_part(live_server):
    messages = [user_message(data_url(png_bytes(random_image(1))))]
    answer = httpx.post(f"{live_server.base_url}/v1/chat/completions",
                        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 4}, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages[0].content[0].image_url" and "reads text only" in error["message"]


def test_the_responses_and_messages_apis_read_images_as_chat_does(server):
    import anthropic

    png = png_bytes(random_image(14))
    encoded = base64.b64encode(png).decode()
    chat = server.client().chat.completions.create(model=MODEL_NAME, messages=[user_message(data_url(png))],
                                                   max_tokens=12, temperature=0)
    text = chat.choices[0].message.content
    response = server.client().responses.create(model=MODEL_NAME, max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(png)},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    message = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0).messages.create(
        model=MODEL_NAME, max_tokens=12, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == text
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens


@pytest.mark.parametrize("mode", MODES)
def test_keys_metering_and_the_gateway_take_images_as_the_replica_does(llava_dir, tmp_path, mode):
    """Through `llmserve serve`'s platform and through the gateway in front of a replica: the same reply, and the
    image's tokens metered as prompt tokens."""
    url = data_url(png_bytes(random_image(15)))
    body = {"model": MODEL_NAME, "messages": [user_message(url)], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    with tiny_engine_running(llava_dir, NUM_KV_BLOCKS, 1024) as engine, \
            contextlib.contextmanager(serve_platform)(engine, tmp_path, mode=mode) as served:
        _, secret = served.new_key("vision")
        with served.client(secret) as http:
            answer = http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        reply = answer.json()
        assert reply["choices"][0]["token_ids"] == offline_tokens(llava_dir, [random_image(15)])
        rows = served.usage_rows()
        assert [row.prompt_tokens for row in rows] == [reply["usage"]["prompt_tokens"]]
        assert reply["usage"]["prompt_tokens"] > 16


def test_tokenize_counts_a_messages_images_as_chat_does(server, live_server):
    messages = [user_message(data_url(png_bytes(random_image(16))), data_url(png_bytes(random_image(17))))]
    chat = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    counted = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=60)
    assert counted.status_code == 200 and counted.json()["count"] == chat.usage.prompt_tokens
    assert counted.json()["tokens"].count(1024) == 32
    refused = httpx.post(f"{live_server.base_url}/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=60)
    assert refused.status_code == 400 and "reads text only" in refused.json()["error"]["message"]


def test_allowed_media_domains_limit_the_hosts_images_are_fetched_from(llava_dir, image_host):
    """vLLM's --allowed-media-domains: other hosts' URLs are 400s before anything is fetched; data: URLs always
    go."""
    for allowed, fetches in ((["none"], False), (["images.example"], False), (["127.0.0.1"], True)):
        with serving(llava_dir, allowed_media_domains=allowed) as live:
            body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [user_message(f"{image_host}/image.png")]}
            answer = httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=60)
            assert answer.status_code == (200 if fetches else 400), answer.text
            if not fetches:
                assert "data: URL" in answer.json()["error"]["message"]
                assert answer.json()["error"]["param"] == "messages[0].content[0].image_url"
            inline = {**body, "messages": [user_message(data_url(png_bytes(random_image(11))))]}
            assert httpx.post(f"{live.base_url}/v1/chat/completions", json=inline, timeout=60).status_code == 200


def test_llava_next_images_of_other_shapes_take_their_own_tokens_over_http(tmp_path_factory, tiny_llama_dir):
    """LLaVA-NeXT: a wide and a tall image, by data: URL, give the offline API's tokens; usage and /tokenize count
    each image's own tokens."""
    from tests.hf_reference import build_llava_next

    model_dir = build_llava_next(tmp_path_factory.mktemp("llava-next-http") / "model", tiny_llama_dir)
    images = [random_image(1, (80, 50)), random_image(2, (40, 130))]
    expected = offline_tokens(model_dir, images)
    messages = [user_message(*(data_url(png_bytes(image)) for image in images))]
    with serving(model_dir) as live:
        reply = live.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        counted = httpx.post(f"{live.base_url}/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=60)
    assert reply.choices[0].to_dict()["token_ids"] == expected
    assert counted.json()["count"] == reply.usage.prompt_tokens
    assert counted.json()["tokens"].count(1024) == 44 + 76


def test_qwen2_vl_images_over_http_give_the_offline_tokens(tmp_path_factory, tiny_llama_dir):
    """Qwen2-VL: images of their own shapes in a chat, streamed, give the offline API's tokens (the template writes
    each as <|vision_start|><|image_pad|><|vision_end|>); usage and /tokenize count each image's own tokens."""
    from tests.engine.test_qwen2_vl import IMAGE
    from tests.hf_reference import build_qwen2_vl

    model_dir = build_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl-http") / "model", tiny_llama_dir)
    images = [random_image(3, (150, 90)), random_image(4, (60, 200))]
    prompt = f"<|begin_of_text|><|im_start|>user\n{IMAGE}{IMAGE}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    expected = list(llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids)
    messages = [user_message(*(data_url(png_bytes(image)) for image in images))]
    with serving(model_dir) as live:
        stream = live.client().chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
        chunks = list(stream)
        counted = httpx.post(f"{live.base_url}/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=60)
        assert live.idle_stats().num_used_blocks == 0
    assert [t for chunk in chunks if chunk.choices for t in (chunk.choices[0].to_dict().get("token_ids") or [])] == expected
    assert counted.json()["count"] == chunks[-1].usage.prompt_tokens
    assert counted.json()["tokens"].count(1024) == 5 * 3 + 2 * 7


def test_mm_processor_kwargs_resize_a_requests_images_as_the_preprocessor_config_would(
        tmp_path_factory, tiny_llama_dir, server, live_server):
    """Qwen2-VL with vLLM's `mm_processor_kwargs` (`max_pixels`): a request's image is resized as a checkpoint whose
    preprocessor_config.json says so resizes it (the same tokens, online and offline), into fewer tokens than the
    default; /tokenize counts it the same. Options the processor does not take, or out of range, are 400s naming
    them, as any option is for LLaVA (whose processor takes none) and for a text model."""
    from tests.engine.test_qwen2_vl import IMAGE
    from tests.hf_reference import build_qwen2_vl

    root = tmp_path_factory.mktemp("qwen2-vl-pixels")
    model_dir = build_qwen2_vl(root / "model", tiny_llama_dir)
    smaller = root / "smaller"
    shutil.copytree(model_dir, smaller)
    config = json.loads((smaller / "preprocessor_config.json").read_text())
    (smaller / "preprocessor_config.json").write_text(json.dumps({**config, "min_pixels": 784, "max_pixels": 3136}))
    image = random_image(5, (150, 90))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt": f"<|begin_of_text|><|im_start|>user\n{IMAGE}{QUESTION}<|im_end|>\n<|im_start|>assistant\n",
              "multi_modal_data": {"image": [image]}}
    expected = list(LLM(str(smaller), dtype="float32", num_kv_blocks=64).generate(prompt, greedy)[0].outputs[0].token_ids)
    offline = LLM(str(model_dir), dtype="float32", num_kv_blocks=64).generate(
        {**prompt, "mm_processor_kwargs": {"max_pixels": 3136}}, greedy)
    assert list(offline[0].outputs[0].token_ids) == expected
    messages = [user_message(data_url(png_bytes(image)))]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with serving(model_dir) as live, httpx.Client(base_url=live.base_url, timeout=60) as client:
        resized = client.post("/v1/chat/completions", json={**body, "mm_processor_kwargs": {"max_pixels": 3136}})
        assert resized.status_code == 200, resized.text
        assert resized.json()["choices"][0]["token_ids"] == expected
        counted = client.post("/tokenize", json={"model": MODEL_NAME, "messages": messages,
                                                 "mm_processor_kwargs": {"max_pixels": 3136}}).json()
        assert counted["count"] == resized.json()["usage"]["prompt_tokens"] and counted["tokens"].count(1024) == 2
        default = client.post("/v1/chat/completions", json=body).json()
        assert default["usage"]["prompt_tokens"] == counted["count"] - 2 + 5 * 3
        for options, param in (({"max_pixels": 700}, "max_pixels"), ({"max_pixels": 64 * 784 + 1}, "max_pixels"),
                               ({"max_pixels": "3136"}, "max_pixels"), ({"min_pixels": 5000, "max_pixels": 4000},
                                                                         "min_pixels"), ({"size": {}}, "size")):
            refused = client.post("/v1/chat/completions", json={**body, "mm_processor_kwargs": options})
            assert refused.status_code == 400, options
            assert refused.json()["error"]["param"] == f"mm_processor_kwargs.{param}", options
        assert live.idle_stats().num_used_blocks == 0
    for other, param in ((server, "mm_processor_kwargs.max_pixels"), (live_server, "mm_processor_kwargs")):
        refused = httpx.post(f"{other.base_url}/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "mm_processor_kwargs": {"max_pixels": 3136}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


@pytest.mark.parametrize("mode", MODES)
def test_a_stored_conversation_keeps_its_images_for_the_next_turns(llava_dir, tmp_path, mode):
    """A turn with an image in a stored conversation keeps the image: its message lists it, and the next turn (text
    only) sends it to the model again, giving the tokens of the whole conversation sent at once; the Responses API's
    `conversation` keeps its images the same way."""
    image = random_image(18)
    url = data_url(png_bytes(image))
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with tiny_engine_running(llava_dir, NUM_KV_BLOCKS, 1024) as engine, \
            contextlib.contextmanager(serve_platform)(engine, tmp_path, mode=mode) as served:
        _, secret = served.new_key("vision")
        with served.client(secret) as http:
            conversation = http.post("/v1/conversations", json={}).json()["id"]
            first = http.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "conversation_id": conversation, "messages": [user_message(url)], **greedy})
            assert first.status_code == 200, first.text
            reply = first.json()["choices"][0]["message"]["content"]
            second = http.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "conversation_id": conversation,
                "messages": [{"role": "user", "content": "and what else"}], **greedy})
            assert second.status_code == 200, second.text
            whole = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [
                user_message(url), {"role": "assistant", "content": reply},
                {"role": "user", "content": "and what else"}], **greedy})
            messages = http.get(f"/v1/conversations/{conversation}/messages", params={"order": "asc"}).json()["data"]
            responses = http.post("/v1/responses", json={
                "model": MODEL_NAME, "conversation": conversation, "max_output_tokens": 4, "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                 {"type": "input_text", "text": "and this"}]}]})
            assert responses.status_code == 200, responses.text
            stored = http.get(f"/v1/conversations/{conversation}/messages", params={"order": "asc"}).json()["data"]
    # The stateless form of the same conversation (the image sent again with the reply it got) is answered too: a
    # prompt with images is not remembered for its continuation, whose template writes each placeholder once.
    assert whole.status_code == 200, whole.text
    assert second.json()["choices"][0]["token_ids"] == whole.json()["choices"][0]["token_ids"]
    assert second.json()["usage"]["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"]
    assert [(m["role"], m["images"]) for m in messages] == [("user", [url]), ("assistant", []), ("user", []),
                                                           ("assistant", [])]
    assert messages[0]["content"] == QUESTION
    assert [m["images"] for m in stored[4:]] == [[url], []]
