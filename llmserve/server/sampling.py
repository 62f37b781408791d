"""OpenAI request fields -> the engine's `SamplingParams`."""

from __future__ import annotations

import dataclasses

from llmserve.errors import InvalidRequestError
from llmserve.sampling.params import SamplingParams
from llmserve.server.protocol import SamplingFields

# Fields the request may leave unset, to fall back on the model's generation_config defaults.
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def to_sampling_params(
    body: SamplingFields,
    defaults: SamplingParams,
    max_tokens: int | None,
    max_tokens_param: str = "max_tokens",
    logprobs: int | None = None,
) -> SamplingParams:
    """Build and validate the engine parameters; errors name the request's own field."""
    fields = {name: getattr(body, name) for name in _DEFAULTED if getattr(body, name) is not None}
    try:
        return dataclasses.replace(
            defaults,
            **fields,
            n=body.n,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []),
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=body.engine_prompt_logprobs(),
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
    except InvalidRequestError as exc:
        if exc.param == "max_tokens":
            exc.param = max_tokens_param
        raise
