"""Small tokenizers trained in-test, shared by the tokenizer and detokenizer tests.

Both are trained on the same kind of text (words in several scripts, varied whitespace) so that
characters seen in training get their own pieces and unseen ones (other emoji, Hangul, ...) fall back
to bytes. Training takes well under a second each.
"""

import io
import json
import pathlib
import random

import sentencepiece as spm
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

# Training text: words in several scripts, joined by varied whitespace.
WORDS = ["hello", "world", "the", "quick", "brown", "fox", "tokenizer", "ferry", "jax", "café", "über",
         "naïve", "Grüße", "résumé", "中文", "测试", "日本語", "😀", "🚀", "emoji", "a", "of", "1234"]

BYTE_LEVEL_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                             "<|end_header_id|>", "<|im_start|>", "<|im_end|>"]


def corpus(n: int = 1500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    seps = [" ", " ", " ", "  ", "\n", "\n\n", "\t"]
    return ["".join(rng.choice(WORDS) + rng.choice(seps) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def write_json(path: pathlib.Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def write_sentencepiece_dir(d: pathlib.Path) -> pathlib.Path:
    """A Llama-2-style sentencepiece BPE (byte fallback, no normalisation, dummy prefix) in directory `d`."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, model_type="bpe", vocab_size=400,
        byte_fallback=True, character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
        # Llama-2's settings: identity normalisation keeps every space, so decode(encode(x)) == x even with
        # leading or repeated spaces; the dummy prefix added on encode is removed again on decode.
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
    )
    (d / "tokenizer.model").write_bytes(model.getvalue())
    write_json(d / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                      "rstrip": False, "special": True},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
    })
    write_json(d / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2, 7]})
    return d


def write_byte_level_bpe_dir(d: pathlib.Path, chat_template: str | None = None) -> pathlib.Path:
    """A Llama-3-style byte-level BPE tokenizer.json with a BOS post-processor, in directory `d`."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=450, special_tokens=BYTE_LEVEL_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(corpus(seed=1), trainer)
    raw.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
            special_tokens=[("<|begin_of_text|>", 0)]),
    ])
    raw.save(str(d / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "special": True},
    }
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    write_json(d / "tokenizer_config.json", tokenizer_config)
    write_json(d / "generation_config.json", {"eos_token_id": [1, 2]})
    write_json(d / "config.json", {"bos_token_id": 0, "eos_token_id": 1})
    return d
