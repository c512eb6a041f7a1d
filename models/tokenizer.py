"""Tokenizers for Ferry: load a Hugging Face model directory's tokenizer and chat template.

`load_tokenizer(model_dir)` picks the backend from what the directory holds (a GGUF file: models/gguf_tokenizer.py):

* `tokenizer.json` -> the `tokenizers` library, exactly as transformers' fast tokenizer uses it
  (the post-processor in the JSON decides whether BOS/EOS are added);
* else `tokenizer.model` -> sentencepiece (BOS prepended when `add_bos_token`, default true, Llama-2 style).

Special tokens come from `tokenizer_config.json` / `special_tokens_map.json`, with ids filled in from
`generation_config.json` and `config.json`; EOS ids are the union of the tokenizer's EOS token and
`generation_config.json`'s `eos_token_id` (`config.json`'s when there is no generation config).

`decode` is exact (no clean-up of spaces), so `decode(encode(text, add_special_tokens=False)) == text`
for both backends, and an incremental detokenizer can diff decodes of a sliding prefix window.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# The named special tokens transformers hands to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


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
    # ids -> str: sentencepiece's C++ method where this version exposes it. Its Python `decode` spends twice
    # the C++ call's time sorting out its input types, on the detokenizer's hot path (3.7 vs 7.9 us a window).
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


def load_tokenizer(model_dir: str) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (`tokenizer.json`, else `tokenizer.model`), or of a
    GGUF file (or a directory holding one and neither file), built from its metadata (models/gguf_tokenizer.py)."""
    if _gguf_without_tokenizer_files(model_dir):
        from models.gguf import find_gguf_file  # noqa: PLC0415 (GGUF support imports this module)
        from models.gguf_tokenizer import load_gguf_tokenizer  # noqa: PLC0415

        return load_gguf_tokenizer(find_gguf_file(model_dir))
    tok_config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
    gen_config = _read_json(os.path.join(model_dir, "generation_config.json"))
    model_config = _read_json(os.path.join(model_dir, "config.json"))

    json_path = os.path.join(model_dir, TOKENIZER_JSON)
    sp_path = os.path.join(model_dir, SENTENCEPIECE_MODEL)
    if os.path.isfile(json_path):
        backend = _load_tokenizers_json(json_path)
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        token_to_id, id_to_token = backend.token_to_id, backend.id_to_token
        own_ids: dict[str, int] = {}
    elif os.path.isfile(sp_path):
        processor = _load_sentencepiece(sp_path)
        vocab_size = processor.get_piece_size()

        def token_to_id(token: str) -> int | None:
            i = processor.piece_to_id(token)
            # piece_to_id answers unk_id for unknown pieces; only believe it for the unk piece itself.
            return i if i != processor.unk_id() or token == processor.id_to_piece(i) else None

        def id_to_token(i: int) -> str | None:
            return processor.id_to_piece(i) if 0 <= i < vocab_size else None

        own_ids = {
            name: i
            for name, i in (("bos_token", processor.bos_id()), ("eos_token", processor.eos_id()),
                            ("pad_token", processor.pad_id()), ("unk_token", processor.unk_id()))
            if i >= 0
        }
    else:
        raise FileNotFoundError(
            f"{model_dir}: no tokenizer found (expected {TOKENIZER_JSON} or {SENTENCEPIECE_MODEL})"
        )

    # The config's added tokens name ids that the backend itself may not know (tokens added on top).
    added = {}
    for i, entry in (tok_config.get("added_tokens_decoder") or {}).items():
        if (content := _token_text(entry)) is not None:
            added[content] = int(i)

    def lookup(token: str) -> int | None:
        i = token_to_id(token)
        return added.get(token) if i is None else i

    def config_id(key: str) -> int | None:  # bos_token_id / pad_token_id from the model's configs
        for config in (gen_config, model_config):
            ids = _id_list(config.get(key))
            if ids:
                return ids[0]
        return None

    special_tokens: dict[str, str] = {}
    special_token_ids: dict[str, int | None] = {}
    for name in NAMED_SPECIAL_TOKENS:
        text = _token_text(tok_config.get(name, special_map.get(name)))
        token_id = lookup(text) if text is not None else None
        if text is None:
            token_id = own_ids.get(name)
            if token_id is None and name in ("bos_token", "pad_token"):
                token_id = config_id(f"{name}_id")
            if token_id is None and name == "eos_token":
                token_id = next(iter(_id_list(gen_config.get("eos_token_id", model_config.get("eos_token_id")))), None)
            text = id_to_token(token_id) if token_id is not None else None
        if text is not None:
            special_tokens[name] = text
        special_token_ids[name] = token_id

    eos_ids = [special_token_ids["eos_token"]] if special_token_ids["eos_token"] is not None else []
    for i in _id_list(gen_config.get("eos_token_id", model_config.get("eos_token_id"))):
        if i not in eos_ids:
            eos_ids.append(i)

    common = dict(
        model_dir=model_dir,
        vocab_size=vocab_size,
        bos_token=special_tokens.get("bos_token"),
        eos_token=special_tokens.get("eos_token"),
        pad_token=special_tokens.get("pad_token"),
        bos_token_id=special_token_ids["bos_token"],
        eos_token_ids=tuple(eos_ids),
        pad_token_id=special_token_ids["pad_token"],
        special_tokens=special_tokens,
        chat_templates=_read_chat_templates(model_dir, tok_config),
    )
    if os.path.isfile(json_path):
        return HFTokenizer(backend=backend, **common)

    special_ids = frozenset(
        i for i in range(vocab_size) if processor.is_control(i) or processor.is_unknown(i)
    )
    pieces = sorted((processor.id_to_piece(i) for i in special_ids), key=len, reverse=True)
    pieces = [p for p in pieces if p]
    return SentencePieceTokenizer(
        processor=processor,
        add_bos_token=bool(tok_config.get("add_bos_token", True)),
        add_eos_token=bool(tok_config.get("add_eos_token", False)),
        special_ids=special_ids,
        special_pattern=re.compile("|".join(map(re.escape, pieces))) if pieces else None,
        **common,
    )


# --- files ---------------------------------------------------------------------------------------


def _gguf_without_tokenizer_files(path: str) -> bool:
    if os.path.isfile(path):
        return path.endswith(".gguf")
    has_files = any(os.path.isfile(os.path.join(path, n)) for n in (TOKENIZER_JSON, SENTENCEPIECE_MODEL))
    return not has_files and os.path.isdir(path) and any(n.endswith(".gguf") for n in os.listdir(path))



def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _load_tokenizers_json(path: str):
    from tokenizers import Tokenizer as _Backend

    try:
        backend = _Backend.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerError(f"{path}: cannot load tokenizer: {e}") from e
    # A serving engine sees every prompt token: lengths are checked by the engine, never cut silently here.
    backend.no_truncation()
    backend.no_padding()
    return backend


def _load_sentencepiece(path: str):
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.load(path)
    except Exception as e:  # sentencepiece raises OSError or RuntimeError on a corrupt model
        raise TokenizerError(f"{path}: cannot load sentencepiece model: {e}") from e
    return processor


def _read_chat_templates(model_dir: str, tok_config: dict) -> dict[str, str]:
    """chat_template.jinja wins over tokenizer_config.json's chat_template (a string or a named list)."""
    templates: dict[str, str] = {}
    config_template = tok_config.get("chat_template")
    if isinstance(config_template, str):
        templates["default"] = config_template
    elif isinstance(config_template, list):
        templates.update({t["name"]: t["template"] for t in config_template})
    jinja_path = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            templates["default"] = f.read()
    return templates


def _token_text(value: Any) -> str | None:
    """A special token from a config: a string, or a dict (a serialised AddedToken) with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


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
