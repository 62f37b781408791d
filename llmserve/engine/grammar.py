"""Grammars for structured output, on xgrammar: a request's `StructuredOutputsParams` checked and
turned into a grammar (`grammar_spec`, `validate_structured_outputs`: cheap, no tokenizer, the
front end's check), compiled against the model's vocabulary (`GrammarCompiler`, in the engine
core), and followed token by token (`GrammarState`, one per sequence).

Why xgrammar and not llguidance: `benchmarks/grammar_backends.py` measures both on the same 200
schemas with the built-in tokenizer. The mask is computed for every constrained row of every step,
on the step loop; the compile happens once per schema, off the loop, and is cached. xgrammar's masks
cost about half of llguidance's (mean 14 vs 24 us per row); llguidance compiles lazily and starts
faster (p50 0.5 vs 10 ms), which only the first request with a new schema sees (figures in
BENCHMARKS.md, issue 14).

JSON grammars allow no free whitespace (`any_whitespace=False`): a random-weight model would
otherwise pad forever and never close the document.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmserve.errors import InvalidRequestError
from llmserve.sampling.params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    # Imported where used: xgrammar imports transformers (0.7 s at every server and engine core start, for
    # requests that may never ask for a grammar).
    import xgrammar as xgr

PARAM = "structured_outputs"
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar 0.2.8 writes a string with minLength/maxLength as `[^"\\\r\n]{m,n}`, which lets raw control
# characters into the string (invalid JSON); its unbounded strings exclude them, as JSON requires.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


@dataclass(frozen=True)
class GrammarSpec:
    """What a grammar is compiled from: the cache key of compiled grammars."""

    kind: str  # "json" | "regex" | "grammar" | "choice" | "structural_tag"
    text: str  # the JSON schema, the regex, the EBNF, the choices as a JSON list, or the structural tag


def grammar_spec(so: StructuredOutputsParams) -> GrammarSpec:
    """The one kind that is set, as a spec. Raises InvalidRequestError when none or several are."""
    kinds = [
        name for name, is_set in (
            ("json", so.json is not None), ("json_object", bool(so.json_object)), ("regex", so.regex is not None),
            ("choice", so.choice is not None), ("grammar", so.grammar is not None),
            ("structural_tag", so.structural_tag is not None),
        ) if is_set
    ]
    if len(kinds) != 1:
        found = ", ".join(kinds) if kinds else "none"
        raise InvalidRequestError(
            "structured_outputs must set exactly one of json, json_object, regex, choice, grammar, structural_tag "
            f"(got {found}).",
            param=PARAM,
        )
    kind = kinds[0]
    if kind in ("json", "structural_tag"):
        value = getattr(so, kind)
        return GrammarSpec(kind, value if isinstance(value, str) else json.dumps(value))
    if kind == "json_object":
        return GrammarSpec("json", _ANY_OBJECT_SCHEMA)
    if kind == "choice":
        choices = so.choice
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings.",
                                      param=PARAM)
        return GrammarSpec("choice", json.dumps(choices))
    text = so.regex if kind == "regex" else so.grammar
    if not isinstance(text, str) or not text:
        raise InvalidRequestError(f"structured_outputs.{kind} must be a non-empty string.", param=PARAM)
    return GrammarSpec(kind, text)


def build_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The tokenizer-free grammar of a spec; raises InvalidRequestError when it is not valid."""
    import xgrammar as xgr
    try:
        if spec.kind == "json":
            return _json_grammar(spec.text)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            alternatives = " | ".join(_ebnf_literal(c) for c in json.loads(spec.text))
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        if spec.kind == "structural_tag":
            return _json_strings(xgr.Grammar.from_structural_tag(spec.text))
        return xgr.Grammar.from_ebnf(spec.text)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises these for bad input
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                "structural_tag": "structural tag"}[spec.kind]
        raise InvalidRequestError(f"Invalid structured_outputs {what}: {_first_line(exc)}", param=PARAM) from exc


def validate_structured_outputs(params: SamplingParams) -> SamplingParams:
    """The front end's check: exactly one kind, and it compiles. A `json` or `structural_tag` dict becomes
    JSON text."""
    so = params.structured_outputs
    if so is None:
        return params
    if not isinstance(so, StructuredOutputsParams):
        raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams.", param=PARAM)
    spec = grammar_spec(so)
    _check_grammar(spec)
    if not all(isinstance(t, int) and t >= 0 for t in so.start_after):
        raise InvalidRequestError("structured_outputs.start_after must be token ids.", param=PARAM)
    for kind in ("json", "structural_tag"):
        if getattr(so, kind) is not None and not isinstance(getattr(so, kind), str):
            return replace(params, structured_outputs=replace(so, **{kind: spec.text}))
    return params


@functools.lru_cache(maxsize=1024)
def _check_grammar(spec: GrammarSpec) -> None:
    """`build_grammar` for its error only, remembered: the server checks a request's grammar on a
    worker thread, and the engine client's second look at it is then free."""
    build_grammar(spec)


def _json_grammar(schema: str) -> xgr.Grammar:
    import xgrammar as xgr
    return _json_strings(xgr.Grammar.from_json_schema(schema, any_whitespace=False))


def _json_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """The grammar with its length-bounded JSON strings kept free of raw control characters."""
    import xgrammar as xgr
    ebnf = str(grammar)
    if _LOOSE_STRING_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _ebnf_literal(text: str) -> str:
    """An EBNF string literal: JSON's escapes are also xgrammar's."""
    return json.dumps(text, ensure_ascii=False)


def _first_line(exc: Exception) -> str:
    """The error's first line, without xgrammar's log prefix ("[12:00:00] /project/cpp/x.cc:42: ")."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(exc).__name__


# ---- the engine core's side ------------------------------------------------------------------------


def tokenizer_info(tokenizer_json: Path, vocab_size: int, eos_token_ids: Iterable[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, from tokenizer.json (the `tokenizers` library, no
    transformers). `vocab_size` is the model's, which may exceed the tokenizer's (padded rows)."""
    import xgrammar as xgr
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_file(str(tokenizer_json))
    encoded = [""] * backend.get_vocab_size(with_added_tokens=True)
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        encoded[token_id] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        encoded[:vocab_size], metadata["vocab_type"], vocab_size=vocab_size,
        stop_token_ids=sorted(eos_token_ids), add_prefix_space=metadata["add_prefix_space"],
    )


class GrammarCompiler:
    """Compiles specs against one vocabulary (thread-safe: xgrammar's compiler releases the GIL)."""

    def __init__(self, info: xgr.TokenizerInfo) -> None:
        import xgrammar as xgr
        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(build_grammar(spec))


class GrammarState:
    """One sequence's progress through its grammar. Before `start_after` appears in the output the
    sequence is unconstrained; once its grammar ends (the stop token was accepted, e.g. under
    `ignore_eos`) or a token is refused, it is unconstrained again."""

    def __init__(self, compiled: xgr.CompiledGrammar, start_after: list[int]) -> None:
        import xgrammar as xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._start_after = list(start_after)
        self._tail: list[int] = []  # the last output tokens, while waiting for start_after
        self.active = not self._start_after
        self.done = False

    @property
    def constrains(self) -> bool:
        """Whether the next token is constrained."""
        return self.active and not self.done

    def waits_for(self, pending: int) -> bool:
        """Whether the next token's constraint may depend on the `pending` output tokens not known yet."""
        return pending > 0 and not self.done

    def accept(self, token: int) -> None:
        """Follow one appended output token."""
        if self.done:
            return
        if not self.active:
            self._tail = (self._tail + [token])[-len(self._start_after):]
            self.active = self._tail == self._start_after
            return
        if not self._matcher.accept_token(token) or self._matcher.is_terminated():
            self.done = True

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 bitmask ([rows, ceil(V / 32)])."""
        import torch

        self._matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)
