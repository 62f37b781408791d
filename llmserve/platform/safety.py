"""Content safety: a pre-filter on prompts and a streaming post-filter on outputs.

A filter is a plugin behind `SafetyFilter` (a subclass, an instance, or a plain callable named in
config as "package.module:name"); the default is `RuleSetFilter`, a list of words and regexes.

`OutputGuard` is the streaming post-filter for one choice: it holds back the last `holdback_chars`
characters of the output, so a rule match is always seen whole before any of it could be sent, and
once a rule matches it withholds everything from the start of the match on. `ContentSafety` ties a
filter to the server: prompt screening that raises a 400 `content_filter` error, guards that stop a
stream, and a log line and a counter per block (naming the rule, never the user's text).
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

PROMPT = "prompt"
OUTPUT = "output"
CONTENT_FILTER = "content_filter"  # the OpenAI error code and finish_reason for a block
DEFAULT_HOLDBACK_CHARS = 32
DEFAULT_MAX_REGEX_CHARS = 32


@dataclass(frozen=True)
class Verdict:
    """A filter's answer. `rule` names the rule that matched (a config path such as "words[2]" or a
    plugin's own name), never the text. When blocked, `start` is where the match starts in the
    checked text, if the filter can tell. When not blocked, a `start` marks a possible match that more
    text may confirm (a streamed output reaching "secret-12"): nothing from there on is sent yet."""

    blocked: bool
    rule: str | None = None
    category: str | None = None
    start: int | None = None


ALLOW = Verdict(blocked=False)


class ContentFilteredError(InvalidRequestError):
    """A prompt the safety filter blocked: the server answers 400 with code `content_filter`."""

    def __init__(self, verdict: Verdict, param: str | None = None) -> None:
        super().__init__(
            "The request was rejected by the content filter.", param=param, code=CONTENT_FILTER
        )
        self.verdict = verdict


class SafetyFilter(ABC):
    """The plugin interface.

    `max_match_chars` bounds how many characters one match can span (lookarounds included); the
    streaming guard must hold back at least that many. None: unknown (the guard trusts its own
    holdback)."""

    max_match_chars: int | None = None
    # The categories the filter may report (/v1/moderations lists each, matched or not); a plugin's may be empty:
    # then a moderation result lists only what matched.
    categories: tuple[str, ...] = ()

    def matched_categories(self, text: str) -> list[str]:
        """Every category `text` falls in, for /v1/moderations. A plugin's: its prompt check's block, by the
        block's category (else its rule, else "flagged")."""
        verdict = self.check_prompt(text)
        return [verdict.category or verdict.rule or "flagged"] if verdict.blocked else []

    @abstractmethod
    def check_prompt(self, text: str) -> Verdict:
        """Check one prompt text (a completion prompt, or one chat message's content)."""

    @abstractmethod
    def check_output(self, text: str) -> Verdict:
        """Check a complete output text."""

    def check_output_stream(self, text: str, *, checked_chars: int, final: bool) -> Verdict:
        """Check the output generated so far for one choice; called after every new piece.

        `text[:checked_chars]` passed an earlier call, so a filter may scan only the new tail plus
        `max_match_chars` of overlap. When `final` is false more text may follow, so a filter may
        wait on a match that reaches the end of `text` (the word "ass" at the end of "the ass" may
        still become "the assembly"). The default checks the whole text each time."""
        return self.check_output(text)


class CallableFilter(SafetyFilter):
    """A plain callable `f(text) -> bool | Verdict` as a plugin, for prompts and outputs alike."""

    def __init__(self, check: Callable[[str], bool | Verdict], name: str | None = None) -> None:
        self._check = check
        self.name = name or getattr(check, "__qualname__", type(check).__name__)

    def _verdict(self, text: str) -> Verdict:
        result = self._check(text)
        if isinstance(result, Verdict):
            return result
        if isinstance(result, bool):
            return Verdict(blocked=True, rule=self.name, category="plugin") if result else ALLOW
        raise TypeError(f"Safety filter {self.name!r} returned {type(result).__name__}; expected bool or Verdict.")

    def check_prompt(self, text: str) -> Verdict:
        return self._verdict(text)

    def check_output(self, text: str) -> Verdict:
        return self._verdict(text)


class _Rule:
    """One compiled rule; `name_for` names it in verdicts."""

    def __init__(self, name: str, category: str, pattern: re.Pattern[str]) -> None:
        self.name = name
        self.category = category
        self.pattern = pattern

    def name_for(self, matched: str) -> str:
        return self.name


class _WordsRule(_Rule):
    """Every word in one non-capturing alternation, matched whole. (A named group per word would
    say which word matched, but makes each search about 100 times slower.)"""

    def __init__(self, words: Sequence[str], flags: int, prefix: str = "", category: str = "word") -> None:
        alternation = "|".join(re.escape(word) for word in words)
        # Lookarounds rather than \b, so words that start or end with punctuation ("c++") match too.
        super().__init__(f"{prefix}words", category, re.compile(rf"(?<!\w)(?:{alternation})(?!\w)", flags))
        self.words = list(words)
        self._fold = str.casefold if flags & re.IGNORECASE else str
        self._index: dict[str, int] = {}
        for index, word in enumerate(words):
            self._index.setdefault(self._fold(word), index)

    def name_for(self, matched: str) -> str:
        index = self._index.get(self._fold(matched))
        if index is None:  # a case variant that re's IGNORECASE matches but casefold() keeps apart
            index = next(
                i for i, word in enumerate(self.words)
                if re.fullmatch(re.escape(word), matched, self.pattern.flags)
            )
        return f"{self.name}[{index}]"


@dataclass(frozen=True)
class _Hit:
    rule: str
    category: str
    start: int


class RuleSetFilter(SafetyFilter):
    """Blocks whole words and regex matches (case-insensitive unless `case_sensitive`).

    Words match whole: "ass" does not hit "class" or "assembly". Regexes are searched as given. In a
    stream, a regex match that reaches the end of the text so far is held until more text confirms or
    rules it out, so a match that grows as text arrives (`secret-\\d+`) is safe at any length; but a
    match that only appears once more than `max_regex_chars` of its characters are visible
    (`secret-\\d{40}-end`) may be partly sent, or missed by a streamed check. Prompts and complete
    outputs are always checked whole. The top-level words and regexes are in the categories "word" and "regex";
    `categories` names more, each with its own words and regexes (what /v1/moderations reports)."""

    def __init__(
        self,
        words: Iterable[str] = (),
        regexes: Iterable[str] = (),
        case_sensitive: bool = False,
        check_prompts: bool = True,
        check_outputs: bool = True,
        max_regex_chars: int = DEFAULT_MAX_REGEX_CHARS,
        categories: Mapping[str, Mapping[str, Iterable[str]]] | None = None,
    ) -> None:
        if max_regex_chars < 1:
            raise ValueError(f"max_regex_chars must be at least 1, got {max_regex_chars}.")
        flags = 0 if case_sensitive else re.IGNORECASE
        self._rules = _rules(words, regexes, flags)
        for name, rules in (categories or {}).items():
            unknown = set(rules) - {"words", "regexes"}
            if unknown:
                raise ValueError(f"Safety category {name!r} has {sorted(unknown)[0]!r}: a category holds words and "
                                 "regexes.")
            self._rules += _rules(rules.get("words", ()), rules.get("regexes", ()), flags, f"categories.{name}.", name)
        words = [word for rule in self._rules if isinstance(rule, _WordsRule) for word in rule.words]
        regexes = [rule for rule in self._rules if not isinstance(rule, _WordsRule)]
        self.check_prompts = check_prompts
        self.check_outputs = check_outputs
        self.categories = tuple(dict.fromkeys(rule.category for rule in self._rules))
        longest_word = max((len(word) for word in words), default=0)
        longest = max(longest_word, max_regex_chars if regexes else 0)
        self.max_match_chars = longest if check_outputs else 0

    def check_prompt(self, text: str) -> Verdict:
        return self._search(text, 0, final=True) if self.check_prompts else ALLOW

    def matched_categories(self, text: str) -> list[str]:
        """Every category with a rule that matches anywhere in `text` (prompts or outputs, whichever it checks)."""
        hit = {rule.category for rule in self._rules if rule.pattern.search(text) is not None}
        return [category for category in self.categories if category in hit]

    def check_output(self, text: str) -> Verdict:
        return self._search(text, 0, final=True) if self.check_outputs else ALLOW

    def check_output_stream(self, text: str, *, checked_chars: int, final: bool) -> Verdict:
        if not self.check_outputs:
            return ALLOW
        return self._search(text, max(0, checked_chars - (self.max_match_chars or 0)), final)

    def _search(self, text: str, pos: int, final: bool) -> Verdict:
        """The earliest confirmed match from `pos` on. Unless `final`, a match that reaches the end
        of `text` is pending: not a block (yet), but the verdict's start moves back to it, so text
        that may belong to a match is held."""
        confirmed: _Hit | None = None
        earliest_start: int | None = None
        for rule in self._rules:
            hit, pending_start = _first_match(rule, text, pos, final)
            for start in (pending_start, None if hit is None else hit.start):
                if start is not None and (earliest_start is None or start < earliest_start):
                    earliest_start = start
            if hit is not None and (confirmed is None or hit.start < confirmed.start):
                confirmed = hit
        if confirmed is None:
            return ALLOW if earliest_start is None else Verdict(blocked=False, start=earliest_start)
        return Verdict(blocked=True, rule=confirmed.rule, category=confirmed.category, start=earliest_start)


def _first_match(rule: _Rule, text: str, pos: int, final: bool) -> tuple[_Hit | None, int | None]:
    """(the first confirmed match of `rule`, the start of the first pending one before it)."""
    pending_start: int | None = None
    match = rule.pattern.search(text, pos)
    while match is not None:
        if final or match.end() < len(text):
            return _Hit(rule.name_for(match.group()), rule.category, match.start()), pending_start
        if pending_start is None:
            pending_start = match.start()
        match = rule.pattern.search(text, match.start() + 1)
    return None, pending_start


def _rules(words: Iterable[str], regexes: Iterable[str], flags: int, prefix: str = "",
           category: str | None = None) -> list[_Rule]:
    """One rule for the words, one per regex; named after `prefix` ("" or "categories.NAME."), in `category` (else
    "word" and "regex")."""
    words = _clean_words(words, prefix)
    rules: list[_Rule] = [_WordsRule(words, flags, prefix, category or "word")] if words else []
    return rules + _compile_regexes(list(regexes), flags, prefix, category)


def _clean_words(words: Iterable[str], prefix: str = "") -> list[str]:
    cleaned = []
    for index, word in enumerate(words):
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"Safety rule {prefix}words[{index}] must be a non-empty string.")
        cleaned.append(word.strip())
    return cleaned


def _compile_regexes(regexes: Sequence[str], flags: int, prefix: str = "", category: str | None = None) -> list[_Rule]:
    rules = []
    for index, source in enumerate(regexes):
        name = f"{prefix}regexes[{index}]"
        try:
            pattern = re.compile(source, flags)
        except (re.error, TypeError) as exc:
            raise ValueError(f"Safety rule {name} {source!r} is not a valid regex: {exc}") from exc
        if pattern.fullmatch("") is not None:
            raise ValueError(f"Safety rule {name} {source!r} matches the empty string.")
        rules.append(_Rule(name, category or "regex", pattern))
    return rules


class FilterChain(SafetyFilter):
    """Several filters as one: blocked when any blocks, at the earliest start any of them reports."""

    def __init__(self, filters: Sequence[SafetyFilter]) -> None:
        self.filters = list(filters)
        bounds = [f.max_match_chars for f in self.filters]
        self.max_match_chars = None if None in bounds else max(bounds, default=0)  # type: ignore[type-var]
        self.categories = tuple(dict.fromkeys(category for f in self.filters for category in f.categories))

    def matched_categories(self, text: str) -> list[str]:
        return list(dict.fromkeys(category for f in self.filters for category in f.matched_categories(text)))

    def check_prompt(self, text: str) -> Verdict:
        return _earliest(f.check_prompt(text) for f in self.filters)

    def check_output(self, text: str) -> Verdict:
        return _earliest(f.check_output(text) for f in self.filters)

    def check_output_stream(self, text: str, *, checked_chars: int, final: bool) -> Verdict:
        return _earliest(
            f.check_output_stream(text, checked_chars=checked_chars, final=final) for f in self.filters
        )


def _earliest(verdicts: Iterable[Verdict]) -> Verdict:
    """The blocking verdict that starts first (an unknown start counts as the earliest), else the
    earliest possible match to hold from."""
    verdicts = list(verdicts)
    blocks = [v for v in verdicts if v.blocked]
    if blocks:
        return min(blocks, key=lambda v: -1 if v.start is None else v.start)
    holds = [v.start for v in verdicts if v.start is not None]
    return Verdict(blocked=False, start=min(holds)) if holds else ALLOW


def load_filter(
    spec: str | None, rules: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None
) -> SafetyFilter | None:
    """The filter config names: `spec` ("package.module:name", a SafetyFilter subclass built with
    `options`, an instance, or a callable), `rules` (RuleSetFilter's arguments: words, regexes, ...),
    both (chained), or neither (None: filtering off)."""
    filters: list[SafetyFilter] = []
    if spec is not None:
        filters.append(_load_plugin(spec, dict(options or {})))
    elif options:
        raise ValueError("Safety filter options were given without a filter plugin.")
    rule_args = dict(rules or {})
    if rule_args.get("words") or rule_args.get("regexes") or rule_args.get("categories"):
        try:
            filters.append(RuleSetFilter(**rule_args))
        except TypeError as exc:
            raise ValueError(f"Bad safety rules: {exc}") from exc
    if not filters:
        return None
    return filters[0] if len(filters) == 1 else FilterChain(filters)


def _load_plugin(spec: str, options: dict[str, Any]) -> SafetyFilter:
    target = _import_object(spec)
    if isinstance(target, type):
        if not issubclass(target, SafetyFilter):
            raise ValueError(f"Safety filter {spec!r} is a class but not a SafetyFilter subclass.")
        try:
            return target(**options)
        except TypeError as exc:
            raise ValueError(f"Safety filter {spec!r} could not be built with options {options}: {exc}") from exc
    if options:
        raise ValueError(f"Safety filter {spec!r} is not a class, so it takes no options.")
    if isinstance(target, SafetyFilter):
        return target
    if callable(target):
        return CallableFilter(target, name=spec)
    raise ValueError(f"Safety filter {spec!r} is a {type(target).__name__}, not a SafetyFilter or a callable.")


def _import_object(spec: str) -> Any:
    module_name, _, attribute_path = spec.partition(":")
    if not module_name or not attribute_path:
        raise ValueError(f"Safety filter {spec!r} must look like 'package.module:name'.")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"Safety filter {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for attribute in attribute_path.split("."):
        try:
            target = getattr(target, attribute)
        except AttributeError as exc:
            raise ValueError(f"Safety filter {spec!r}: {module_name!r} has no attribute {attribute_path!r}.") from exc
    return target


@dataclass(frozen=True)
class GuardStep:
    """What one `OutputGuard.feed` allows: `releasable` is the new text safe to send now."""

    releasable: str
    blocked: bool
    verdict: Verdict


class OutputGuard:
    """The streaming post-filter for one choice.

    Feed it the output text so far after every engine step; send each step's `releasable`. Until the
    output finishes, the last `holdback_chars` characters stay unsent, so a match of up to that many
    characters is checked whole before any of it could go out; so does everything from the start of
    a possible match the filter reports (a regex match still growing). Once the filter blocks, the
    text from the start of the match on (all unsent text when the filter cannot say where) is never
    released, and the caller should stop generation with finish_reason "content_filter". Unsent text
    may change between feeds (a detokenizer revising its tail); sent text may not.

    For a non-streamed response, `feed(full_text, finished=True)` once and return `released_text`."""

    def __init__(
        self,
        safety_filter: SafetyFilter,
        holdback_chars: int = DEFAULT_HOLDBACK_CHARS,
        on_block: Callable[[Verdict], None] | None = None,
    ) -> None:
        if holdback_chars < 0:
            raise ValueError(f"holdback_chars must be at least 0, got {holdback_chars}.")
        longest = safety_filter.max_match_chars
        if longest is not None and holdback_chars < longest:
            raise ValueError(
                f"holdback_chars={holdback_chars} is shorter than the longest rule match ({longest} chars): "
                "a match could be sent before it is complete."
            )
        self.safety_filter = safety_filter
        self.holdback_chars = holdback_chars
        self._on_block = on_block
        self._text = ""
        self._released_text = ""
        self._released = 0
        self._checked = 0
        self._finished = False
        self._hold_from: int | None = None  # the start of a possible match, from the last check
        self._verdict = ALLOW

    @property
    def released_text(self) -> str:
        """Everything released so far (the concatenation of every step's `releasable`)."""
        return self._released_text

    @property
    def blocked(self) -> bool:
        return self._verdict.blocked

    @property
    def verdict(self) -> Verdict:
        return self._verdict

    def feed(self, text_so_far: str, finished: bool = False) -> GuardStep:
        if self._verdict.blocked:
            return GuardStep("", True, self._verdict)
        self._accept(text_so_far)
        if len(text_so_far) > self._checked or (finished and not self._finished):
            verdict = self.safety_filter.check_output_stream(
                text_so_far, checked_chars=self._checked, final=finished
            )
            self._finished = finished
            if verdict.blocked:
                return self._block(verdict)
            self._hold_from = verdict.start
            # A possible match is checked again, whole, next time.
            self._checked = len(text_so_far) if verdict.start is None else min(verdict.start, len(text_so_far))
        end = len(text_so_far) if finished else len(text_so_far) - self.holdback_chars
        if self._hold_from is not None:
            end = min(end, self._hold_from)
        return GuardStep(self._release_to(end), False, ALLOW)

    def _accept(self, text: str) -> None:
        if not text.startswith(self._released_text):
            raise ValueError("OutputGuard.feed needs the whole output so far; it no longer starts with the sent text.")
        if self._finished and len(text) > len(self._text):
            raise ValueError("OutputGuard.feed got more text after the output finished.")
        self._text = text

    def _block(self, verdict: Verdict) -> GuardStep:
        self._verdict = verdict
        cut = self._released if verdict.start is None else verdict.start
        if not self._finished:  # never past the holdback line: unsent text there may be part of a match
            cut = min(cut, len(self._text) - self.holdback_chars)
        releasable = self._release_to(cut)
        if self._on_block is not None:
            self._on_block(verdict)
        return GuardStep(releasable, True, verdict)

    def _release_to(self, end: int) -> str:
        if end <= self._released:
            return ""
        releasable = self._text[self._released : end]
        self._released = end
        self._released_text += releasable
        return releasable


class SafetyStats:
    """Block counts by stage ("prompt" / "output") and rule, for the metrics endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: Counter[tuple[str, str]] = Counter()

    def record(self, stage: str, verdict: Verdict) -> None:
        with self._lock:
            self._blocks[(stage, verdict.rule or "unknown")] += 1

    def blocks(self) -> dict[tuple[str, str], int]:
        """{(stage, rule): count}."""
        with self._lock:
            return dict(self._blocks)

    def total(self, stage: str | None = None) -> int:
        with self._lock:
            return sum(n for (s, _), n in self._blocks.items() if stage is None or s == stage)


class SafetyCategory(BaseModel):
    """A named category of rules (`safety: {categories: {pii: {regexes: [...]}}}`)."""

    model_config = ConfigDict(extra="forbid")

    words: list[str] = Field(default_factory=list)
    regexes: list[str] = Field(default_factory=list)

    @field_validator("regexes")
    @classmethod
    def _regexes_compile(cls, regexes: list[str]) -> list[str]:
        _compile_regexes(regexes, 0)
        return regexes


class SafetyConfig(BaseModel):
    """The `safety:` section of the models config."""

    model_config = ConfigDict(extra="forbid")

    filter: str | None = None  # "package.module:name" plugin; None: the rule set alone
    options: dict[str, Any] = Field(default_factory=dict)  # keyword arguments for a plugin class
    words: list[str] = Field(default_factory=list)
    regexes: list[str] = Field(default_factory=list)
    case_sensitive: bool = False
    max_regex_chars: int = Field(DEFAULT_MAX_REGEX_CHARS, ge=1)
    holdback_chars: int = Field(DEFAULT_HOLDBACK_CHARS, ge=0)
    categories: dict[str, SafetyCategory] = Field(default_factory=dict)

    @field_validator("regexes")
    @classmethod
    def _regexes_compile(cls, regexes: list[str]) -> list[str]:
        _compile_regexes(regexes, 0)
        return regexes

    def rules(self) -> dict[str, Any]:
        return {
            "words": self.words,
            "regexes": self.regexes,
            "case_sensitive": self.case_sensitive,
            "max_regex_chars": self.max_regex_chars,
            "categories": {name: category.model_dump() for name, category in self.categories.items()},
        }


class ContentSafety:
    """A filter wired for the server: prompt screening, output guards, and a log line and a count
    for every block."""

    def __init__(
        self,
        safety_filter: SafetyFilter,
        holdback_chars: int = DEFAULT_HOLDBACK_CHARS,
        stats: SafetyStats | None = None,
    ) -> None:
        self.safety_filter = safety_filter
        self.holdback_chars = holdback_chars
        self.stats = stats or SafetyStats()
        OutputGuard(safety_filter, holdback_chars)  # fail at startup, not on the first request

    @classmethod
    def from_config(cls, config: SafetyConfig, stats: SafetyStats | None = None) -> ContentSafety | None:
        """None when the config names no filter and no rules (filtering off)."""
        safety_filter = load_filter(config.filter, config.rules(), config.options)
        return None if safety_filter is None else cls(safety_filter, config.holdback_chars, stats)

    def screen_prompt(self, texts: str | Iterable[str], request_id: str, param: str | None = None) -> None:
        """Raise ContentFilteredError (400 `content_filter`) if any of `texts` is blocked. Each text
        (a prompt, or one message's content) is checked on its own."""
        for text in [texts] if isinstance(texts, str) else texts:
            verdict = self.safety_filter.check_prompt(text)
            if verdict.blocked:
                self._record(PROMPT, verdict, request_id)
                raise ContentFilteredError(verdict, param=param)

    def output_guard(self, request_id: str) -> OutputGuard:
        """A guard for one choice of request `request_id`; its block is logged and counted once."""
        return OutputGuard(
            self.safety_filter,
            self.holdback_chars,
            on_block=lambda verdict: self._record(OUTPUT, verdict, request_id),
        )

    def _record(self, stage: str, verdict: Verdict, request_id: str) -> None:
        self.stats.record(stage, verdict)
        logger.warning(
            "content filter blocked %s of request %s (rule=%s, category=%s)",
            stage,
            request_id,
            verdict.rule,
            verdict.category,
        )
