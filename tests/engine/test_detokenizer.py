"""engine/detokenizer.py on a sentencepiece model (byte fallback) and a byte-level BPE, both trained here."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import MAX_WINDOW_TOKENS, IncrementalDetokenizer
from helpers.tokenizer_fixtures import WORDS, write_byte_level_bpe_dir, write_sentencepiece_dir
from models.tokenizers.load import load_tokenizer

REPLACEMENT_CHAR = "\ufffd"


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    return load_tokenizer(str(write_sentencepiece_dir(tmp_path_factory.mktemp("sp"))))


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    return load_tokenizer(str(write_byte_level_bpe_dir(tmp_path_factory.mktemp("hf"))))


@pytest.fixture(scope="module", params=["sentencepiece", "byte_level_bpe"])
def tok(request, sp_tok, hf_tok):
    return sp_tok if request.param == "sentencepiece" else hf_tok


def run(tok, prompt_ids, output_ids, **kwargs):
    """Feed output_ids one by one, then flush; return the detokenizer and its deltas (the flush's last)."""
    detok = IncrementalDetokenizer(tok, list(prompt_ids), **kwargs)
    deltas = []
    for token_id in output_ids:
        deltas.append(detok.add_token(token_id))
        assert detok.output_text == "".join(deltas)
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return detok, deltas


def text_after_prompt(tok, prompt_ids, output_ids, skip_special_tokens=True):
    """What decoding prompt + output at once adds to the prompt's text (the prompt's must be whole characters)."""
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    full = tok.decode(list(prompt_ids) + list(output_ids), skip_special_tokens=skip_special_tokens)
    assert REPLACEMENT_CHAR not in prompt_text and full.startswith(prompt_text)
    return full[len(prompt_text):]


def encode_pair(tok, prompt_text, output_text):
    """Prompt and output ids of prompt_text + output_text encoded as one text (as a model would continue it):
    encoding the output on its own would give it sentencepiece's dummy-prefix space."""
    ids = tok.encode(prompt_text + output_text)
    assert tok.decode(ids) == prompt_text + output_text
    split = next(k for k in range(len(ids) + 1) if tok.decode(ids[:k]) == prompt_text)
    return ids[:split], ids[split:]


def common_prefix_len(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def byte_token_ids(tok, char):
    """The ids of the single-byte tokens that spell `char` in UTF-8 (sentencepiece byte pieces or byte-level BPE)."""
    if hasattr(tok, "processor"):
        pieces = [f"<0x{b:02X}>" for b in char.encode()]
        return [tok.processor.piece_to_id(p) for p in pieces]
    return [tok.backend.token_to_id(_BYTE_TO_UNICODE[b]) for b in char.encode()]


def _bytes_to_unicode():
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are shifted past 255.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shift)
            shift += 1
    return chars


_BYTE_TO_UNICODE = _bytes_to_unicode()


# --- random text, split at random into prompt and output -----------------------------------------

# Words the tokenizers know (multi-character pieces, leading spaces) mixed with any characters at all (byte
# fallback / byte tokens for the unseen ones). U+2581 is sentencepiece's space symbol and cannot round-trip;
# U+FFFD is left out so that any U+FFFD in a delta is a broken character.
_ANY_CHAR = st.characters(codec="utf-8", exclude_characters="\u2581\ufffd")
_PIECES = st.one_of(st.sampled_from(WORDS), st.sampled_from([" ", "  ", "\n", " 🦀", "한국어", "ß"]),
                    st.text(alphabet=_ANY_CHAR, min_size=1, max_size=4))
_TEXTS = st.lists(_PIECES, max_size=12).map("".join)
_SETTINGS = settings(max_examples=150, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(text=_TEXTS, data=st.data(), add_special_tokens=st.booleans())
def test_random_split_deltas_are_exact(tok, text, data, add_special_tokens):
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    split = data.draw(st.integers(0, len(ids)), label="split")
    prompt, output = ids[:split], ids[split:]
    detok, deltas = run(tok, prompt, output)

    full, prompt_text = tok.decode(ids), tok.decode(prompt)
    # The prompt's text up to an incomplete last character (a character split between prompt and output), then
    # the output's, is the whole text: spaces, split characters and all.
    assert prompt_text.rstrip(REPLACEMENT_CHAR) + detok.output_text == full
    if REPLACEMENT_CHAR not in prompt_text:
        assert prompt_text + detok.output_text == full
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)  # never half a character
    if split == 0:
        assert detok.output_text == tok.decode(output)
    assert detok.stopped_by is None and detok.finished


@_SETTINGS
@given(text=_TEXTS, data=st.data())
def test_random_stop_strings(tok, text, data):
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("the fox")
    full = text_after_prompt(tok, prompt, ids)
    # Stop strings cut from the text (so they occur, and often across tokens), sometimes ones that do not occur.
    substring = st.tuples(st.integers(0, len(full)), st.integers(1, 6)).map(lambda s: full[s[0]: s[0] + s[1]])
    stops = data.draw(st.lists(st.one_of(substring, st.sampled_from(["zzz", "🦀🦀"])).filter(bool), max_size=3))
    include = data.draw(st.booleans())

    detok = IncrementalDetokenizer(tok, prompt, stop=tuple(stops), include_stop_str_in_output=include)
    deltas, fed = [], []
    for token_id in ids:
        if detok.stopped_by is not None:
            break
        fed.append(token_id)
        deltas.append(detok.add_token(token_id))
        assert REPLACEMENT_CHAR not in deltas[-1]
    deltas.append(detok.flush())

    # The text of the tokens fed, cut at the stop string that occurs first (the shorter on a tie).
    text_fed = text_after_prompt(tok, prompt, fed)
    hits = sorted((text_fed.find(s), len(s), s) for s in stops if s in text_fed)
    if hits:
        start, length, stop = hits[0]
        assert detok.stopped_by == stop
        assert detok.output_text == text_fed[: start + length if include else start]
        assert fed == ids[: len(fed)] and stop not in text_after_prompt(tok, prompt, fed[:-1])  # stopped at once
    else:
        assert detok.stopped_by is None and fed == ids
        assert detok.output_text == text_fed
    assert "".join(deltas) == detok.output_text


@_SETTINGS
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_random_token_ids(tok, data, skip_special_tokens):
    # Any ids at all, mostly single bytes (broken and unfinished characters, invalid UTF-8), some special tokens:
    # the output is what decoding prompt + output adds where it departs from the prompt's own text.
    ids = data.draw(st.lists(st.one_of(st.sampled_from(byte_token_ids(tok, "🦀") + byte_token_ids(tok, "中")),
                                       st.integers(0, tok.vocab_size - 1)), max_size=40), label="ids")
    split = data.draw(st.integers(0, len(ids)), label="split")
    prompt, output = ids[:split], ids[split:]
    detok, deltas = run(tok, prompt, output, skip_special_tokens=skip_special_tokens)
    prompt_text = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == full[common_prefix_len(prompt_text, full):]


# --- leading spaces and split characters ---------------------------------------------------------


def test_first_output_token_keeps_its_space(sp_tok, hf_tok):
    for tok in (sp_tok, hf_tok):
        prompt = tok.encode("hello")
        output = tok.encode("hello world", add_special_tokens=False)[1:]
        assert tok.convert_ids_to_tokens(output)[0] in ("▁world", "Ġworld")
        detok, deltas = run(tok, prompt, output)
        assert deltas == [" world", ""]
    # Decoding the output alone would drop it (sentencepiece's dummy-prefix "▁" is removed at the start).
    assert sp_tok.decode(sp_tok.encode("hello world", add_special_tokens=False)[1:]) == "world"
    # With no prompt text before it, the output starts as decode starts a text: without the space.
    assert run(sp_tok, [sp_tok.bos_token_id], sp_tok.encode("hello", add_special_tokens=False))[1] == ["hello", ""]
    assert run(sp_tok, [], sp_tok.encode(" two", add_special_tokens=False))[0].output_text == " two"


@pytest.mark.parametrize("char", ["🦀", "한", "中"])
def test_character_split_over_byte_tokens_never_appears_half(tok, char):
    byte_ids = byte_token_ids(tok, char)
    assert len(byte_ids) == len(char.encode()) >= 3
    assert all(len(tok.decode([i]).encode()) <= 3 for i in byte_ids)  # each one byte: alone it decodes as U+FFFD
    prompt, after = encode_pair(tok, "a crab:" + char, "a")
    prompt = prompt[: -len(byte_ids)]  # "a crab:" then the character's byte tokens as output
    detok = IncrementalDetokenizer(tok, prompt)
    assert [detok.add_token(i) for i in byte_ids[:-1]] == [""] * (len(byte_ids) - 1)
    assert detok.add_token(byte_ids[-1]) == char
    assert detok.add_token(after[0]) == "a"
    assert detok.flush() == ""
    assert detok.output_text == char + "a"
    # Byte tokens of one character after another: each released whole, the moment it completes.
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add_token(i) for i in byte_ids + byte_ids]
    assert [d for d in deltas if d] == [char, char] and deltas[len(byte_ids) - 1] == char


def test_trained_tokenizers_split_unseen_characters_into_bytes(tok):
    # The same happens with the tokenizers' own encodings of characters they never saw in training.
    prompt, ids = encode_pair(tok, "crab", " 🦀")
    assert len(ids) >= 3
    detok, deltas = run(tok, prompt, ids)
    assert deltas[-1] == "" and [d for d in deltas if d] in ([" 🦀"], [" ", "🦀"])


def test_character_split_between_prompt_and_output(tok):
    byte_ids = byte_token_ids(tok, "🦀")
    prompt = encode_pair(tok, "crab ", "🦀")[0] + byte_ids[:2]
    output = byte_ids[2:] + encode_pair(tok, "crab 🦀", "!")[1]
    prompt_text = tok.decode(prompt)
    assert prompt_text.endswith(REPLACEMENT_CHAR)
    detok, deltas = run(tok, prompt, output)
    assert deltas == ["", "🦀", "!", ""]  # the character goes to the output, whole
    assert prompt_text.rstrip(REPLACEMENT_CHAR) + detok.output_text == tok.decode(prompt + output) == "crab 🦀!"


def test_incomplete_character_at_finish_is_flushed_as_decode_writes_it(tok):
    prompt = tok.encode("crab")
    byte_ids = byte_token_ids(tok, "🦀")[:2]
    detok, deltas = run(tok, prompt, byte_ids)
    assert deltas[:-1] == ["", ""]
    assert deltas[-1] == text_after_prompt(tok, prompt, byte_ids) and deltas[-1].startswith(REPLACEMENT_CHAR)


def test_replacement_char_in_the_text_is_released_once_followed(tok):
    ids = tok.encode("a\ufffdb \ufffd", add_special_tokens=False)
    detok, deltas = run(tok, tok.encode("x"), ids)
    assert detok.output_text == text_after_prompt(tok, tok.encode("x"), ids)
    assert REPLACEMENT_CHAR in detok.output_text and deltas[-1].endswith(REPLACEMENT_CHAR)


# --- special tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_skip_special_tokens(tok, skip_special_tokens):
    eos = tok.eos_token_id
    output = tok.encode("hello", add_special_tokens=False) + [eos] + tok.encode(" world", add_special_tokens=False)
    prompt = tok.encode("the fox")
    detok, deltas = run(tok, prompt, output, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == text_after_prompt(tok, prompt, output, skip_special_tokens=skip_special_tokens)
    assert (tok.eos_token in detok.output_text) is not skip_special_tokens


def test_prompt_ending_in_special_tokens_keeps_the_space(sp_tok):
    # A prompt whose last tokens are all special (decoded to nothing): the context reaches back to real text.
    prompt = sp_tok.encode("hello") + [sp_tok.eos_token_id] * 8
    output = sp_tok.encode(" world", add_special_tokens=False)
    detok, _ = run(sp_tok, prompt, output)
    assert detok.output_text == text_after_prompt(sp_tok, prompt, output) == "  world"


# --- stop strings --------------------------------------------------------------------------------


def token_texts(tok, prompt, ids):
    """The text each token adds after the prompt (here: only tokens of whole characters)."""
    texts = [text_after_prompt(tok, prompt, ids[: i + 1]) for i in range(len(ids))]
    return [b[len(a):] for a, b in zip([""] + texts, texts)]


def spanning_stop(tok, prompt, ids, first, count):
    """A stop string from the last 2 characters of token `first` to the first 2 of token `first + count - 1`,
    and where it starts in the output text."""
    pieces = token_texts(tok, prompt, ids)
    head, tail = pieces[first][-2:], pieces[first + count - 1][:2]
    stop = head + "".join(pieces[first + 1: first + count - 1]) + tail
    return stop, len("".join(pieces[: first + 1])) - len(head)


TEXT = "hello world the quick brown fox"


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tok, count, include):
    prompt, ids = tok.encode("jax"), tok.encode(TEXT, add_special_tokens=False)
    first = 2
    stop, start = spanning_stop(tok, prompt, ids, first, count)
    full = text_after_prompt(tok, prompt, ids)
    assert full.find(stop) == start and stop == {2: "he q", 3: "he quick b"}[count]

    detok = IncrementalDetokenizer(tok, prompt, stop=(stop, "never"), include_stop_str_in_output=include)
    deltas = [detok.add_token(i) for i in ids[: first + count - 1]]
    assert detok.stopped_by is None
    assert "".join(deltas) == full[:start]  # the stop string's start is held back, not released
    deltas.append(detok.add_token(ids[first + count - 1]))
    assert detok.stopped_by == stop and detok.finished
    expected = full[: start + len(stop)] if include else full[:start]
    assert detok.output_text == "".join(deltas) == expected
    # Nothing after the stop string is released, not even what its last token brought along.
    assert all(detok.add_token(i) == "" for i in ids[first + count:]) and detok.output_text == expected
    assert detok.flush() == "" and detok.output_text == expected


def test_partial_match_released_when_it_turns_out_not_a_stop(tok):
    prompt, ids = tok.encode("jax"), tok.encode(TEXT, add_special_tokens=False)
    pieces = token_texts(tok, prompt, ids)
    assert [p.strip() for p in pieces] == TEXT.split()
    detok = IncrementalDetokenizer(tok, prompt, stop=("hello there", " brown cow"))
    deltas = [detok.add_token(i) for i in ids]
    # "hello" might start "hello there": held, then released with " world".
    assert deltas[:2] == [pieces[0].removesuffix("hello"), "hello" + pieces[1]]
    brown = pieces.index(" brown")
    assert deltas[brown] == "" and deltas[brown + 1] == " brown fox"  # " brown" might start " brown cow"
    assert detok.stopped_by is None
    assert "".join(deltas) + detok.flush() == detok.output_text == text_after_prompt(tok, prompt, ids)


def test_partial_match_at_finish_is_flushed(tok):
    prompt, ids = tok.encode("jax"), tok.encode("the quick bro", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, stop=("brown", "ick brown"))
    deltas = [detok.add_token(i) for i in ids]
    full = text_after_prompt(tok, prompt, ids)
    assert "".join(deltas) == full[: full.index("ick")]  # "ick bro" could still become "ick brown"
    assert detok.flush() == "ick bro"
    assert detok.output_text == full and detok.stopped_by is None


@pytest.mark.parametrize("stops, stopped_by, kept", [
    (("fox", "quick"), "quick", " the "),       # the earliest occurrence wins, whatever the order given
    (("quick brown", "ick"), "ick", " the qu"),  # "ick" is complete first: the tokens stop there
    (("own", "brown f", "b"), "b", " the quick "),
    (("quick", "qui"), "qui", " the "),          # both end in the same token: same start, the shorter
])
def test_multiple_stop_strings(tok, stops, stopped_by, kept):
    prompt, ids = encode_pair(tok, "hello world", " the quick brown fox")
    detok = IncrementalDetokenizer(tok, prompt, stop=stops)
    deltas = []
    for i in ids:
        deltas.append(detok.add_token(i))
        if detok.stopped_by:
            break
    assert detok.stopped_by == stopped_by
    assert "".join(deltas) == detok.output_text == kept


def test_stop_string_in_the_token_after_a_held_character(tok):
    # A stop string right after a split character: the character is released whole, the stop string caught.
    prompt = encode_pair(tok, "crab ", "🦀")[0]
    ids = byte_token_ids(tok, "🦀") + encode_pair(tok, "crab 🦀", "!!")[1]
    detok, deltas = run(tok, prompt, ids, stop=("🦀!",))
    assert detok.stopped_by == "🦀!" and detok.output_text == "" and deltas[:3] == ["", "", ""]


def test_empty_stop_string_is_refused(tok):
    with pytest.raises(ValueError, match="empty"):
        IncrementalDetokenizer(tok, [], stop=("",))


# --- cost ----------------------------------------------------------------------------------------


class DecodeSpy:
    """A tokenizer that records how many ids each decode was given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=True):
        ids = list(ids)
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_window_stays_small_on_long_outputs(tok):
    text = " ".join(WORDS * 12) + " 🦀 한국어"
    prompt = tok.encode("a long prompt " * 50)
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 250
    spy = DecodeSpy(tok)
    detok, _ = run(spy, prompt, ids)
    assert detok.output_text == text_after_prompt(tok, prompt, ids)
    assert max(spy.sizes) <= MAX_WINDOW_TOKENS + 1  # never the whole output, nor the whole prompt
    assert len(spy.sizes) <= 1.25 * len(ids) + 10   # about one decode per token

