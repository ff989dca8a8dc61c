"""Read a large JSON object one member at a time, without holding the whole document.

``json.load`` of a LEAF file costs about three times the file in memory (the text, then a
Python float of 24 bytes plus an 8-byte list slot for every number). ``JsonStream`` keeps a
window of the text (``chunk`` characters, grown while one value does not fit) and decodes one
value at a time with the standard library's C decoder (``json.JSONDecoder.raw_decode``), so the
peak is about the largest single value, not the document.

The caller walks the structure: ``members`` and ``elements`` for the objects and arrays it
descends into, ``value`` for everything it wants whole. Malformed or truncated text raises
ValueError naming the file with the line and the character offset (from 0).
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

# Characters read at a time: enough that reading is not the cost, little beside the data (the
# window is at most about twice this while a new part is joined to the rest of the old one).
DEFAULT_CHUNK = 1 << 18
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace (RFC 8259 §2)
_NUMBER_TAIL = re.compile(r"[0-9eE+\-.]*\Z")  # the rest of the window could still extend a number
# Where an error is reported when the text stops inside a token, at most this far from the end
# of the text (literals are at most 9 characters, -Infinity; a number fails at its last one).
_LONGEST_TOKEN = 32


class JsonStream:
    """A cursor over the JSON text of an open file ``fh`` (text mode); ``path`` names it in errors."""

    def __init__(self, fh, path: str, chunk: int = DEFAULT_CHUNK):
        self._fh, self.path, self._chunk = fh, path, max(1, int(chunk))
        self._buf, self._pos = "", 0
        self._dropped = 0  # characters of the file before the window
        self._dropped_lines = 0  # newlines among them (for the line of an error)
        self._eof = False
        self._span = (0, 0)  # the last value's text: self._buf[span[0]:span[1]]
        self._decoder = json.JSONDecoder()

    # ---- the window ---------------------------------------------------------------------------
    def _more(self) -> bool:
        """Reads more text, dropping what was consumed; at least doubles the unread part, so a
        value that is re-decoded after each read costs a constant factor, not its size squared.
        Returns False at the end of the file."""
        if self._eof:
            return False
        want = max(self._chunk, len(self._buf) - self._pos)
        data = self._fh.read(want)
        self._dropped += self._pos
        self._dropped_lines += self._buf.count("\n", 0, self._pos)
        self._buf = self._buf[self._pos:] + data
        self._pos = 0
        if not data:
            self._eof = True
        return bool(data)

    def _where(self, pos: int) -> str:
        line = self._dropped_lines + self._buf.count("\n", 0, pos) + 1
        return f"line {line}, char {self._dropped + pos}"  # char from 0, as json's own errors

    def error(self, message: str, pos: Optional[int] = None) -> ValueError:
        return ValueError(f"{self.path}: not valid JSON: {message} at {self._where(self._pos if pos is None else pos)}")

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end of the file), not consumed."""
        while True:
            self._pos = _SPACE.match(self._buf, self._pos).end()
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._more():
                return ""

    def expect(self, chars: str, what: str) -> str:
        """Consumes the next non-blank character, one of ``chars``; ``what`` names them in the error."""
        c = self.peek()
        if c == "" or c not in chars:
            raise self.error(f"expected {what}, got {'the end of the file' if c == '' else repr(c)}")
        self._pos += 1
        return c

    def value(self) -> Any:
        """The next JSON value, decoded whole."""
        if self.peek() == "":
            raise self.error("expected a value, got the end of the file")
        while True:
            try:
                obj, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as exc:
                if self._may_run_on(exc) and self._more():
                    continue  # the value may run past the window: read on and decode it again
                raise self.error(exc.msg, exc.pos) from None
            except RecursionError:
                raise self.error("values nested too deeply") from None
            if isinstance(obj, (int, float)) and _NUMBER_TAIL.match(self._buf, end) and self._more():
                continue  # a number at the window's edge may go on (12|34, 2.5|e-3)
            self._span = (self._pos, end)
            self._pos = end
            return obj

    def _may_run_on(self, exc: json.JSONDecodeError) -> bool:
        """Whether a decoding error may only be the window's end: text that stops inside a
        string is reported where the string starts, anything else (a number, a literal, an
        escape, a missing delimiter) within a token's length of the end. An error earlier in the
        window is the file's own, reported at once instead of after reading the rest."""
        return exc.msg.startswith("Unterminated string") or exc.pos >= len(self._buf) - _LONGEST_TOKEN

    def last_value_has(self, word: str) -> bool:
        """Whether the text of the value ``value`` returned last holds ``word`` (a literal such
        as ``true`` that the decoded lists no longer show apart from 1)."""
        return self._buf.find(word, *self._span) >= 0

    # ---- objects ------------------------------------------------------------------------------
    def members(self):
        """Iterates over the keys of the object that starts here; after each key the caller
        must consume the member's value (``value()``, or ``members()`` again for an object)."""
        self.expect("{", "'{' (an object)")
        if self.peek() == "}":
            self._pos += 1
            return
        while True:
            if self.peek() != '"':
                raise self.error("expected a string key")
            key = self.value()
            self.expect(":", "':' after a key")
            yield key
            if self.expect(",}", "',' or '}' after a member") == "}":
                return

    def elements(self):
        """Iterates over the array that starts here, yielding before each element; the caller
        consumes the element (``value()`` …) before asking for the next. Decoding a large array
        element by element keeps each decoded value small, so a value that runs past the
        window is decoded again only up to one element."""
        self.expect("[", "'[' (an array)")
        if self.peek() == "]":
            self._pos += 1
            return
        while True:
            yield
            if self.expect(",]", "',' or ']' after an element") == "]":
                return

    def end(self) -> None:
        """Checks that nothing but whitespace follows the document."""
        if self.peek() != "":
            raise self.error("unexpected text after the end of the document")
