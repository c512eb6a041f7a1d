"""Tokenizers for Ferry: what every backend offers (`Tokenizer`), the `tokenizers` and sentencepiece backends, and
chat templates. models/tokenizers/load.py builds one from a model directory; models/tokenizers/gguf.py from a GGUF
file's metadata.

`decode` is exact (no clean-up of spaces), so `decode(encode(text, add_special_tokens=False)) == text`
for both backends, and an incremental detokenizer can diff decodes of a sliding prefix window.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

CHAT_TEMPLATE_FILE = "chat_template.jinja"

class TokenizerError(ValueError):
    """A tokenizer file Ferry cannot read; the message names the file."""


class ChatTemplateError(ValueError):
    """A chat template that is missing, does not compile, or refused the conversation."""


@dataclasses.dataclass(slots=True, kw_only=True)
class Tokenizer(abc.ABC):
    """What every backend offers. Use `load_tokenizer` to build one."""

    model_dir: str
    vocab_size: int  # every id the tokenizer can produce or decode, added tokens included (len(hf_tokenizer))
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # Named special tokens (bos_token, eos_token, unk_token, ...) as chat templates see them.
    special_tokens: dict[str, str]
    # Chat templates by name; the one used by default is "default".
    chat_templates: dict[str, str]

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    @abc.abstractmethod
    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The raw vocabulary pieces (byte-level 'Ġ' / sentencepiece '▁' forms), one per id."""

    @abc.abstractmethod
    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """Join raw pieces into text, as the backend's decoder does."""

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to a prompt string, as transformers' `apply_chat_template(tokenize=False)`.

        `chat_template` is a template's name (from a multi-template config) or Jinja source; None uses the
        model's default. Extra keyword arguments become template variables (e.g. `enable_thinking=False`).
        The prompt already holds any BOS the template writes: encode it with `add_special_tokens=False`.
        """
        if chat_template is None or chat_template in self.chat_templates:
            name = chat_template or "default"
            if name not in self.chat_templates:
                raise ChatTemplateError(
                    f"{self.model_dir}: no chat template (looked for 'chat_template' in tokenizer_config.json "
                    f"and for {CHAT_TEMPLATE_FILE}); pass chat_template= to apply_chat_template"
                )
            chat_template = self.chat_templates[name]
        try:
            template = _compile_chat_template(chat_template)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise ChatTemplateError(f"{self.model_dir}: chat template does not compile: {e}") from e
        # transformers drops None-valued keys (e.g. content=None from OpenAI-style clients) before rendering.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **template_kwargs}
        try:
            return template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _TemplateRaised as e:
            raise ChatTemplateError(f"{self.model_dir}: chat template raised an exception: {e}") from None

    def encode_chat(self, messages: list[dict], **template_args: Any) -> tuple[str, list[int]]:
        """(prompt text, token ids) of a conversation: `apply_chat_template(messages, **template_args)`,
        encoded without adding special tokens, since the template writes any BOS itself."""
        text = self.apply_chat_template(messages, **template_args)
        return text, self.encode(text, add_special_tokens=False)


@dataclasses.dataclass(slots=True, kw_only=True)
class HFTokenizer(Tokenizer):
    """A `tokenizer.json`, run by the `tokenizers` library."""

    backend: Any  # tokenizers.Tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: only it releases the GIL, so a long prompt tokenized on a worker thread
        # does not freeze the server's event loop (same ids either way).
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        if type(ids) is not list:  # a list (the detokenizer's) goes as it is: tokenizers takes numpy ints too
            ids = [int(i) for i in ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        if self.backend.decoder is None:
            return "".join(tokens)
        return self.backend.decoder.decode(list(tokens))


@dataclasses.dataclass(slots=True, kw_only=True)
class SentencePieceTokenizer(Tokenizer):
    """A `tokenizer.model`, run by sentencepiece.

    Text is encoded with sentencepiece as is, except that the strings of its control and unknown
    pieces ("<s>", "</s>", "<unk>") are matched as those tokens, the way transformers does for special
    tokens; each stretch of text between them is encoded on its own (so gets sentencepiece's dummy-prefix
    space, like Meta's Llama-2 reference and transformers' legacy Llama tokenizer). Decoding undoes that,
    so decode(encode(text, False), skip_special_tokens=False) == text.
    """

    processor: Any  # sentencepiece.SentencePieceProcessor
    add_bos_token: bool
    add_eos_token: bool
    special_ids: frozenset[int]
    special_pattern: re.Pattern | None  # matches the text of any special piece
    # ids -> str: sentencepiece's C++ method where this version exposes it. Its Python `decode` spends more
    # time sorting out its input types than the C++ call takes, on the detokenizer's hot path.
    decode_ids: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        native = getattr(getattr(self.processor, "_processor", None), "_DecodeIds", None)
        self.decode_ids = native if native is not None else self.processor.decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        sp = self.processor
        if self.special_pattern is None:
            ids = sp.encode(text)
        else:
            ids, start = [], 0
            for match in self.special_pattern.finditer(text):
                if match.start() > start:
                    ids += sp.encode(text[start : match.start()])
                ids.append(sp.piece_to_id(match.group()))
                start = match.end()
            if start < len(text):
                ids += sp.encode(text[start:])
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        sp = self.processor
        if type(ids) is not list:  # a list (the detokenizer's) goes as it is: sentencepiece takes numpy ints too
            ids = list(map(int, ids))
        if skip_special_tokens:
            # The detokenizer's hot path: a window with no special ids (the usual case) goes through as it is.
            if not self.special_ids.isdisjoint(ids):
                ids = [i for i in ids if i not in self.special_ids]
            return self.decode_ids(ids)
        # Special pieces are written as their text; the stretches between them are decoded one by one.
        parts, run = [], []
        for i in ids:
            if i in self.special_ids:
                if run:
                    parts.append(sp.decode(run))
                    run = []
                parts.append(sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            parts.append(sp.decode(run))
        return "".join(parts)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.processor.id_to_piece(int(i)) for i in ids]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        return self.processor.decode_pieces(list(tokens))


# --- chat templates ------------------------------------------------------------------------------


class _TemplateRaised(Exception):
    """raise_exception() called by a chat template."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # As transformers: plain json.dumps, not Jinja's HTML-escaping tojson.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
