"""LLM: offline batch generation over an engine (vLLM's `LLM`): every prompt through continuous batching,
outputs in input order."""

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.data_parallel import make_engine
from engine.outputs import RequestOutput
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
        """`prompts`: a string, a list of token ids, or a list of either. One SamplingParams for all, or one each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(None, prompt, p, final_only=True))
        except Exception:
            for rid in ids:  # all or nothing: a bad prompt leaves no half-queued batch behind
                engine.abort(rid)
            raise
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
