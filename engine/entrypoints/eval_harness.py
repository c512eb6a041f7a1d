"""lm-evaluation-harness on the offline engine: `--model ferry` batches every request of a task through one `LLM`.

    python -m engine.entrypoints.eval_harness --model ferry --model_args pretrained=smollm2,max_model_len=2048 \\
        --tasks hellaswag,gsm8k          # any lm_eval command line; `ferry-lm-eval` is the same

lm-eval discovers no model plugins, so this module registers `ferry` and then runs lm-eval's own command line.
`model_args`: `pretrained` (anything `LLM` loads: a directory, a .gguf file, `smollm2`, a cached Hugging Face
repo id), any EngineConfig field, and `max_gen_toks`, `seed`, `add_bos_token`. lm-eval's batch_size and device
are accepted and ignored: continuous batching takes every request at once. The served engine needs none of
this: lm-eval's `local-completions` (echo + logprobs) and `local-chat-completions` call `ferry-serve` directly.
"""

import dataclasses

from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
IGNORED_ARGS = frozenset({"batch_size", "max_batch_size", "device", "trust_remote_code"})


@register_model("ferry")
class FerryLM(TemplateLM):
    """lm-eval's model interface over one `LLM`: log-likelihoods from prompt logprobs (as lm-eval's vLLM
    model), generations greedy unless a task asks to sample. Tokenizes as lm-eval's `hf` model does."""

    def __init__(self, pretrained: str = "smollm2", max_gen_toks: int = 256, seed: int = 1234,
                 add_bos_token: bool | None = None, **kwargs):
        super().__init__()
        unknown = sorted(set(kwargs) - ENGINE_FIELDS - IGNORED_ARGS)
        if unknown:
            raise ValueError(f"ferry model_args: unknown {unknown}; it takes pretrained, max_gen_toks, seed, "
                             f"add_bos_token and the EngineConfig fields {sorted(ENGINE_FIELDS)}")
        self.llm = LLM(pretrained, EngineConfig(**{k: v for k, v in kwargs.items() if k in ENGINE_FIELDS}))
        self.tokenizer = self.llm.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"{pretrained}: lm-eval needs a model with a tokenizer")
        self.pretrained, self._max_gen_toks, self.seed = pretrained, max_gen_toks, seed
        self.add_bos_token = add_bos_token

    # -------------------------------------------------------------- what TemplateLM asks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # As lm-eval's hf model: a rolling window or an empty context starts from BOS where there is one.
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.llm.engine.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As lm-eval's hf model: the tokenizer's own special tokens (its BOS) unless told otherwise, or the
        text already starts with BOS (a chat template wrote it)."""
        if add_special_tokens is None:
            bos = self.tokenizer.bos_token
            add_special_tokens = (self.add_bos_token if self.add_bos_token is not None
                                  else not (bos and string.startswith(bos)))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    # -------------------------------------------------------------- scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether the continuation is the greedy one) for each
        (cache key, context ids, continuation ids); contexts cut from the left to fit, as lm-eval's vLLM model.
        The engine must generate one token, so a scored sequence has at most max_model_len - 1 tokens."""
        keep = self.max_length - 1
        inputs, ctxlens = [], []
        for _, context, continuation in requests:
            tokens = (context + continuation)[-keep:]
            inputs.append(tokens)
            ctxlens.append(len(tokens) - len(continuation))
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, seed=self.seed)
        outputs = self.llm.generate(inputs, params, use_tqdm=not disable_tqdm)
        results = []
        for (key, _, _), tokens, ctxlen, output in zip(requests, inputs, ctxlens, outputs):
            scored = list(zip(tokens[ctxlen:], output.prompt_logprobs[ctxlen:]))
            answer = (sum(entry[token] for token, entry in scored),
                      all(max(entry, key=entry.get) == token for token, entry in scored))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Perplexity tasks: each text in disjoint windows of at most max_model_len - 1 tokens, all windows of
        all texts in one batch."""
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 1, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -------------------------------------------------------------- generation

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = [stop for stop in handle_stop_sequences(kwargs.pop("until", None), eos) if stop]
            max_tokens = min(int(kwargs.pop("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
            if not kwargs.pop("do_sample", False):
                kwargs.setdefault("temperature", 0.0)
            tokens = self.tok_encode(context)[-(self.max_length - max_tokens):]
            prompts.append(tokens)
            params.append(SamplingParams(max_tokens=max_tokens, stop=until, seed=self.seed, **kwargs))
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = [output.outputs[0].text for output in outputs]
        for request, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts


def main():
    """`ferry-lm-eval`: lm-eval's command line, with `--model ferry` registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
