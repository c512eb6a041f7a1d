"""Structured outputs: grammars (JSON schema, regex, choice, Lark) compiled by llguidance into per-sample
matchers whose allowed-token bitmasks go into the sampler's `SamplingMetadata.allowed`.

    compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab_size)   # once per engine (cheap for small vocabs)
    grammar = compiler.compile(params.structured_outputs)               # once per distinct grammar (LRU cache)
    matcher = grammar.matcher()                                         # one per sample
    mask = matcher.allowed_mask()   # u32[ceil(V / 32)], before each sampled token
    matcher.advance(output_token_ids) -> None | "stop" (grammar complete) | "error"

The mask uses the sampler's layout (bit t % 32 of word t // 32), which is llguidance's, so llguidance writes
it in place. A matcher follows the request's output tokens by count, so a recompute-preempted request (whose
outputs are re-prefilled, not resampled) never feeds it a token twice.
"""

import collections
import dataclasses
import json
import threading

import llguidance
import numpy as np

from engine.sampling_params import SamplingParamsError, StructuredOutputsParams
from engine.worker.sampler import mask_words
from models.tokenizers.tokenizer import HFTokenizer, Tokenizer

# Compact JSON as json.dumps writes it: no free whitespace, which a sampled model could otherwise fill forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_CACHE_SIZE = 128


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for a spec (not yet checked: `GrammarCompiler.compile` does that)."""
    if spec.json is not None:
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise SamplingParamsError("structured_outputs", f"the JSON schema is not valid JSON: {e}") from None
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # JSON string literals are Lark string literals.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


@dataclasses.dataclass(slots=True)
class GrammarMatcher:
    """One sample's position in its grammar."""

    matcher: llguidance.LLMatcher
    num_words: int                # mask words: ceil(model vocab / 32)
    num_consumed: int = 0         # output tokens fed to the matcher so far

    def allowed_mask(self) -> np.ndarray:
        """u32[num_words]: the tokens the grammar allows next (EOS only where the grammar may end)."""
        mask = np.zeros(self.num_words, np.uint32)
        self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return mask

    def advance(self, output_token_ids: list[int]) -> str | None:
        """Feed the outputs not yet consumed; "stop" once the grammar is complete, "error" if it rejected one."""
        for token in output_token_ids[self.num_consumed:]:
            self.matcher.consume_token(token)
        self.num_consumed = len(output_token_ids)
        if self.matcher.is_error():
            return "error"
        return "stop" if self.matcher.is_stopped() else None

    @property
    def error(self) -> str:
        return self.matcher.get_error()


@dataclasses.dataclass(slots=True)
class CompiledGrammar:
    template: llguidance.LLMatcher  # never advanced: each sample's matcher is a copy
    num_words: int

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.template.deep_copy(), self.num_words)


@dataclasses.dataclass(slots=True)
class GrammarCompiler:
    """Compiles specs for one tokenizer, caching the compiled grammars (LRU by grammar text). Thread-safe:
    the server compiles on worker threads while the engine thread asks for the same grammars."""

    tokenizer: llguidance.LLTokenizer
    vocab_size: int               # the model's (>= the tokenizer's: padded rows are never allowed)
    capacity: int = GRAMMAR_CACHE_SIZE
    _cache: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int,
                      eos_token_ids: tuple[int, ...]) -> "GrammarCompiler":
        eos = list(eos_token_ids or tokenizer.eos_token_ids)
        if not eos:
            raise SamplingParamsError("structured_outputs",
                                      "structured outputs need an EOS token, and this model has none")
        if not isinstance(tokenizer, HFTokenizer):
            # A sentencepiece vocabulary handed to llguidance piece by piece (TokenizerWrapper) gave masks
            # that allowed tokens the grammar then rejected (its byte pieces duplicate other pieces' bytes).
            raise SamplingParamsError("structured_outputs", "structured outputs need a tokenizer.json (Hugging "
                                      f"Face tokenizers) tokenizer; this model's is {type(tokenizer).__name__}")
        return cls(llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos), vocab_size)

    def compile(self, spec: StructuredOutputsParams, field: str = "structured_outputs") -> CompiledGrammar:
        """The compiled grammar of `spec`; a grammar llguidance rejects raises SamplingParamsError(field)."""
        try:
            text = grammar_text(spec)
        except SamplingParamsError as e:
            raise SamplingParamsError(field, str(e)) from None
        with self._lock:
            if text in self._cache:
                self._cache.move_to_end(text)
                return self._cache[text]
        # Outside the lock: a large grammar compiles for a while (llguidance drops the GIL meanwhile).
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise SamplingParamsError(field, f"{field}: the {spec.kind} grammar is invalid: {template.get_error()}")
        compiled = CompiledGrammar(template, mask_words(self.vocab_size))
        with self._lock:
            self._cache[text] = compiled
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled
