"""One host-side packing of all int32 step metadata, and its unpacking inside the jitted step.

The host writes token ids, positions, slot mapping, block tables, context lengths, query start
offsets and logits indices into ONE numpy int32 buffer (one host-to-device transfer per step).
Its shape is fixed by a `StepLayout` of bucketed sizes, so each layout compiles once.
"""

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
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
        # token_source (decode steps only): -1, or where in the device-side tokens of the last decode call
        # this row's input token is (async scheduling feeds a token the host has not fetched yet)
        fed = (("token_source", t),) if self.decode else ()
        return (("token_ids", t), *fed, ("positions", t), ("slot_mapping", t), ("block_tables", s * self.width),
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


def pack(seqs: Sequence[SeqSlice], layout: StepLayout, block_size: int, all_logits: bool = False,
         after: tuple[np.ndarray, int] | None = None) -> np.ndarray:
    """Fill one int32 buffer from scratch. Logits: the last row of each sequence, or every token row if
    `all_logits`. Decode steps use DecodeRows.pack instead, which gives the same buffer in O(changes).
    `after` (buf, n): a ragged step's buffer whose first n sequences are decode rows of one token each, the
    rest padding (DecodeRows.pack in this layout); `seqs` follow them in it."""
    if after is not None and all_logits:
        raise ValueError("a ragged step's decode rows have one logits row each: not all_logits")
    buf, first = (np.zeros(layout.size, np.int32), 0) if after is None else after
    views = _split(buf, layout)
    tables = views["block_tables"].reshape(layout.num_seqs, layout.width)
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
        views["slot_mapping"][row:row + n] = blocks[positions // block_size] * block_size + positions % block_size
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


class DecodeRows:
    """The decode batch kept on the host across steps (vLLM v1's persistent batch): a row per decoding
    request holding its block table, its next inputs (position and token) and what its stop check needs,
    changed only by what changed since the last step, so packing a decode step costs O(changes) Python
    work plus a few numpy passes, not a rebuild from every request's lists.

    How a row advances (ModelRunner): `pack` a step's decoders; `sampled(tokens)` once its call returned;
    `advance()` once the scheduler has appended those tokens to the requests: every row that ran then feeds
    the token it sampled at its position + 1, without reading its request. Until `advance()` a row keeps
    this step's inputs, so a rerun of the step (fault isolation) packs the same buffer. A row whose next
    inputs are not known (new, or one that ran without an advance) reads them from its request.
    Under async scheduling a row moves on as soon as its call is dispatched (`dispatched()`): its next input
    token is then `fed`, read on the device from that call's output, until `landed()` brings it to the host.

    A row mirrors one `Request.block_ids` list object, which is append-only while the request runs; the
    KV cache manager replaces the list (never edits it in place) when a request loses blocks (recompute,
    swap), and such a request leaves the decode batch first. So every `sync` releases the rows of requests
    not in it: call it every step, with [] when none decode. The row holds its request and that list, so
    neither id can be reused while mirrored."""

    def __init__(self, max_rows: int, width: int, block_size: int, max_model_len: int):
        self.block_size, self.max_model_len = block_size, max_model_len
        self.tables = np.full((max_rows, width), NULL_BLOCK, np.int32)  # [max_rows, width] block ids per row
        self.lengths = np.zeros(max_rows, np.int64)       # [max_rows] block ids copied into each row
        self.positions = np.zeros(max_rows, np.int64)     # [max_rows] next input position, where `known`
        self.tokens = np.zeros(max_rows, np.int64)        # [max_rows] next input token, where `known` and not fed
        # [max_rows] where `known`: -1, or the row's index in the last decode call's output, whose token is its next
        # input straight from the device (async scheduling: dispatched, not landed yet)
        self.fed = np.full(max_rows, -1, np.int64)
        self.known = np.zeros(max_rows, bool)             # [max_rows] positions/tokens advanced from the last step
        self.stop_at = np.zeros(max_rows, np.int64)       # [max_rows] num_tokens at which the request ends by length
        self.every_token = np.zeros(max_rows, bool)       # [max_rows] a grammar: Request.check_stop every token
        self.plain = np.zeros(max_rows, bool)             # [max_rows] Request.plain_argmax when the row started
        # [max_rows] the sampler needs the row's last token on the host (a grammar's mask, penalties' history,
        # min_tokens' banned ids): no async scheduling past it
        self.needs_host = np.zeros(max_rows, bool)
        self.generation = np.zeros(max_rows, np.int64)    # [max_rows] bumped when a row is released
        self._row_of: dict = {}                                         # request -> row
        self._mirrored: list[list[int] | None] = [None] * max_rows      # row -> the block_ids list it mirrors
        self._row_stop_ids: list[tuple[int, ...]] = [()] * max_rows     # row -> its request's stop and EOS ids
        self._stop_id_rows: dict[int, int] = {}  # stop or EOS id -> rows whose request has it
        self._stop_ids = np.zeros(0, np.int64)   # [n] the keys of _stop_id_rows: any row's token may stop on these
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._last_requests: list = []           # the last sync's requests, in order, and their rows:
        self._last_rows = np.zeros(0, np.int64)  # i64[n], and as a slice when consecutive (numpy's fast path)
        self._last_index: slice | np.ndarray = slice(0, 0)
        self._packed = (self._last_index, self._last_rows)  # the last pack's (row index, positions)
        self._pending: list[tuple] = []          # (row index, generations, next positions, next tokens) to advance to
        self._counts = np.arange(max_rows + 1, dtype=np.int32)  # 0, 1, ..., max_rows: for the offsets fields
        self.num_row_copies = 0  # rows (re)written whole: a request started or resumed decoding

    def __len__(self) -> int:
        return len(self._row_of)

    def sync(self, requests) -> tuple[slice | np.ndarray, np.ndarray, np.ndarray]:
        """Bring the rows up to date with `requests` (this step's decoders; any other request's row is
        released). Returns, in order, their rows (a slice when consecutive, else i64[n]), positions
        (num_tokens - 1) and input tokens (the last ones; where `fed`, the device has them): i64[len(requests)]
        each. Python touches only rows that changed: new ones, and those whose position starts a block not yet
        copied."""
        # The same requests as the last step, in the same order (a C-level identity compare): the same rows.
        if requests != self._last_requests:
            self._assign_rows(requests)
        index = self._last_index
        positions, tokens, known = self.positions[index].copy(), self.tokens[index].copy(), self.known[index]
        changed = positions // self.block_size >= self.lengths[index]  # a new block at this position
        changed |= ~known
        if not changed.any():
            return index, positions, tokens
        changed = np.flatnonzero(changed)
        grown = changed[known[changed]]
        if len(grown):  # known rows: each got exactly one block since (DecodeRows keeps lengths == len(ids))
            self._append_blocks(self._last_rows[grown], [requests[i].block_ids for i in grown.tolist()])
        for i in changed[~known[changed]].tolist():
            request = requests[i]
            positions[i], tokens[i] = request.num_tokens - 1, request.last_token_id
            self._copy_blocks(int(self._last_rows[i]), request.block_ids)
            self.fed[self._last_rows[i]] = -1
        return index, positions, tokens

    def _assign_rows(self, requests) -> None:
        """Release the rows of requests not in `requests`, give a row to each that has none, and remember
        their rows (as a slice when consecutive)."""
        row_of, wanted = self._row_of, set(requests)
        for request in [r for r in row_of if r not in wanted]:
            row = row_of.pop(request)
            self._release(row)
            self._free_rows.append(row)
        for request in requests:
            if request not in row_of:
                row_of[request] = row = self._free_rows.pop()
                self._start(row, request)
        self._last_requests = list(requests)
        self._last_rows = rows = np.array([row_of[r] for r in requests], np.int64)
        n = len(rows)
        consecutive = n == 0 or (rows[-1] - rows[0] == n - 1 and (np.diff(rows) == 1).all())
        self._last_index = slice(int(rows[0]), int(rows[0]) + n) if n and consecutive else rows

    def _start(self, row: int, request) -> None:
        """A request takes a free row: what its stop check and sampler mode need, once."""
        self.stop_at[row] = min(len(request.prompt_token_ids) + request.max_tokens, self.max_model_len)
        self.every_token[row] = request.grammar is not None
        self.plain[row] = request.plain_argmax is True
        params = request.params
        self.needs_host[row] = (request.grammar is not None or request.min_tokens > 0
                                or (params is not None and params.has_penalties))
        self._row_stop_ids[row] = ids = tuple(set(request.stop_token_ids + request.eos_token_ids))
        counts = self._stop_id_rows
        if any(t not in counts for t in ids):
            self._stop_ids = np.array(sorted(set(counts) | set(ids)), np.int64)
        for t in ids:
            counts[t] = counts.get(t, 0) + 1

    def _release(self, row: int) -> None:
        self.tables[row, :self.lengths[row]] = NULL_BLOCK
        self.lengths[row] = 0
        self._mirrored[row] = None
        self.known[row] = False
        self.fed[row] = -1
        self.generation[row] += 1
        counts = self._stop_id_rows
        for t in self._row_stop_ids[row]:
            counts[t] -= 1
            if not counts[t]:
                del counts[t]
                self._stop_ids = np.array(sorted(counts), np.int64)
        self._row_stop_ids[row] = ()

    def _copy_blocks(self, row: int, ids: list[int]) -> None:
        """Copy the block ids the row lacks (all of them when it mirrors another list)."""
        copied = int(self.lengths[row])
        if self._mirrored[row] is not ids:
            self.tables[row, :copied] = NULL_BLOCK
            self._mirrored[row], copied = ids, 0
            self.num_row_copies += 1
        self.tables[row, copied:len(ids)] = ids[copied:]
        self.lengths[row] = len(ids)

    def _append_blocks(self, rows: np.ndarray, lists: list[list[int]]) -> None:
        """Rows mirroring these lists, each now one block longer: their last ids, in one numpy write."""
        lengths = self.lengths[rows]
        if any(self._mirrored[row] is not ids or len(ids) != length + 1
               for row, ids, length in zip(rows.tolist(), lists, lengths.tolist())):
            for row, ids in zip(rows.tolist(), lists):  # not the protocol's case: row by row
                self._copy_blocks(row, ids)
            return
        self.tables[rows, lengths] = [ids[-1] for ids in lists]
        self.lengths[rows] = lengths + 1

    def pack(self, requests, layout: StepLayout) -> np.ndarray:
        """The decode step's buffer for `requests` (each feeds its last token at position num_tokens - 1);
        equal to pack() over the same requests. In a prefill layout (a ragged step) they are its first
        sequences, one token row each, and the rest is padding for pack(after=...) to fill."""
        n = len(requests)
        index, positions, tokens = self.sync(requests)
        self._packed = index, positions
        buf = np.empty(layout.size, np.int32)  # every field is written whole below: no zeroing pass first
        views = _split(buf, layout)
        fed = self.fed[index]
        if not layout.decode and (fed >= 0).any():  # a ragged step reads every input token from the host
            raise RuntimeError("a ragged step's decode rows need their last tokens on the host (land the step in flight)")
        tables = views["block_tables"].reshape(layout.num_seqs, layout.width)
        tables[:n] = self.tables[index]  # consecutive rows (the usual case): one block copy
        if n < layout.num_seqs:
            tables[n:] = NULL_BLOCK
        bs, counts = self.block_size, self._counts
        # A flat gather from the packed tables (cheaper than a 2-D fancy index); no int64 `%` (3x a `//`)
        page = positions // bs
        slots = tables.reshape(-1)[counts[:n] * layout.width + page] * bs + (positions - page * bs)
        # Padding rows: token 0 at position 0, writing into the null block's slot 0, attending to nothing.
        for name, values in (("token_ids", tokens), ("token_source", fed), ("positions", positions),
                             ("context_lens", positions + 1), ("slot_mapping", slots), ("logits_indices", counts[:n])):
            view = views.get(name)  # token_source: decode layouts only
            if view is None:
                continue
            view[:n] = values
            if n < len(view):  # padding (a full batch has none: no empty numpy writes on the hot path)
                view[n:] = -1 if name == "token_source" else 0
        views["query_start_loc"][:n + 1] = counts[:n + 1]
        if n < layout.num_seqs:
            views["query_start_loc"][n + 1:] = n
        return buf

    def packed_positions(self) -> np.ndarray:
        """i64[n]: the last pack's positions (num_tokens - 1 of each request)."""
        return self._packed[1]

    def all_plain(self) -> bool:
        """Every row of the last pack is plain argmax (Request.plain_argmax): the greedy sampler serves them."""
        return bool(self.plain[self._packed[0]].all())

    def may_stop(self, tokens: np.ndarray, packed: tuple | None = None) -> np.ndarray:
        """bool[n]: for the last pack's rows (or `packed`, an earlier `packed_rows()`) and the tokens they sampled,
        where Request.check_stop may end the request (a stop or EOS id of any row, its length reached, a grammar);
        elsewhere it surely returns None."""
        index, positions = packed or self._packed
        stop = self.every_token[index] | (positions + 2 >= self.stop_at[index])  # num_tokens after the append
        if len(self._stop_ids) > 4:
            stop |= np.isin(tokens, self._stop_ids)
        else:
            for stop_id in self._stop_ids.tolist():  # a comparison each is cheaper than np.isin for a few
                stop |= tokens == stop_id
        return stop

    def can_run_ahead(self) -> bool:
        """No row of the last pack needs its last token on the host (needs_host): async scheduling may go on."""
        return not self.needs_host[self._packed[0]].any()

    def packed_rows(self) -> tuple:
        """The last pack's (row index, positions), for `may_stop` and `landed` once later packs were made."""
        return self._packed

    def dispatched(self) -> np.ndarray:
        """Async scheduling: the last pack's call is on its way and its tokens stay on the device for now; each
        row moves on at once, one position on, its next input being its own output of that call (`fed`).
        Returns the rows' generations, for `landed`."""
        index, positions = self._packed
        self.positions[index], self.known[index] = positions + 1, True
        self.fed[index] = self._counts[:len(positions)]
        return self.generation[index].copy()

    def landed(self, packed: tuple, generations: np.ndarray, tokens: np.ndarray) -> None:
        """The tokens of a dispatched pack reached the host: rows still fed by that call (not dispatched again
        since, same request) read them from here on, so a later call need not keep the device's copy."""
        index, positions = packed
        rows = np.arange(len(self.known))[index]
        still = (self.generation[rows] == generations) & (self.positions[rows] == positions + 1) & (self.fed[rows] >= 0)
        rows = rows[still]
        self.tokens[rows], self.fed[rows] = tokens[still], -1

    def sampled(self, tokens: np.ndarray) -> None:
        """The last pack's rows sampled `tokens` ([n]): their next inputs, for `advance`."""
        index, positions = self._packed
        self._pending.append((index, self.generation[index].copy(), positions + 1, tokens))

    def advance(self) -> None:
        """The tokens given to `sampled` since the last advance were appended to their requests: each row
        that still has its request feeds its token next, one position on."""
        for index, generations, positions, tokens in self._pending:
            same = self.generation[index] == generations
            if not same.all():  # some rows changed hands since (fault isolation's partial runs)
                index, positions, tokens = np.arange(len(self.known))[index][same], positions[same], tokens[same]
            self.positions[index], self.tokens[index], self.known[index] = positions, tokens, True
            self.fed[index] = -1
        self._pending.clear()


def unpack(buf, layout: StepLayout, fed=None):
    """Inside jit: the flat buffer -> (token_ids, positions, AttentionMetadata, logits_indices). With `fed`
    (a decode step's i32 tokens of the last decode call, sample_step), rows whose token_source is >= 0 take
    their input token from it."""
    parts = _split(buf, layout)
    token_ids = parts["token_ids"]
    if fed is not None:
        source = parts["token_source"]
        token_ids = jnp.where(source >= 0, fed[jnp.maximum(source, 0)], token_ids)
    md = AttentionMetadata(
        slot_mapping=parts["slot_mapping"],
        block_tables=parts["block_tables"].reshape(layout.num_seqs, layout.width),
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
