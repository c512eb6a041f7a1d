"""The tokenizer a GGUF file describes in its metadata: a `tokenizers.Tokenizer` in
models.tokenizers.tokenizer.HFTokenizer.

* `tokenizer.ggml.model = gpt2`: byte-level BPE from `tokens` and `merges`, the text split by the regex
  llama.cpp uses for the pre-tokenizer named in `tokenizer.ggml.pre`;
* `tokenizer.ggml.model = llama`: a SentencePiece BPE vocabulary (`tokens`, `scores`): the merges are
  recovered from the scores, with byte fallback and the `▁` word marker, as transformers' LlamaTokenizer does.

Tokens marked CONTROL are special (kept whole, dropped by skip_special_tokens), USER_DEFINED ones are
added tokens. BOS/EOS/PAD ids, `add_bos_token` and the chat templates come from the metadata too.
"""

import logging

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from models.checkpoints.gguf import eos_token_ids, read_gguf
from models.tokenizers.tokenizer import HFTokenizer, TokenizerError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
CONTROL, USER_DEFINED = 3, 4

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp splits text with, in order (llama-vocab.cpp).
PRE_TOKENIZER_SPLITS = {
    "default": (_GPT2_SPLIT,), "gpt-2": (_GPT2_SPLIT,), "gpt2": (_GPT2_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,), "llama-bpe": (_LLAMA3_SPLIT,), "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,), "dbrx": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,), "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    # SmolLM (and StarCoder): every digit on its own, then GPT-2's split.
    "smollm": (r"\p{N}", _GPT2_SPLIT), "starcoder": (r"\p{N}", _GPT2_SPLIT), "refact": (r"\p{N}", _GPT2_SPLIT),
}


def load_gguf_tokenizer(path: str) -> HFTokenizer:
    meta = read_gguf(path).metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata")
    if kind == "gpt2":
        backend, add_bos_default = _byte_level_bpe(meta, path), False
    elif kind == "llama":
        backend, add_bos_default = _sentencepiece_bpe(meta, path), True
    else:
        raise TokenizerError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
    _add_special_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type") or [])

    def token(key: str) -> tuple[str | None, int | None]:
        i = meta.get(f"tokenizer.ggml.{key}")
        return (tokens[i], i) if i is not None and 0 <= i < len(tokens) else (None, None)

    (bos, bos_id), (eos, eos_id) = token("bos_token_id"), token("eos_token_id")
    pad, pad_id = token("padding_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    backend.post_processor = _post_processor(kind, bos if add_bos else None, bos_id, eos if add_eos else None, eos_id)
    names = {"bos_token": bos, "eos_token": eos, "unk_token": token("unknown_token_id")[0], "pad_token": pad}
    return HFTokenizer(
        backend=backend, model_dir=path, vocab_size=backend.get_vocab_size(with_added_tokens=True),
        bos_token=bos, eos_token=eos, pad_token=pad, bos_token_id=bos_id, eos_token_ids=eos_token_ids(meta),
        pad_token_id=pad_id, special_tokens={k: v for k, v in names.items() if v is not None},
        chat_templates=chat_templates(meta))


def chat_templates(meta: dict) -> dict[str, str]:
    """tokenizer.chat_template is the default; tokenizer.chat_template.NAME the named ones."""
    prefix = "tokenizer.chat_template"
    templates = {key.removeprefix(prefix + "."): value for key, value in meta.items() if key.startswith(prefix + ".")}
    if prefix in meta:
        templates["default"] = meta[prefix]
    return templates


def _byte_level_bpe(meta: dict, path: str) -> Backend:
    # Tokens are stored in GPT-2's byte alphabet already (Ġ for a space), as tokenizer.json has them.
    vocab = {token: i for i, token in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        logging.warning("%s: tokenizer.ggml.pre %r is not known to Ferry; splitting text as GPT-2 does", path, pre)
        splits = (_GPT2_SPLIT,)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict, path: str) -> Backend:
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise TokenizerError(f"{path}: a llama (SentencePiece) vocabulary needs tokenizer.ggml.scores, one per token")
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = Backend(models.BPE(vocab=vocab, merges=sentencepiece_merges(tokens, scores), fuse_unk=True,
                                 byte_fallback=True, unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two vocabulary
    pieces, the best-scored token's first (SentencePiece merges the highest-scoring pair first)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        merges += sorted(((left, right, score) for left, right in pairs), key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(backend: Backend, tokens: list[str], types: list[int]):
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    backend.add_special_tokens(control)
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])


def _post_processor(kind: str, bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None):
    single = " ".join(([f"{bos}"] if bos else []) + ["$A"] + ([f"{eos}"] if eos else []))
    pair = " ".join(([f"{bos}"] if bos else []) + ["$A"] + ([f"{eos}"] if eos else [])
                    + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t]
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    if kind == "gpt2":
        return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    return template
