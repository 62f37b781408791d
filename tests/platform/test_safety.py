"""Safety filters: the rule set, plugin loading, the streaming output guard, and block accounting."""

from __future__ import annotations

import logging
import random
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.platform.safety import (
    ALLOW,
    CallableFilter,
    ContentFilteredError,
    ContentSafety,
    FilterChain,
    OutputGuard,
    RuleSetFilter,
    SafetyConfig,
    SafetyFilter,
    Verdict,
    load_filter,
)
from llmserve.server.errors import from_exception

BLOCKED_WORDS = ["ass", "badword", "c++"]
SAFE_WORDS = ["class", "assembly", "bad", "word", "the", "a", "passes", "words", "badwords", "c", "cpp", "x", "secret-"]
REGEX_HITS = ["secret-4", "secret-1234567890123"]  # the second is longer than the holdback
SEPARATORS = [" ", ", ", ". ", "\n", "-", "!"]


def rule_set(**kwargs) -> RuleSetFilter:
    """The test rules; the regex is declared to match at most 10 characters."""
    return RuleSetFilter(words=BLOCKED_WORDS, regexes=[r"secret-\d+"], **{"max_regex_chars": 10, **kwargs})


# ---- plugins the loader can name as "tests.platform.test_safety:<name>" ----


def blocks_digits(text: str) -> bool:
    return any(ch.isdigit() for ch in text)


class NeverBlocks(SafetyFilter):
    def check_prompt(self, text: str) -> Verdict:
        return ALLOW

    def check_output(self, text: str) -> Verdict:
        return ALLOW


NEVER_BLOCKS = NeverBlocks()
NOT_A_FILTER = 42


class NotAFilter:
    pass


# ---- the rule set ----


@pytest.mark.parametrize(
    ("text", "rule", "start"),
    [
        ("you ass", "words[0]", 4),
        ("ASS!", "words[0]", 0),
        ("what a BadWord.", "words[1]", 7),
        ("I write c++ daily", "words[2]", 8),
        ("key secret-42 here", "regexes[0]", 4),
        ("SECRET-7", "regexes[0]", 0),
    ],
)
def test_rule_set_blocks_whole_words_and_regexes_case_insensitively(text: str, rule: str, start: int) -> None:
    verdict = rule_set().check_prompt(text)
    assert verdict == Verdict(blocked=True, rule=rule, category="regex" if "regex" in rule else "word", start=start)
    assert rule_set().check_output(text) == verdict


@pytest.mark.parametrize("text", ["class", "assembly", "passes", "badwords", "c++x", "secret-", "secret-x", ""])
def test_rule_set_allows_words_inside_other_words(text: str) -> None:
    assert rule_set().check_prompt(text) == ALLOW


def test_case_sensitive_rules_only_match_the_given_case() -> None:
    strict = rule_set(case_sensitive=True)
    assert strict.check_prompt("ASS and SECRET-1") == ALLOW
    assert strict.check_prompt("ass").blocked


def test_the_verdict_names_the_word_that_matched() -> None:
    many = RuleSetFilter(words=[f"bad{i}word" for i in range(200)])
    assert many.check_prompt("x BAD137WORD y").rule == "words[137]"
    assert RuleSetFilter(words=["Bad", "bad"], case_sensitive=True).check_prompt("so bad").rule == "words[1]"
    # re's IGNORECASE matches dotless "ı" with "I", which casefold() keeps apart
    assert RuleSetFilter(words=["kit", "kıt"]).check_prompt("a KIT").rule == "words[0]"
    assert RuleSetFilter(words=["safe", "kıt"]).check_prompt("a KIT").rule == "words[1]"


def test_the_earliest_match_wins_across_rules() -> None:
    verdict = rule_set().check_output("secret-1 then badword")
    assert (verdict.rule, verdict.start) == ("regexes[0]", 0)


def test_moderation_reads_every_category_a_text_falls_in() -> None:
    rules = rule_set()
    assert rules.categories == ("word", "regex")
    assert rules.matched_categories("secret-1 then badword") == ["word", "regex"]
    assert rules.matched_categories("a clean text") == []
    plugin = CallableFilter(lambda text: Verdict(blocked="spam" in text, rule="spam-rule", category="spam"))
    chain = FilterChain([plugin, rules])
    assert chain.categories == ("word", "regex")  # the plugin names none ahead of a block
    assert chain.matched_categories("spam and badword") == ["spam", "word"]


def test_named_categories_hold_their_own_rules() -> None:
    rules = RuleSetFilter(words=["badword"], categories={"pii": {"regexes": [r"\b\d{3}-\d{4}\b"]},
                                                          "insult": {"words": ["idiot", "fool"]}})
    assert rules.categories == ("word", "pii", "insult")
    assert rules.matched_categories("call 555-1234, you fool") == ["pii", "insult"]
    verdict = rules.check_prompt("you fool")
    assert (verdict.rule, verdict.category) == ("categories.insult.words[1]", "insult")
    assert rules.check_prompt("555-1234").rule == "categories.pii.regexes[0]"
    with pytest.raises(ValueError, match="a category holds words and regexes"):
        RuleSetFilter(categories={"pii": {"patterns": ["x"]}})
    with pytest.raises(ValueError, match=r"categories\.pii\.regexes\[0\]"):
        RuleSetFilter(categories={"pii": {"regexes": ["("]}})
    configured = load_filter(None, SafetyConfig(categories={"pii": {"regexes": [r"\d{3}-\d{4}"]}}).rules())
    assert configured is not None and configured.matched_categories("555-1234") == ["pii"]


def test_stages_can_be_switched_off() -> None:
    prompts_only = rule_set(check_outputs=False)
    assert prompts_only.check_prompt("ass").blocked
    assert prompts_only.check_output("ass") == ALLOW
    assert prompts_only.max_match_chars == 0
    outputs_only = rule_set(check_prompts=False)
    assert outputs_only.check_prompt("ass") == ALLOW
    assert outputs_only.check_output("ass").blocked


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"regexes": ["ok", "(unclosed"]}, "regexes[1] '(unclosed' is not a valid regex"),
        ({"regexes": ["a*"]}, "regexes[0] 'a*' matches the empty string"),
        ({"words": ["fine", "  "]}, "words[1] must be a non-empty string"),
        ({"words": ["x"], "max_regex_chars": 0}, "max_regex_chars must be at least 1"),
    ],
)
def test_bad_rules_are_rejected_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace("*", r"\*")):
        RuleSetFilter(**kwargs)


def test_max_match_chars_covers_the_longest_word_and_the_regex_bound() -> None:
    assert RuleSetFilter(words=["ab", "abcdefghij"]).max_match_chars == 10
    assert RuleSetFilter(words=["ab"], regexes=["x+"], max_regex_chars=20).max_match_chars == 20


# ---- plugin loading ----


def test_load_filter_builds_a_rule_set_or_nothing() -> None:
    assert load_filter(None, None) is None
    assert load_filter(None, {"words": [], "regexes": []}) is None
    loaded = load_filter(None, {"words": ["ass"], "regexes": [r"secret-\d+"]})
    assert isinstance(loaded, RuleSetFilter)
    assert loaded.check_prompt("my secret-9").rule == "regexes[0]"


def test_load_filter_imports_a_class_with_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_safety_plugin.py").write_text(textwrap.dedent("""
        from llmserve.platform.safety import ALLOW, SafetyFilter, Verdict

        class Banned(SafetyFilter):
            def __init__(self, term):
                self.term = term

            def check_prompt(self, text):
                return self.check_output(text)

            def check_output(self, text):
                found = text.find(self.term)
                return ALLOW if found < 0 else Verdict(True, rule="banned", category="custom", start=found)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = load_filter("my_safety_plugin:Banned", None, {"term": "zebra"})
    assert type(loaded).__name__ == "Banned"
    assert loaded.check_prompt("a zebra") == Verdict(True, rule="banned", category="custom", start=2)
    with pytest.raises(ValueError, match="could not be built with options"):
        load_filter("my_safety_plugin:Banned", None, {"colour": "red"})


def test_load_filter_accepts_an_instance_and_a_callable() -> None:
    assert load_filter(f"{__name__}:NEVER_BLOCKS", None) is NEVER_BLOCKS
    loaded = load_filter(f"{__name__}:blocks_digits", None)
    assert isinstance(loaded, CallableFilter)
    assert loaded.check_prompt("call 555") == Verdict(True, rule=f"{__name__}:blocks_digits", category="plugin")
    assert loaded.check_output("no digits") == ALLOW


def test_load_filter_chains_a_plugin_with_rules() -> None:
    loaded = load_filter(f"{__name__}:blocks_digits", {"words": ["ass"]})
    assert isinstance(loaded, FilterChain)
    assert loaded.check_prompt("ass").rule == "words[0]"
    assert loaded.check_prompt("7").rule == f"{__name__}:blocks_digits"
    assert loaded.max_match_chars is None  # the callable has no bound


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("no_colon_here", None, "must look like 'package.module:name'"),
        (":name", None, "must look like 'package.module:name'"),
        ("llmserve_no_such_module_xyz:f", None, "cannot import module 'llmserve_no_such_module_xyz'"),
        (f"{__name__}:missing", None, "has no attribute 'missing'"),
        (f"{__name__}:NotAFilter", None, "not a SafetyFilter subclass"),
        (f"{__name__}:NOT_A_FILTER", None, "is a int, not a SafetyFilter or a callable"),
        (f"{__name__}:blocks_digits", {"x": 1}, "takes no options"),
        (None, {"x": 1}, "options were given without a filter plugin"),
    ],
)
def test_load_filter_rejects_bad_specs(spec: str | None, options: dict | None, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_filter(spec, None, options)


def test_a_callable_must_answer_bool_or_verdict() -> None:
    with pytest.raises(TypeError, match="returned str; expected bool or Verdict"):
        CallableFilter(lambda text: "yes").check_prompt("x")


# ---- the output guard ----


def split_randomly(text: str, rng: random.Random, max_piece: int) -> Iterator[str]:
    """The cumulative text after each piece of random length (1..max_piece)."""
    end = 0
    while end < len(text):
        end = min(len(text), end + rng.randint(1, max_piece))
        yield text[:end]


def stream_through(guard: OutputGuard, prefixes: list[str]) -> list[str]:
    """Feed each cumulative prefix (the last one as finished); return each step's release."""
    releases = []
    for index, prefix in enumerate(prefixes):
        step = guard.feed(prefix, finished=index == len(prefixes) - 1)
        releases.append(step.releasable)
        if step.blocked:
            break
    return releases


def random_text(rng: random.Random, vocabulary: list[str]) -> str:
    return "".join(rng.choice(vocabulary) + rng.choice(SEPARATORS) for _ in range(rng.randint(1, 12)))


def test_holdback_shorter_than_the_longest_word_is_rejected() -> None:
    with pytest.raises(ValueError, match="holdback_chars=6 is shorter than the longest rule match \\(7 chars\\)"):
        OutputGuard(RuleSetFilter(words=["ass", "badword"]), holdback_chars=6)
    OutputGuard(RuleSetFilter(words=["ass", "badword"]), holdback_chars=7)


def test_safe_text_is_held_back_then_released_whole() -> None:
    guard = OutputGuard(rule_set(), holdback_chars=10)
    text = "the class passes the assembly test"
    released = []
    for end in range(1, len(text) + 1):
        step = guard.feed(text[:end], finished=end == len(text))
        assert not step.blocked
        released.append(step.releasable)
        expected = end if end == len(text) else max(0, end - 10)
        assert len(guard.released_text) == expected
    assert "".join(released) == guard.released_text == text


@pytest.mark.parametrize("max_piece", [1, 3, 9, 40])
def test_random_safe_streams_release_everything(max_piece: int) -> None:
    rng = random.Random(max_piece)
    for _ in range(100):
        text = random_text(rng, SAFE_WORDS)
        guard = OutputGuard(rule_set(), holdback_chars=10)
        releases = stream_through(guard, list(split_randomly(text, rng, max_piece)))
        assert not guard.blocked
        assert "".join(releases) == guard.released_text == text


@pytest.mark.parametrize("max_piece", [1, 2, 5, 12, 60])
def test_random_streams_never_release_a_blocked_word(max_piece: int) -> None:
    rng = random.Random(1000 + max_piece)
    rules = rule_set()
    outcomes = {True: 0, False: 0}
    for _ in range(300):
        text = random_text(rng, SAFE_WORDS * 3 + BLOCKED_WORDS + REGEX_HITS)
        whole = rules.check_output(text)
        guard = OutputGuard(rule_set(), holdback_chars=10)
        releases = stream_through(guard, list(split_randomly(text, rng, max_piece)))
        assert "".join(releases) == guard.released_text
        assert text.startswith(guard.released_text)
        assert guard.blocked == whole.blocked
        outcomes[whole.blocked] += 1
        if whole.blocked:
            assert len(guard.released_text) <= whole.start
            assert guard.verdict.rule == whole.rule
        else:
            assert guard.released_text == text
    assert min(outcomes.values()) >= 50  # the vocabulary makes both outcomes common


def test_word_by_word_feeding_stops_right_after_the_word() -> None:
    guard = OutputGuard(RuleSetFilter(words=BLOCKED_WORDS), holdback_chars=7)
    text = ""
    for word in ["Hello ", "there, ", "you ", "badword", " and ", "more"]:
        text += word
        step = guard.feed(text)
        if step.blocked:
            break
    assert text == "Hello there, you badword and "
    assert guard.verdict == Verdict(True, rule="words[1]", category="word", start=17)
    assert guard.released_text == "Hello there, you "[: len(text) - 7]


def test_a_match_straddling_feeds_is_caught() -> None:
    guard = OutputGuard(rule_set(), holdback_chars=10)
    assert guard.feed("this is the ba").releasable == "this"
    step = guard.feed("this is the badwo")
    assert (step.releasable, step.blocked) == (" is", False)
    step = guard.feed("this is the badword, right")
    assert step.blocked and step.verdict.start == 12
    assert guard.released_text == "this is the "
    assert guard.feed("this is the badword, right?", finished=True) == step.__class__("", True, step.verdict)


def test_a_word_at_the_end_waits_for_the_next_character() -> None:
    guard = OutputGuard(rule_set(), holdback_chars=10)
    assert not guard.feed("build the ass").blocked
    guard.feed("build the assembly line", finished=True)
    assert not guard.blocked
    assert guard.released_text == "build the assembly line"


def test_a_word_at_the_end_of_a_finished_output_blocks() -> None:
    guard = OutputGuard(rule_set(), holdback_chars=10)
    guard.feed("well you ass")
    step = guard.feed("well you ass", finished=True)
    assert step.blocked
    assert guard.released_text == "well you "


def test_a_regex_match_growing_past_the_holdback_is_held_from_its_start() -> None:
    guard = OutputGuard(rule_set(), holdback_chars=10)
    releases = [
        guard.feed(text).releasable
        for text in ["the code is secret-", "the code is secret-12", "the code is secret-1234567890123"]
    ]
    assert releases == ["the code ", "is", " "]  # nothing from "secret-" on, though it is 20 characters
    step = guard.feed("the code is secret-1234567890123, ok")
    assert step.verdict == Verdict(True, rule="regexes[0]", category="regex", start=12)
    assert guard.released_text == "the code is "


def test_a_possible_match_that_is_ruled_out_is_released() -> None:
    guard = OutputGuard(RuleSetFilter(regexes=[r"key-\d+-end"], max_regex_chars=20), holdback_chars=20)
    assert guard.feed("key-1234567890123456789").releasable == "key"  # no match yet: only the holdback
    guard.feed("key-1234567890123456789-and more words here", finished=True)
    assert guard.released_text == "key-1234567890123456789-and more words here"


def test_a_chain_holds_from_the_earliest_possible_match() -> None:
    chain = FilterChain([RuleSetFilter(words=["ass"]), RuleSetFilter(regexes=[r"secret-\d+"], max_regex_chars=10)])
    assert chain.check_output_stream("a secret-12", checked_chars=0, final=False) == Verdict(False, start=2)
    assert chain.check_output_stream("a secret-12", checked_chars=0, final=True).start == 2
    blocked = chain.check_output_stream("the ass secret-1", checked_chars=0, final=False)
    assert (blocked.blocked, blocked.rule, blocked.start) == (True, "words[0]", 4)


def test_non_streamed_output_is_cut_at_the_match() -> None:
    guard = OutputGuard(rule_set(), holdback_chars=32)
    step = guard.feed("a long answer that mentions secret-99 and goes on", finished=True)
    assert step.blocked
    assert step.releasable == guard.released_text == "a long answer that mentions "
    safe = OutputGuard(rule_set())
    assert safe.feed("a long, clean answer", finished=True).releasable == "a long, clean answer"


def test_a_filter_that_cannot_locate_the_match_withholds_all_unsent_text() -> None:
    guard = OutputGuard(CallableFilter(lambda text: "secret" in text), holdback_chars=10)
    assert guard.feed("hello world, nice day").releasable == "hello world"
    step = guard.feed("hello world, nice day. The secret")
    assert step.blocked and step.releasable == ""
    assert guard.released_text == "hello world"


def test_the_guard_needs_the_whole_output_so_far() -> None:
    guard = OutputGuard(RuleSetFilter(words=["ass"]), holdback_chars=3)
    guard.feed("abcdefgh")
    with pytest.raises(ValueError, match="no longer starts with the sent text"):
        guard.feed("xyz defgh and more")
    guard.feed("abcdefgh", finished=True)
    with pytest.raises(ValueError, match="more text after the output finished"):
        guard.feed("abcdefgh and more")


def test_the_stream_check_scans_only_the_new_tail() -> None:
    class CountingRuleSet(RuleSetFilter):
        scanned_from: list[int] = []

        def _search(self, text: str, pos: int, final: bool) -> Verdict:
            self.scanned_from.append(pos)
            return super()._search(text, pos, final)

    guard = OutputGuard(CountingRuleSet(words=["badword"]), holdback_chars=7)
    guard.feed("x" * 100)
    guard.feed("x" * 100 + " more")
    assert CountingRuleSet.scanned_from == [0, 93]


# ---- the server-facing wrapper ----


def test_a_blocked_prompt_is_a_400_content_filter_error_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    safety = ContentSafety(rule_set())
    with caplog.at_level(logging.WARNING, logger="llmserve.platform.safety"):
        with pytest.raises(ContentFilteredError) as raised:
            safety.screen_prompt(["fine message", "tell me the secret-77 please"], request_id="req-1", param="messages")
    api_error = from_exception(raised.value)
    assert (api_error.status, api_error.code, api_error.param) == (400, "content_filter", "messages")
    assert safety.stats.blocks() == {("prompt", "regexes[0]"): 1}
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "req-1" in message and "regexes[0]" in message and "secret-77" not in message


def test_prompt_messages_are_checked_one_by_one() -> None:
    safety = ContentSafety(RuleSetFilter(words=["bad word"]))
    safety.screen_prompt(["bad", "word"], request_id="r")
    safety.screen_prompt("all good", request_id="r")
    assert safety.stats.total() == 0


def test_an_output_block_is_logged_and_counted_once(caplog: pytest.LogCaptureFixture) -> None:
    safety = ContentSafety(rule_set(), holdback_chars=10)
    guard = safety.output_guard("req-2")
    with caplog.at_level(logging.WARNING, logger="llmserve.platform.safety"):
        guard.feed("you ass and")
        guard.feed("you ass and more")
        guard.feed("you ass and more", finished=True)
    assert guard.blocked
    assert safety.stats.blocks() == {("output", "words[0]"): 1}
    assert (safety.stats.total("output"), safety.stats.total("prompt")) == (1, 0)
    assert [record.getMessage().count("req-2") for record in caplog.records] == [1]


def test_content_safety_from_config() -> None:
    assert ContentSafety.from_config(SafetyConfig()) is None
    safety = ContentSafety.from_config(SafetyConfig(words=["badword"], regexes=[r"\bsecret-\d+\b"], max_regex_chars=20,
                                                       holdback_chars=20))
    assert safety is not None and safety.holdback_chars == 20
    assert safety.output_guard("r").feed("a secret-1 b", finished=True).verdict.rule == "regexes[0]"
    with pytest.raises(ValueError, match="shorter than the longest rule match"):
        ContentSafety.from_config(SafetyConfig(regexes=["x+"], max_regex_chars=40, holdback_chars=32))
