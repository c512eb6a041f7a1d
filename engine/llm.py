"""LLM: offline batch generation over an engine (vLLM's `LLM`): every prompt through continuous batching,
outputs in input order."""

import time
from collections.abc import Sequence
from numbers import Integral

import numpy as np
from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.data_parallel import make_engine
from engine.outputs import EmbeddingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams, SamplingParamsError
from models.loading import LoadedModel
from models.tokenizers.tokenizer import Tokenizer


class LLM:
    """Offline batch generation: every prompt through continuous batching, outputs in input order.

        llm = LLM("models/default")
        outputs = llm.generate(["def fib(n):", "The"], SamplingParams(max_tokens=32, temperature=0))
        replies = LLM("smollm2").chat([{"role": "user", "content": "What is the capital of France?"}])
    """

    def __init__(self, model: LoadedModel | str, config: EngineConfig | None = None, **config_kwargs):
        self.engine = make_engine(model, config or EngineConfig(**config_kwargs))

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """`prompts`: one prompt or a list of them, each a string, a list of token ids, or vLLM's TextPrompt /
        TokensPrompt dict ({"prompt": ...} or {"prompt_token_ids": [...]}, optionally with "cache_salt").
        One SamplingParams for all, or one each."""
        prompts = _prompt_list(prompts)
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        engine = self.engine
        ids = self._add_all(prompts, params, final_only=True)
        finals: dict[str, RequestOutput] = {}
        full_outputs = {rid: engine.full_output(rid) for rid in ids}
        t0, generated = time.perf_counter(), 0
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(finals) < len(ids):
                for delta in engine.step():
                    generated += sum(len(o.token_ids) for o in delta.outputs)
                    if delta.finished and delta.request_id in full_outputs:
                        finals[delta.request_id] = full_outputs[delta.request_id]()
                        bar.update(1)
                bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - t0, 1e-9):.1f}")
        return [finals[rid] for rid in ids]

    def _add_all(self, prompts: list, params: list, **kwargs) -> list[str]:
        """Queue every (prompt, cache_salt) with its params; all or nothing: a bad prompt leaves no half-queued
        batch behind. Returns the request ids."""
        ids = []
        try:
            for (prompt, salt), p in zip(prompts, params):
                ids.append(self.engine.add_request(None, prompt, p, cache_salt=salt, **kwargs))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return ids

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of them,
        each rendered with the model's chat template (or `chat_template`: a name or Jinja source), as
        vLLM's LLM.chat. `chat_template_kwargs` become template variables (e.g. enable_thinking=False).
        Each output's `prompt` is the rendered conversation."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template, and this model has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations or any(not c for c in conversations):
            raise SamplingParamsError("messages", "a conversation is empty")
        rendered = [self.tokenizer.encode_chat(list(c), add_generation_prompt=add_generation_prompt,
                                               chat_template=chat_template, tools=tools,
                                               **(chat_template_kwargs or {}))
                    for c in conversations]
        outputs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm)
        for output, (text, _) in zip(outputs, rendered):
            output.prompt = text
        return outputs

    def embed(self, prompts, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embed each prompt (the forms `generate` takes) as vLLM's LLM.embed: its final hidden states pooled
        (`pooling_params`, default last-token and L2-normalized), through the same continuous batching;
        outputs in input order. A failed request's output has `error` set and an empty embedding."""
        prompts = _prompt_list(prompts)
        engine = self.engine
        ids = self._add_all(prompts, [pooling_params or PoolingParams()] * len(prompts))
        finals: dict[str, EmbeddingRequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="embed", unit="req", disable=not use_tqdm) as bar:
            while len(finals) < len(ids):
                for output in engine.step():
                    if isinstance(output, EmbeddingRequestOutput) and output.request_id in wanted:
                        finals[output.request_id] = output
                        bar.update(1)
        return [finals[rid] for rid in ids]


PROMPT_FORMS = ("a string, a list of token ids, a TextPrompt {'prompt': str} or TokensPrompt {'prompt_token_ids': "
                "[int, ...]} dict, or a list of these")
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def _is_token_ids(value) -> bool:
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and value.size > 0 and np.issubdtype(value.dtype, np.integer)
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and all(
        isinstance(t, Integral) and not isinstance(t, bool) for t in value)


def _prompt_list(prompts) -> list[tuple[str | list[int], str | None]]:
    """One prompt or a list of them (see LLM.generate) -> [(text or token ids, cache_salt), ...]. A form
    Ferry does not take is a TypeError naming the accepted ones; a dict's bad field a ValueError naming it."""
    if isinstance(prompts, str | dict) or _is_token_ids(prompts):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, str):
        raise TypeError(f"prompts must be {PROMPT_FORMS}; got {type(prompts).__name__}")
    return [_one_prompt(prompt) for prompt in prompts]


def _one_prompt(prompt) -> tuple[str | list[int], str | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list | tuple) and not prompt:
        return [], None  # the engine's "the prompt is empty"
    if _is_token_ids(prompt):
        return [int(t) for t in prompt], None
    if not isinstance(prompt, dict):
        raise TypeError(f"each prompt must be {PROMPT_FORMS}; got {type(prompt).__name__}")
    if "multi_modal_data" in prompt:
        raise SamplingParamsError("multi_modal_data", "multi_modal_data is not supported: Ferry serves text models "
                                  "(send the prompt's text or token ids alone)")
    unknown = sorted(set(prompt) - _PROMPT_KEYS)
    if unknown:
        raise SamplingParamsError(unknown[0], f"a prompt dict takes {sorted(_PROMPT_KEYS)}; got {unknown}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise SamplingParamsError("prompt", "a prompt dict needs exactly one of 'prompt' (TextPrompt) and "
                                  "'prompt_token_ids' (TokensPrompt)")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise SamplingParamsError("prompt", "'prompt' must be a string (token ids go in 'prompt_token_ids')")
        text = prompt["prompt"]
    else:
        text = prompt["prompt_token_ids"]
        if not _is_token_ids(text):
            raise SamplingParamsError("prompt_token_ids", "'prompt_token_ids' must be a non-empty list of ints")
        text = [int(t) for t in text]
    return text, prompt.get("cache_salt")
