"""load_tokenizer: a model directory's tokenizer and chat templates, picking the backend from what it holds.

* `tokenizer.json` -> the `tokenizers` library, exactly as transformers' fast tokenizer uses it
  (the post-processor in the JSON decides whether BOS/EOS are added);
* else `tokenizer.model` -> sentencepiece (BOS prepended when `add_bos_token`, default true, Llama-2 style);
* a GGUF file (or a directory holding one and neither file) -> its metadata (models/tokenizers/gguf.py).

Special tokens come from `tokenizer_config.json` / `special_tokens_map.json`, with ids filled in from
`generation_config.json` and `config.json`; EOS ids are the union of the tokenizer's EOS token and
`generation_config.json`'s `eos_token_id` (`config.json`'s when there is no generation config).
"""

import json
import os
import re
from typing import Any

from models.checkpoints.gguf import find_gguf_file
from models.tokenizers.gguf import load_gguf_tokenizer
from models.tokenizers.tokenizer import (
    CHAT_TEMPLATE_FILE,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
)

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"

# The named special tokens transformers hands to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer(model_dir: str) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (`tokenizer.json`, else `tokenizer.model`), or of a
    GGUF file (or a directory holding one and neither file), built from its metadata (models/tokenizers/gguf.py)."""
    if _gguf_without_tokenizer_files(model_dir):
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
