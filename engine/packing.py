"""One host-side packing of all int32 step metadata, and its unpacking inside the jitted step.

The host writes token ids, positions, slot mapping, block tables, context lengths, query start
offsets and logits indices into ONE numpy int32 buffer (one host-to-device transfer per step).
Its shape is fixed by a `StepLayout` of bucketed sizes, so each layout compiles once.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from models.paged import NULL_BLOCK, AttentionMetadata


@dataclasses.dataclass(frozen=True, slots=True)
class StepLayout:
    """Static shape of a step: hashable, so it can be a jit static argument."""

    num_tokens: int   # flat token rows (== num_seqs for decode)
    num_seqs: int     # sequence rows
    width: int        # block-table width (pages per sequence)
    num_logits: int   # rows we compute logits for
    decode: bool

    def sizes(self) -> tuple[tuple[str, int], ...]:
        t, s = self.num_tokens, self.num_seqs
        return (("token_ids", t), ("positions", t), ("slot_mapping", t), ("block_tables", s * self.width),
                ("context_lens", s), ("query_start_loc", s + 1), ("logits_indices", self.num_logits))

    @property
    def size(self) -> int:
        return sum(n for _, n in self.sizes())


@dataclasses.dataclass(slots=True)
class SeqSlice:
    """One sequence's part of a step: the tokens it feeds, from position `start`, through its pages."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]


def pack(seqs: Sequence[SeqSlice], layout: StepLayout, block_size: int, all_logits: bool = False) -> np.ndarray:
    """Fill one int32 buffer. Logits: the last row of each sequence, or every token row if `all_logits`."""
    buf = np.zeros(layout.size, np.int32)
    views, offset = {}, 0
    for name, n in layout.sizes():
        views[name] = buf[offset:offset + n]
        offset += n
    tables = views["block_tables"].reshape(layout.num_seqs, layout.width)
    tables[:] = NULL_BLOCK
    # Padding tokens write into the null block (slot NULL_BLOCK * block_size == 0), so nothing real changes.
    row = 0
    qsl = views["query_start_loc"]
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        end_pos = s.start + n
        positions = np.arange(s.start, end_pos, dtype=np.int32)
        blocks = np.asarray(s.block_ids, np.int32)
        views["token_ids"][row:row + n] = s.token_ids
        views["positions"][row:row + n] = positions
        views["slot_mapping"][row:row + n] = blocks[positions // block_size] * block_size + positions % block_size
        tables[i, :len(blocks)] = blocks
        views["context_lens"][i] = end_pos
        qsl[i] = row
        row += n
        if not all_logits:
            views["logits_indices"][i] = row - 1
    qsl[len(seqs):] = row
    if all_logits:
        views["logits_indices"][:row] = np.arange(row)
    return buf


def unpack(buf, layout: StepLayout):
    """Inside jit: the flat buffer -> (token_ids, positions, AttentionMetadata, logits_indices)."""
    parts, offset = {}, 0
    for name, n in layout.sizes():
        parts[name] = buf[offset:offset + n]
        offset += n
    md = AttentionMetadata(
        slot_mapping=parts["slot_mapping"],
        block_tables=parts["block_tables"].reshape(layout.num_seqs, layout.width),
        context_lens=parts["context_lens"],
        query_start_loc=parts["query_start_loc"],
        decode=layout.decode,
    )
    return parts["token_ids"], parts["positions"], md, parts["logits_indices"]


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """Smallest power of two >= n (and >= minimum), capped at maximum."""
    if maximum is not None and n > maximum:
        raise ValueError(f"{n} exceeds the largest bucket {maximum}")
    size = max(minimum, 1 << max(0, int(n) - 1).bit_length())
    return min(size, maximum) if maximum is not None else size
