"""Turning sampled tokens into text and deciding when a sequence stops.

Runs once per generated token per sequence on the host: detokenize incrementally, check eos, stop
token ids, stop strings (matched across token boundaries) and length limits.
"""

from __future__ import annotations

from llmserve.engine.sequence import Sequence
from llmserve.outputs import CompletionOutput


class StopChecker:
    def __init__(self, eos_token_ids: set[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append_text(self, seq: Sequence, piece: str) -> None:
        """Add detokenized text; finish `seq` if a stop string now appears in it."""
        params = seq.request.params
        previous = len(seq.text)
        seq.text += piece
        if not params.stop or not piece:
            return
        longest = max(len(s) for s in params.stop)
        window_start = max(0, previous - longest + 1)
        hits = [(seq.text.find(s, window_start), s) for s in params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        index, stop = min(hits)
        seq.text = seq.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
        seq.finish_reason, seq.stop_reason = "stop", stop

    def check_token(self, seq: Sequence, token: int) -> None:
        """Finish `seq` if the token it just appended ends it."""
        if seq.finish_reason is not None:
            return
        params = seq.request.params
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            seq.finish_reason = "length"
        elif seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"


def completion_output(seq: Sequence) -> CompletionOutput:
    params = seq.request.params
    text = seq.text
    if seq.finish_reason is None and params.stop:
        # Hold back what could still turn out to be the start of a stop string.
        holdback = max(len(s) for s in params.stop) - 1
        text = text[: max(0, len(text) - holdback)]
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=seq.output_token_ids,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,  # a snapshot: seq.logprobs grows
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
    )
