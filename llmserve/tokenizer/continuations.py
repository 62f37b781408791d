"""The token ids behind text the model generated, so a conversation's next turn reuses its KV.

A chat client sends the assistant's earlier replies back as text. Re-tokenizing that text need not give
the tokens the engine generated (a model may emit a non-canonical split of its own text: " the" as
" t" + "he"), and then the rendered history matches the prefix cache only up to that reply. This cache
remembers, for each finished chat completion, the ids of its prompt plus reply keyed by their text; a
later prompt whose text begins with a remembered text (cut at a special token, where a chat template
closes a turn) is encoded as those ids plus the rest, so the engine sees exactly the tokens it computed
KV for. The mapping is keyed by the request's cache salt too, so a salted prompt only meets its own.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

from llmserve.tokenizer.tokenizer import Tokenizer

DEFAULT_CAPACITY = 4096


class ContinuationCache:
    def __init__(self, tokenizer: Tokenizer, capacity: int = DEFAULT_CAPACITY) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        specials = sorted(
            {t for t in tokenizer.convert_ids_to_tokens(sorted(tokenizer.all_special_ids)) if t}, key=len, reverse=True
        )
        self._boundary = re.compile("|".join(re.escape(s) for s in specials)) if specials else None
        self.hits = 0

    @staticmethod
    def _key(text: str, salt: str | None) -> bytes:
        digest = hashlib.blake2b(digest_size=16)
        digest.update((salt or "").encode())
        digest.update(b"\0")
        digest.update(text.encode("utf-8", "surrogatepass"))
        return digest.digest()

    def encode(self, text: str, salt: str | None = None) -> list[int]:
        """`text` (a rendered chat prompt) as token ids, reusing remembered ids for its longest
        remembered beginning."""
        if self._boundary is not None and self._entries:
            cuts = [m.start() for m in self._boundary.finditer(text)]
            for cut in reversed(cuts):
                key = self._key(text[:cut], salt)
                with self._lock:
                    ids = self._entries.get(key)
                    if ids is not None:
                        self._entries.move_to_end(key)
                if ids is not None:
                    self.hits += 1
                    return [*ids, *self.tokenizer.encode(text[cut:], add_special_tokens=False)]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def remember(
        self, prompt_text: str, prompt_ids: Sequence[int], reply_text: str, reply_ids: Sequence[int],
        salt: str | None = None,
    ) -> bool:
        """Remember prompt + reply, if the reply's ids spell exactly its text (a trailing end-of-turn
        token, which the text leaves out, is dropped; replies cut by a stop string are not kept)."""
        ids = self._ids_spelling(reply_text, reply_ids)
        if ids is None:
            return False
        key = self._key(prompt_text + reply_text, salt)
        with self._lock:
            self._entries[key] = (*prompt_ids, *ids)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return True

    def _ids_spelling(self, text: str, ids: Sequence[int]) -> Sequence[int] | None:
        for candidate in (ids, ids[:-1]):
            if candidate and self.tokenizer.decode(candidate, skip_special_tokens=False) == text:
                return candidate
        return None

    def __len__(self) -> int:
        return len(self._entries)
