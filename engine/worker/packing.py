"""One host-side packing of all int32 step metadata, and its unpacking inside the jitted step.

The host writes token ids, positions, slot mapping, block tables, context lengths, query start
offsets and logits indices into ONE numpy int32 buffer (one host-to-device transfer per step).
Its shape is fixed by a `StepLayout` of bucketed sizes, so each layout compiles once.
"""

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from engine.core.block_pool import NULL_BLOCK
from models.paged import AttentionMetadata


@dataclasses.dataclass(frozen=True, slots=True)
class StepLayout:
    """Static shape of a step: hashable, so it can be a jit static argument."""

    num_tokens: int   # flat token rows (== num_seqs for decode)
    num_seqs: int     # sequence rows
    width: int        # block-table width (pages per sequence)
    num_logits: int   # rows we compute logits for
    decode: bool
    kv_groups: int = 1  # KV cache groups (models/paged.KVCacheGroups): a slot mapping and a table entry per block each

    @property
    def table_width(self) -> int:
        """Block-table entries per sequence: `width` logical blocks, a block id of each group for each."""
        return self.width * self.kv_groups

    def sizes(self) -> tuple[tuple[str, int], ...]:
        t, s, g = self.num_tokens, self.num_seqs, self.kv_groups
        # token_source (decode steps only): -1, or where in the device-side tokens of the last decode call
        # this row's input token is (async scheduling feeds a token the host has not fetched yet)
        fed = (("token_source", t),) if self.decode else ()
        return (("token_ids", t), *fed, ("positions", t), ("slot_mapping", g * t),
                ("block_tables", s * self.table_width),
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


def split_fields(buf, layout: StepLayout) -> dict:
    """The buffer's named fields, as flat views (numpy on the host, traced slices inside jit)."""
    parts, offset = {}, 0
    for name, n in layout.sizes():
        parts[name] = buf[offset:offset + n]
        offset += n
    return parts


def pack(seqs: Sequence[SeqSlice], layout: StepLayout, block_size: int, all_logits: bool = False,
         after: tuple[np.ndarray, int] | None = None) -> np.ndarray:
    """Fill one int32 buffer from scratch. Logits: the last row of each sequence, or every token row if
    `all_logits`. Decode steps use InputBatch.pack instead, which gives the same buffer in O(changes).
    `after` (buf, n): a ragged step's buffer whose first n sequences are decode rows of one token each, the
    rest padding (InputBatch.pack in this layout); `seqs` follow them in it."""
    if after is not None and all_logits:
        raise ValueError("a ragged step's decode rows have one logits row each: not all_logits")
    buf, first = (np.zeros(layout.size, np.int32), 0) if after is None else after
    views = split_fields(buf, layout)
    tables = views["block_tables"].reshape(layout.num_seqs, layout.table_width)
    slot_mapping, groups = views["slot_mapping"].reshape(layout.kv_groups, -1), layout.kv_groups
    if after is None:
        tables[:] = NULL_BLOCK
    # Padding tokens write into the null block (slot NULL_BLOCK * block_size == 0), so nothing real changes.
    row = first
    qsl = views["query_start_loc"]
    for i, s in enumerate(seqs, first):
        n = len(s.token_ids)
        end_pos = s.start + n
        positions = np.arange(s.start, end_pos, dtype=np.int32)
        blocks = np.asarray(s.block_ids, np.int32)
        views["token_ids"][row:row + n] = s.token_ids
        views["positions"][row:row + n] = positions
        pages, offsets = positions // block_size * groups, positions % block_size
        for g in range(groups):
            slot_mapping[g, row:row + n] = blocks[pages + g] * block_size + offsets
        tables[i, :len(blocks)] = blocks
        views["context_lens"][i] = end_pos
        qsl[i] = row
        row += n
        if not all_logits:
            views["logits_indices"][i] = row - 1
    qsl[first + len(seqs):] = row
    if all_logits:
        views["logits_indices"][:row] = np.arange(row)
    if layout.decode:
        views["token_source"][:] = -1
    return buf


def unpack(buf, layout: StepLayout, fed=None):
    """Inside jit: the flat buffer -> (token_ids, positions, AttentionMetadata, logits_indices). With `fed`
    (a decode step's i32 tokens of the last decode call, sample_step), rows whose token_source is >= 0 take
    their input token from it."""
    parts = split_fields(buf, layout)
    token_ids = parts["token_ids"]
    if fed is not None:
        source = parts["token_source"]
        token_ids = jnp.where(source >= 0, fed[jnp.maximum(source, 0)], token_ids)
    md = AttentionMetadata(
        slot_mapping=parts["slot_mapping"].reshape(layout.kv_groups, layout.num_tokens),
        block_tables=parts["block_tables"].reshape(layout.num_seqs, layout.table_width),
        context_lens=parts["context_lens"],
        query_start_loc=parts["query_start_loc"],
        decode=layout.decode,
    )
    return token_ids, parts["positions"], md, parts["logits_indices"]


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """Smallest power of two >= n (and >= minimum), capped at maximum."""
    if maximum is not None and n > maximum:
        raise ValueError(f"{n} exceeds the largest bucket {maximum}")
    size = max(minimum, 1 << max(0, int(n) - 1).bit_length())
    return min(size, maximum) if maximum is not None else size
