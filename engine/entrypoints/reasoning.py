"""Reasoning output: a thinking model's `<think>...</think>` moved out of `content` into `reasoning_content`, as
vLLM's `--reasoning-parser` does (the server's --reasoning_parser picks one of REASONING_PARSERS by name).

  deepseek_r1  DeepSeek-R1's template already ends the prompt with `<think>`, so the output is reasoning until
               `</think>` (a leading `<think>` is dropped too); no `</think>` by the end: all of it was reasoning.
  qwen3        reasoning only between a leading `<think>` and `</think>`; an output that does not start with
               `<think>` (Qwen3 with enable_thinking=False) is all content. A `<think>` never closed (the output
               was cut short) stays reasoning, as it streamed.

Each choice's text is fed delta by delta (`feed(text, finished)` -> (reasoning delta, content delta)); a possible
partial tag at the end of a delta is held back until the next one decides it. Parsing whole is one feed.
"""

from engine.entrypoints.tool_calls import partial_suffix

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    """One choice's output split into reasoning and content. Subclasses say where the output starts."""

    starts_in_reasoning = False       # the prompt opened the reasoning already (R1)
    tags = (THINK_START, THINK_END)   # the text must keep them (engine/entrypoints/tool_calls.py `drops_tags`)

    def __init__(self):
        self.pending = ""             # text held back: a possible tag
        self.state = "start"          # "start" (a leading <think> may come), "reasoning", "content"

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.pending += text
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(THINK_START):
                self.pending, self.state = head[len(THINK_START):], "reasoning"
            elif THINK_START.startswith(head) and not finished:
                return "", ""         # nothing but (the start of) a tag yet
            else:
                self.state = "reasoning" if self.starts_in_reasoning else "content"
        reasoning = ""
        if self.state == "reasoning":
            end = self.pending.find(THINK_END)
            if end < 0:
                cut = len(self.pending) - (0 if finished else partial_suffix(self.pending, THINK_END))
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending, self.state = self.pending[:end], self.pending[end + len(THINK_END):], "content"
        content, self.pending = self.pending, ""
        return reasoning, content


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def parse_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; None where there is none (as vLLM)."""
    reasoning, content = REASONING_PARSERS[parser]().feed(text, finished=True)
    return reasoning or None, content or None
