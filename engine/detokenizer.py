"""Incremental detokenization: turn a request's output tokens into text deltas, one token at a time, with stop strings.

Each step decodes a small window of token ids (a few tokens of context that are already accounted for, then the
new ones), as vLLM does with its prefix/read offsets, and releases only the text the window adds. Decoding the new
tokens together with their context is what gets the text right:

* sentencepiece drops the "▁" of the first piece of a decode; with context in front, the first output token after a
  prompt keeps its space (" world" after "hello", where decoding it alone would give "world");
* a character whose UTF-8 bytes are split over several byte tokens (sentencepiece byte fallback, byte-level BPE)
  decodes as U+FFFD until its last byte arrives, so text ending in U+FFFD is held back: a delta never holds half a
  character.

So the deltas concatenate to exactly what decoding prompt + output at once gives after the prompt's own text, for
any tokenizer whose decode of a sequence only ever extends as tokens are appended (both of Ferry's backends).

Stop strings are matched on that text, across token boundaries; text that could be the start of a stop string is
held back until it is clear it is not, so no delta ever has to be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.tokenizers.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what decoders give for bytes that are not (yet) a whole UTF-8 character
# Prompt tokens decoded as context in front of the first output token. More than 3: an incomplete UTF-8
# character at the end of the prompt spans at most 3 tokens, and the window must start before it.
PROMPT_CONTEXT_TOKENS = 5
# The window is cut back to a token or two of context once it holds this many tokens and all its text is out.
MAX_WINDOW_TOKENS = 16


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, at C speed
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class _DecodeWindow:
    """The tail of prompt + output ids that is decoded each step, and the part of its text already accounted for."""

    tokenizer: Tokenizer
    skip_special_tokens: bool
    ids: list[int]
    # Text of `ids` given out already (or the prompt's own). Normally a prefix of decode(ids); where it is not
    # (an incomplete character at the end of the prompt that the output completes), new text starts where they part.
    accounted: str = ""

    @classmethod
    def after_prompt(cls, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> _DecodeWindow:
        window = cls(tokenizer, skip_special_tokens, [])
        # Widen the context until it has text: past special tokens that decode to nothing, so that the decode of the
        # window has already used up sentencepiece's dropped first "▁" (and any decoder's start-of-text rule).
        start = max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS)
        while True:
            window.ids = list(prompt_ids[start:])
            window.accounted = window.decode()
            if window.accounted or start == 0:
                return window
            start = max(0, start - 2 * (len(prompt_ids) - start))

    def decode(self, ids: list[int] | None = None) -> str:
        return self.tokenizer.decode(self.ids if ids is None else ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add a token; return the new text that is certain (may be "")."""
        self.ids.append(token_id)
        text = self.decode()
        accounted = self.accounted
        # Per running request per step: the usual case (the window's text only grew) in one C call
        start = len(accounted) if text.startswith(accounted) else _common_prefix_len(accounted, text)
        # A trailing U+FFFD may be an incomplete character that the next tokens complete: hold it back.
        end = len(text.rstrip(REPLACEMENT_CHAR))
        if end <= start:
            return ""
        self.accounted = text[:end]
        if end == len(text) and len(self.ids) >= MAX_WINDOW_TOKENS:
            self._cut_back()
        return text[start:end]

    def flush(self) -> str:
        """All the text not given out yet, an incomplete last character included (as decode writes it)."""
        text = self.decode()
        start = _common_prefix_len(self.accounted, text)
        self.accounted = text
        return text[start:]

    def _cut_back(self) -> None:
        # Called only when all the window's text is out and it ends in a whole character, so nothing later can
        # change it. Keep the fewest last tokens that decode to some text, as context for the next token.
        for keep in range(1, len(self.ids)):
            if context := self.decode(self.ids[-keep:]):
                del self.ids[:-keep]
                self.accounted = context
                return


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The stop string that occurs first in `text` (the shorter on a tie) and where, or None."""
    found = [(i, len(stop), stop) for stop in stops if (i := text.find(stop)) >= 0]
    if not found:
        return None
    i, _, stop = min(found)
    return i, stop


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a stop string (and not all of one)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


@dataclass(slots=True)
class IncrementalDetokenizer:
    """One request's output text, released token by token.

    `add_token` returns the text delta to release (may be ""); at the finish (EOS, length) `flush` returns what was
    held back. The deltas concatenate to `output_text`, which is decode(prompt + output) after the prompt's text,
    cut at the first stop string (that kept when `include_stop_str_in_output`). A stop string sets `stopped_by`;
    the request should then finish ("stop"). After that, or after `flush`, `finished` is set and tokens are ignored.

    A character split between the prompt's last tokens and the output's first is the output's: the prompt's text
    ends before it (decode writes it as U+FFFD there).
    """

    tokenizer: Tokenizer
    prompt_token_ids: list[int]
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    output_text: str = field(default="", init=False)  # everything released so far
    stopped_by: str | None = field(default=None, init=False)
    finished: bool = field(default=False, init=False)
    _window: _DecodeWindow = field(init=False)
    _held: str = field(default="", init=False)  # certain text not released: it may start a stop string

    def __post_init__(self) -> None:
        self.stop = tuple(self.stop)
        if "" in self.stop:
            raise ValueError("stop strings must not be empty")
        self._window = _DecodeWindow.after_prompt(self.tokenizer, self.prompt_token_ids, self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """The text delta to release after `token_id` (may be "")."""
        if self.finished:
            return ""
        return self._release(self._window.push(token_id), at_end=False)

    def flush(self) -> str:
        """At the finish: the text still held back (a partial stop string, an incomplete last character)."""
        if self.finished:
            return ""
        delta = self._release(self._window.flush(), at_end=True)
        self.finished = True
        return delta

    def _release(self, new_text: str, at_end: bool) -> str:
        if not self.stop:  # nothing to match or hold back (the usual case, per running request per step)
            return self._emit(new_text)
        # Every stop string that ends in new_text starts in _held + new_text: any start of one in the text already
        # released would have been held back.
        text = self._held + new_text
        if (match := _first_stop(text, self.stop)) is not None:
            start, stop = match
            self.stopped_by, self.finished, self._held = stop, True, ""
            return self._emit(text[: start + len(stop)] if self.include_stop_str_in_output else text[:start])
        cut = len(text) - (0 if at_end else _partial_stop_len(text, self.stop))
        self._held = text[cut:]
        return self._emit(text[:cut])

    def _emit(self, delta: str) -> str:
        self.output_text += delta
        return delta
