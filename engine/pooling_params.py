"""Per-request pooling parameters (vLLM's `PoolingParams`): an embedding request instead of a generation one.

A request added with PoolingParams prefills its prompt and finishes, generating nothing; its embedding is the
model's final hidden states (after the final norm, before the LM head) pooled over the prompt. Validated on
construction: a bad value is a `SamplingParamsError` naming the field, which the server turns into a 400.
"""

from dataclasses import dataclass

import numpy as np

from engine.sampling_params import SamplingParamsError

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    pooling_type: str = "last"     # "last": the last prompt token's hidden state; "mean": the mean over the prompt
    normalize: bool = True         # L2-normalize the pooled vector
    dimensions: int | None = None  # OpenAI's matryoshka truncation: not supported, refused when set

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise SamplingParamsError("pooling_type", f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                      f"not {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise SamplingParamsError("normalize", f"normalize must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None:
            raise SamplingParamsError("dimensions", "dimensions is not supported: this model's embeddings have "
                                      "one size (no matryoshka truncation); leave it unset")

    def pool(self, row_sum: np.ndarray, last_row: np.ndarray, num_tokens: int) -> np.ndarray:
        """The embedding (float32) of a prompt of `num_tokens` from its final hidden states' sum and last row
        (what the worker's pooling_step returns per chunk, the sums added up over the prompt's chunks)."""
        pooled = (row_sum / num_tokens if self.pooling_type == "mean" else last_row).astype(np.float32)
        if self.normalize:
            # As torch's F.normalize: a zero vector stays zero rather than becoming NaN.
            pooled = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
        return pooled
