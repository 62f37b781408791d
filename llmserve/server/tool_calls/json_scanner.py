"""An incremental JSON value scanner: fed one character at a time, it says where a value ends.

It validates as it goes (strict JSON: no NaN, no trailing commas, no control characters in
strings), so text it accepted is always a prefix of some valid JSON value. Tool-call parsers use it
to stream a call's arguments as they are generated and to know, without waiting for the end of the
output, the exact character where the arguments value closes.
"""

from __future__ import annotations

import enum

_WHITESPACE = frozenset(" \t\n\r")
_ESCAPABLE = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
_DIGITS = frozenset("0123456789")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class Step(enum.Enum):
    MORE = "more"  # consumed; the value is not complete yet
    DONE = "done"  # consumed; this character completed the value
    ENDED = "ended"  # not consumed: the value (a bare number) was already complete before it
    INVALID = "invalid"  # not consumed: no valid JSON value continues with this character


class _S(enum.Enum):
    VALUE = 0  # a value must start (whitespace allowed inside containers)
    VALUE_OR_CLOSE = 1  # just after "["
    KEY_OR_CLOSE = 2  # just after "{"
    KEY = 3  # after "," in an object
    COLON = 4
    AFTER_VALUE = 5  # inside a container, after a member
    STRING = 6
    ESCAPE = 7
    UNICODE = 8
    LITERAL = 9
    NUMBER = 10


# Number states: which characters move where, and which states may end the number.
_NUMBER_MOVES: dict[str, dict[str, str]] = {
    "sign": {"0": "zero", "digit": "int"},
    "zero": {".": "dot", "e": "exp_mark"},
    "int": {"digit": "int", ".": "dot", "e": "exp_mark"},
    "dot": {"digit": "frac"},
    "frac": {"digit": "frac", "e": "exp_mark"},
    "exp_mark": {"+": "exp_sign", "-": "exp_sign", "digit": "exp"},
    "exp_sign": {"digit": "exp"},
    "exp": {"digit": "exp"},
}
_NUMBER_FINAL = frozenset({"zero", "int", "frac", "exp"})


def _number_class(ch: str, state: str) -> str:
    if ch == "0" and state == "sign":
        return "0"
    if ch in _DIGITS:
        return "digit"
    return "e" if ch in "eE" else ch


class JsonScanner:
    """Scans exactly one JSON value; the first character must start it (no leading whitespace)."""

    __slots__ = ("_stack", "_state", "_in_key", "_pending", "_number", "done")

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._state = _S.VALUE
        self._in_key = False
        self._pending = ""  # literal letters still expected, or \u hex digits left (as a count string)
        self._number = ""
        self.done = False

    def push(self, ch: str) -> Step:
        """Feed one character; see `Step` for what the answer means."""
        if self.done:
            return Step.ENDED
        handler = _HANDLERS[self._state]
        return handler(self, ch)

    def complete_at_end(self) -> bool:
        """Whether the input may end here: the value is complete (a bare number ends at end of input)."""
        return self.done or (not self._stack and self._state is _S.NUMBER and self._number in _NUMBER_FINAL)

    # -- states -----------------------------------------------------------------------------

    def _value(self, ch: str) -> Step:
        if ch in _WHITESPACE and self._stack:
            return Step.MORE
        if ch == "{":
            self._stack.append("}")
            self._state = _S.KEY_OR_CLOSE
        elif ch == "[":
            self._stack.append("]")
            self._state = _S.VALUE_OR_CLOSE
        elif ch == '"':
            self._in_key = False
            self._state = _S.STRING
        elif ch == "-" or ch in _DIGITS:
            self._number = "sign" if ch == "-" else ("zero" if ch == "0" else "int")
            self._state = _S.NUMBER
        elif ch in _LITERALS:
            self._pending = _LITERALS[ch]
            self._state = _S.LITERAL
        else:
            return Step.INVALID
        return Step.MORE

    def _value_or_close(self, ch: str) -> Step:
        if ch == "]":
            return self._close()
        return self._value(ch)

    def _key_or_close(self, ch: str) -> Step:
        if ch == "}":
            return self._close()
        return self._key(ch)

    def _key(self, ch: str) -> Step:
        if ch in _WHITESPACE:
            return Step.MORE
        if ch != '"':
            return Step.INVALID
        self._in_key = True
        self._state = _S.STRING
        return Step.MORE

    def _colon(self, ch: str) -> Step:
        if ch in _WHITESPACE:
            return Step.MORE
        if ch != ":":
            return Step.INVALID
        self._state = _S.VALUE
        return Step.MORE

    def _after_value(self, ch: str) -> Step:
        if ch in _WHITESPACE:
            return Step.MORE
        if ch == ",":
            self._state = _S.KEY if self._stack[-1] == "}" else _S.VALUE
            return Step.MORE
        if ch == self._stack[-1]:
            return self._close()
        return Step.INVALID

    def _string(self, ch: str) -> Step:
        if ch == '"':
            if self._in_key:
                self._in_key = False
                self._state = _S.COLON
                return Step.MORE
            return self._value_done()
        if ch == "\\":
            self._state = _S.ESCAPE
        elif ord(ch) < 0x20:
            return Step.INVALID
        return Step.MORE

    def _escape(self, ch: str) -> Step:
        if ch == "u":
            self._pending = "4"
            self._state = _S.UNICODE
            return Step.MORE
        if ch not in _ESCAPABLE:
            return Step.INVALID
        self._state = _S.STRING
        return Step.MORE

    def _unicode(self, ch: str) -> Step:
        if ch not in _HEX:
            return Step.INVALID
        left = int(self._pending) - 1
        self._pending = str(left)
        if left == 0:
            self._state = _S.STRING
        return Step.MORE

    def _literal(self, ch: str) -> Step:
        if ch != self._pending[0]:
            return Step.INVALID
        self._pending = self._pending[1:]
        return self._value_done() if not self._pending else Step.MORE

    def _number_char(self, ch: str) -> Step:
        target = _NUMBER_MOVES[self._number].get(_number_class(ch, self._number))
        if target is not None:
            self._number = target
            return Step.MORE
        if self._number not in _NUMBER_FINAL:
            return Step.INVALID
        if not self._stack:
            self.done = True
            return Step.ENDED
        self._state = _S.AFTER_VALUE
        return self._after_value(ch)

    # -- helpers ----------------------------------------------------------------------------

    def _close(self) -> Step:
        self._stack.pop()
        return self._value_done()

    def _value_done(self) -> Step:
        if not self._stack:
            self.done = True
            return Step.DONE
        self._state = _S.AFTER_VALUE
        return Step.MORE


_HANDLERS = {
    _S.VALUE: JsonScanner._value,
    _S.VALUE_OR_CLOSE: JsonScanner._value_or_close,
    _S.KEY_OR_CLOSE: JsonScanner._key_or_close,
    _S.KEY: JsonScanner._key,
    _S.COLON: JsonScanner._colon,
    _S.AFTER_VALUE: JsonScanner._after_value,
    _S.STRING: JsonScanner._string,
    _S.ESCAPE: JsonScanner._escape,
    _S.UNICODE: JsonScanner._unicode,
    _S.LITERAL: JsonScanner._literal,
    _S.NUMBER: JsonScanner._number_char,
}


def scan_value(text: str, start: int = 0) -> int | None:
    """The end index (exclusive) of the JSON value starting at `text[start]`, or None if there is none."""
    scanner = JsonScanner()
    for index in range(start, len(text)):
        step = scanner.push(text[index])
        if step is Step.DONE:
            return index + 1
        if step is Step.ENDED:
            return index
        if step is Step.INVALID:
            return None
    return len(text) if scanner.complete_at_end() else None
