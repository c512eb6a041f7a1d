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


def _split(buf, layout: StepLayout) -> dict:
    """The buffer's named fields, as views (numpy on the host, traced slices inside jit)."""
    parts, offset = {}, 0
    for name, n in layout.sizes():
        parts[name] = buf[offset:offset + n]
        offset += n
    return parts


def pack(seqs: Sequence[SeqSlice], layout: StepLayout, block_size: int, all_logits: bool = False) -> np.ndarray:
    """Fill one int32 buffer from scratch. Logits: the last row of each sequence, or every token row if
    `all_logits`. Decode steps use DecodeRows.pack instead, which gives the same buffer in O(changes)."""
    buf = np.zeros(layout.size, np.int32)
    views = _split(buf, layout)
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


class DecodeRows:
    """The decode batch's block tables, kept on the host across steps (vLLM v1's persistent batch): a row
    per decoding request, changed only by what changed since the last step (a new block, a request in or
    out), so packing a decode step costs O(batch) small Python work plus one numpy gather of the used rows,
    not a rebuild of batch x context block ids from lists.

    A row mirrors one `Request.block_ids` list object, which is append-only while the request runs; the
    KV cache manager replaces the list (never edits it in place) when a request loses blocks (recompute,
    swap), so a different list object means "copy the row again". The row holds that list, so its id
    cannot be reused while mirrored."""

    def __init__(self, max_rows: int, width: int, block_size: int):
        self.block_size = block_size
        self.tables = np.full((max_rows, width), NULL_BLOCK, np.int32)  # [max_rows, width] block ids per row
        self._lengths = [0] * max_rows                                  # row -> block ids copied into it
        self._row_of: dict[str, int] = {}                               # request id -> row
        self._mirrored: list[list[int] | None] = [None] * max_rows      # row -> the block_ids list it mirrors
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.num_row_copies = 0  # rows (re)written whole: a request started or resumed decoding

    def __len__(self) -> int:
        return len(self._row_of)

    def sync(self, requests) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bring the rows up to date with `requests` (this step's decoders; any other request's row is
        released). Returns, in order, their rows, positions (num_tokens - 1) and input tokens (the last ones):
        i64[len(requests)] each. Several comprehensions, not one loop with appends and branches: together
        half its cost at batch 512."""
        row_of = self._row_of
        rows = [row_of.get(r.request_id) for r in requests]
        if None in rows or len(row_of) > len(rows):  # a request started (or resumed) decoding, or one left
            self._assign_rows(requests)
            rows = [row_of[r.request_id] for r in requests]
        mirrored, lengths = self._mirrored, self._lengths
        for row, ids in [(row, r.block_ids) for row, r in zip(rows, requests)
                         if mirrored[row] is not r.block_ids or len(r.block_ids) != lengths[row]]:
            copied = lengths[row]
            if mirrored[row] is not ids:
                self._release(row)
                mirrored[row], copied = ids, 0
                self.num_row_copies += 1
            self.tables[row, copied:len(ids)] = ids[copied:]
            lengths[row] = len(ids)
        positions = np.array([r.num_tokens for r in requests], np.int64) - 1
        tokens = [r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1] for r in requests]
        return np.array(rows, np.int64), positions, np.array(tokens, np.int64)

    def _assign_rows(self, requests) -> None:
        """Release the rows of requests not in `requests`, then give a row to each that has none."""
        wanted = {r.request_id for r in requests}
        for rid in [rid for rid in self._row_of if rid not in wanted]:
            row = self._row_of.pop(rid)
            self._release(row)
            self._free_rows.append(row)
        for r in requests:
            if r.request_id not in self._row_of:
                self._row_of[r.request_id] = self._free_rows.pop()

    def _release(self, row: int) -> None:
        self.tables[row, :self._lengths[row]] = NULL_BLOCK
        self._lengths[row] = 0
        self._mirrored[row] = None

    def pack(self, requests, layout: StepLayout) -> np.ndarray:
        """The decode step's buffer for `requests` (each feeds its last token at position num_tokens - 1);
        equal to pack() over the same requests."""
        n = len(requests)
        rows, positions, tokens = self.sync(requests)
        buf = np.empty(layout.size, np.int32)  # every field is written whole below: no zeroing pass first
        views = _split(buf, layout)
        tables = views["block_tables"].reshape(layout.num_seqs, layout.width)
        if n and rows[-1] - rows[0] == n - 1 and (n == 1 or (np.diff(rows) == 1).all()):
            tables[:n] = self.tables[rows[0]:rows[0] + n]  # consecutive rows (the usual case): one block copy
        else:
            np.take(self.tables, rows, axis=0, out=tables[:n])
        tables[n:] = NULL_BLOCK
        bs = self.block_size
        # Padding rows: token 0 at position 0, writing into the null block's slot 0, attending to nothing.
        for name, values in (("token_ids", tokens), ("positions", positions), ("context_lens", positions + 1),
                             ("slot_mapping", self.tables[rows, positions // bs] * bs + positions % bs),
                             ("logits_indices", np.arange(n))):
            views[name][:n] = values
            views[name][n:] = 0
        views["query_start_loc"][:n + 1] = np.arange(n + 1)
        views["query_start_loc"][n + 1:] = n
        return buf


def unpack(buf, layout: StepLayout):
    """Inside jit: the flat buffer -> (token_ids, positions, AttentionMetadata, logits_indices)."""
    parts = _split(buf, layout)
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
