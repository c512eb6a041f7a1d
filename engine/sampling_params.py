"""Per-request sampling parameters with vLLM / OpenAI semantics, validated on construction.

Every validation failure is a `SamplingParamsError` that names the offending field, so the server
can turn it into an OpenAI-style 400 with `param` set.
"""

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

MAX_LOGPROBS = 20          # the most top logprobs a request may ask for (per token)
MAX_SEED = 2**63           # seeds are in [0, MAX_SEED)
PENALTY_LIMIT = 2.0        # presence / frequency penalties are in [-PENALTY_LIMIT, PENALTY_LIMIT]
GREEDY_TEMPERATURE = 1e-5  # below this a row is greedy (as vLLM's _SAMPLING_EPS; avoids logits / ~0)
INT32_MAX = 2**31 - 1      # integer fields travel to the device as int32; larger values are rejected
MAX_STOP_TOKEN_IDS = 256   # each is checked on every sampled token
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class SamplingParamsError(ValueError):
    """A bad sampling parameter; `.field` is its name (the OpenAI error's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrained decoding (vLLM's `structured_outputs`): exactly one of the fields. The grammar is compiled
    (and rejected, naming `structured_outputs`) by the engine, which knows the tokenizer (engine/structured.py)."""

    json: dict | str | None = None     # a JSON schema (an object, or its JSON text)
    json_object: bool = False          # any JSON object
    regex: str | None = None           # the whole output fully matches it (Rust regex syntax)
    choice: tuple[str, ...] | None = None  # the output is one of these strings
    grammar: str | None = None         # a Lark grammar (llguidance's dialect)

    def __post_init__(self):
        if self.choice is not None and isinstance(self.choice, list | tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        _require(len(given) == 1, "structured_outputs",
                 f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}; got {given or 'none'}")
        _require(isinstance(self.json_object, bool), "structured_outputs",
                 "structured_outputs.json_object must be a boolean")
        _require(self.json is None or isinstance(self.json, dict | str), "structured_outputs",
                 "structured_outputs.json must be a JSON schema (an object or its JSON text)")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            _require(value is None or (isinstance(value, str) and value), "structured_outputs",
                     f"structured_outputs.{kind} must be a non-empty string")
        _require(self.choice is None or (isinstance(self.choice, tuple) and self.choice
                                         and all(isinstance(c, str) and c for c in self.choice)),
                 "structured_outputs", "structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False))


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0             # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 (or -1, normalised to 0) = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)          # a single str is accepted
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16          # None = up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None          # top logprobs per generated token; 0 = the chosen token's only
    prompt_logprobs: int | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # a dict of its fields is accepted

    def __post_init__(self):
        self._normalise()
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lengths()
        self._validate_logprobs()
        self._validate_stops()
        self._validate_flags()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def _normalise(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - set(STRUCTURED_KINDS))
            _require(not unknown, "structured_outputs", f"structured_outputs has unknown fields {unknown}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs", "structured_outputs must be a StructuredOutputsParams or a dict of its fields")

    def _validate_sampling(self):
        _require(_is_int(self.n) and self.n >= 1, "n", f"n must be an integer in [1, 2**31), got {self.n!r}")
        _require(_is_real(self.temperature) and self.temperature >= 0, "temperature",
                 f"temperature must be >= 0, got {self.temperature!r}")
        _require(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p",
                 f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k",
                 f"top_k must be -1 or 0 (disabled) or an integer in [1, 2**31), got {self.top_k!r}")
        _require(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p",
                 f"min_p must be in [0, 1], got {self.min_p!r}")
        _require(self.seed is None or (_is_int(self.seed, MAX_SEED - 1) and 0 <= self.seed), "seed",
                 f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")

    def _validate_penalties(self):
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_real(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT, name,
                     f"{name} must be in [-2, 2], got {value!r}")
        _require(_is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    def _validate_lengths(self):
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
                 f"max_tokens must be None or an integer in [1, 2**31), got {self.max_tokens!r}")
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
                 f"min_tokens must be an integer in [0, 2**31), got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

    def _validate_logprobs(self):
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                     f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    def _validate_stops(self):
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 f"stop strings must be non-empty strings, got {self.stop[:8]!r}")
        _require(all(is_valid_unicode(s) for s in self.stop), "stop",
                 "stop strings must be valid Unicode (no lone surrogates)")
        _require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                 f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 f"stop_token_ids must be integers in [0, 2**31), got {self.stop_token_ids[:8]!r}")

    def _validate_flags(self):
        _require(_is_int(self.priority), "priority", f"priority must be an int32 integer, got {self.priority!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _require(isinstance(getattr(self, name), bool), name,
                     f"{name} must be a boolean, got {getattr(self, name)!r}")


def _is_int(value, maximum: int = INT32_MAX) -> bool:
    # bool is an Integral, but `top_k=True` is a client bug, not a 1. Values past int32 would overflow
    # on their way to the device (inside a step, where they would fail everyone's requests).
    return isinstance(value, Integral) and not isinstance(value, bool) and -maximum - 1 <= value <= maximum


def is_valid_unicode(text: str) -> bool:
    """False for strings no tokenizer can encode: lone surrogates ("\ud800") that JSON can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_real(value) -> bool:
    # NaN and inf pass naive range checks (inf >= 0) and then poison the logits.
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _require(ok: bool, field: str, message: str):
    if not ok:
        raise SamplingParamsError(field, message)
