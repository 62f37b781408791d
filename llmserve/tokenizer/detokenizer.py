"""Incremental detokenization: turn a growing list of generated token ids into text pieces.

This is the prefix_offset/read_offset technique from vLLM. Each step decodes a short window of ids,
`ids[prefix_offset:]`, and emits what it adds beyond `decode(ids[prefix_offset:read_offset])`, the
context that was already emitted. Decoding a little context before the new ids lets the decoder see
leading spaces and byte sequences the way a full decode would. Text is held back while it could
still change:

* it ends with U+FFFD: a multi-byte character whose remaining bytes have not arrived yet;
* the last id is a `<0xNN>` byte token of a byte-fallback (SentencePiece-style) tokenizer: its
  ByteFallback decoder decides a whole run of byte tokens at once (valid UTF-8, or one U+FFFD per
  byte), so a later byte token can change how the run already seen decodes.

The read offset only moves to positions where the decoded text is final (a character boundary that
is not inside a run of byte tokens), so the pieces always add up to `tokenizer.decode(output_ids)`.
When special tokens are skipped they are dropped from the window before decoding: a full decode
drops them before its decoder runs too, so its "first token" rules (strip one leading space) see
the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.tokenizer.tokenizer import REPLACEMENT_CHAR, Tokenizer


class IncrementalDetokenizer:
    """Streams the text of one sequence's generated tokens.

    The text is that of the generated ids alone, exactly `tokenizer.decode(output_ids)`. Call
    `flush()` once, when the sequence ends.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.output_text = ""
        self._dropped_ids = tokenizer.skip_special_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_fallback_ids
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the new text that is now safe to emit (maybe "")."""
        self.token_ids.extend(token_ids)
        for token_id in token_ids:
            if token_id not in self._dropped_ids:
                self._ids.append(token_id)
        if len(self._ids) == self._read_offset or self._ids[-1] in self._byte_ids:
            return ""
        window_text = self._decode(self._prefix_offset, len(self._ids))
        if window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """End of sequence: emit whatever is left, decoded exactly as `tokenizer.decode` would."""
        if len(self._ids) == self._read_offset:
            return ""
        return self._emit(self._decode(self._prefix_offset, len(self._ids)))

    def _decode(self, start: int, end: int) -> str:
        if end - start == 1:  # the usual prefix window: the last emitted token alone
            return self.tokenizer.decode_one(self._ids[start], self.skip_special_tokens)
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _emit(self, window_text: str) -> str:
        piece = window_text[len(self._prefix_text) :]
        previous_read = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_offset = self._prefix_start(previous_read)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self.output_text += piece
        return piece

    def _prefix_start(self, previous_read: int) -> int:
        """Where the next window starts: just the last emitted token, unless that is a byte token.

        One token of context is enough: it takes the decoder's "first token" treatment (a stripped
        leading space) in place of the new tokens. A byte-level window may even start inside a
        character: the stray bytes decode to the same U+FFFDs in both texts and the decoder is back
        in step by the first new token. A byte-fallback window must not split a run of byte tokens.
        """
        last = self._read_offset - 1
        return last if self._ids[last] not in self._byte_ids else previous_read
