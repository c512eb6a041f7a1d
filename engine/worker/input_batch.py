"""The worker's requests and the decode batch it keeps across steps (vLLM v1's InputBatch, the persistent batch).

`CachedRequestState` is the worker's own copy of a request: built from its NewRequestData, then changed only by
the scheduler's diffs (blocks appended) and by the tokens the worker itself samples for it. `InputBatch` holds a
row per decoding request: its block table, its next inputs (position and token) and what its stop check needs,
changed only by what changed since the last step, so packing a decode step costs O(changes) Python work plus a
few numpy passes, not a rebuild from every request's lists.
"""

import dataclasses

import numpy as np

from engine.core.block_pool import NULL_BLOCK
from engine.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.packing import StepLayout, split_fields
from engine.worker.sampler import needs_full_sampler


@dataclasses.dataclass(slots=True, eq=False)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    params: SamplingParams | None
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    has_grammar: bool
    scores_prompt: bool
    needs_full_sampler: bool  # its params need randomness, penalties or logprobs
    plain_argmax: bool        # every row of it is plain argmax: no full sampler, min_tokens or grammar
    pools: bool = False       # an embedding: its chunks pool (ModelRunner._run_pooling), it never decodes

    @classmethod
    def of(cls, data: NewRequestData) -> "CachedRequestState":
        """The worker's state of a new request; it takes over `data`'s lists (copies made for it by the
        scheduler's NewRequestData.of, read by no one else)."""
        full = data.params is not None and needs_full_sampler(data.params)
        return cls(data.req_id, data.prompt_token_ids, data.output_token_ids, data.block_ids,
                   data.params, data.seed, data.max_tokens, data.min_tokens, data.stop_token_ids, data.has_grammar,
                   data.scores_prompt, full, not (full or data.min_tokens or data.has_grammar), data.pools)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - n):end - n]

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Ids that must not be sampled now: those that would stop it while min_tokens is not reached."""
        return () if len(self.output_token_ids) >= self.min_tokens else self.stop_token_ids

    @property
    def needs_host(self) -> bool:
        """Its sampler needs its last token on the host (a grammar's mask, penalties' history, min_tokens'
        banned ids): no step may run ahead of one it is in."""
        return self.has_grammar or self.min_tokens > 0 or (self.params is not None and self.params.has_penalties)


class InputBatch:
    """The decode batch kept on the host across steps.

    How a row advances (ModelRunner): `pack` a step's decoders; `sampled(tokens)` once its call returned;
    `advance()` once those tokens are their requests' (the worker commits a step's tokens after its last rerun):
    every row that ran then feeds the token it sampled at its position + 1, without reading its request. Until
    `advance()` a row keeps this step's inputs, so a rerun of the step (fault isolation) packs the same buffer.
    A row whose next inputs are not known (new, or one that ran without an advance) reads them from its
    request's state. Under async scheduling a row moves on as soon as its call is dispatched (`dispatched()`):
    its next input token is then `fed`, read on the device from that call's output, until `landed()` brings it
    to the host.

    A row's block table is its request's: copied whole when the row starts, then extended by the scheduler's
    new blocks (`append_blocks`). `sync` releases the rows of requests not in the step's decode batch: call it
    every step, with [] when none decode; `remove` releases a request's row when it leaves."""

    def __init__(self, states: dict[str, CachedRequestState], max_rows: int, width: int, block_size: int,
                 max_model_len: int):
        self.states = states  # the worker's requests, by id (ModelRunner.requests)
        self.block_size, self.max_model_len = block_size, max_model_len
        self.tables = np.full((max_rows, width), NULL_BLOCK, np.int32)  # [max_rows, width] block ids per row
        self.lengths = np.zeros(max_rows, np.int64)       # [max_rows] block ids in each row's table
        self.positions = np.zeros(max_rows, np.int64)     # [max_rows] next input position, where `known`
        self.tokens = np.zeros(max_rows, np.int64)        # [max_rows] next input token, where `known` and not fed
        # [max_rows] where `known`: -1, or the row's index in the last decode call's output, whose token is its next
        # input straight from the device (async scheduling: dispatched, not landed yet)
        self.fed = np.full(max_rows, -1, np.int64)
        self.known = np.zeros(max_rows, bool)             # [max_rows] positions/tokens advanced from the last step
        self.stop_at = np.zeros(max_rows, np.int64)       # [max_rows] num_tokens at which the request ends by length
        self.every_token = np.zeros(max_rows, bool)       # [max_rows] a grammar: the stop check every token
        self.plain = np.zeros(max_rows, bool)             # [max_rows] CachedRequestState.plain_argmax
        self.needs_host = np.zeros(max_rows, bool)        # [max_rows] CachedRequestState.needs_host
        self.generation = np.zeros(max_rows, np.int64)    # [max_rows] bumped when a row is released
        self._row_of: dict[str, int] = {}                               # request id -> row
        self._row_stop_ids: list[tuple[int, ...]] = [()] * max_rows     # row -> its request's stop ids
        self._stop_id_rows: dict[int, int] = {}  # stop id -> rows whose request has it
        self._stop_ids = np.zeros(0, np.int64)   # [n] the keys of _stop_id_rows: any row's token may stop on these
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._last_req_ids: list[str] | None = []  # the last sync's requests, in order, and their rows:
        self._last_rows = np.zeros(0, np.int64)  # i64[n], and as a slice when consecutive (numpy's fast path)
        self._last_index: slice | np.ndarray = slice(0, 0)
        self._packed = (self._last_index, self._last_rows)  # the last pack's (row index, positions)
        self._pending: list[tuple] = []          # (row index, generations, next positions, next tokens) to advance to
        self._counts = np.arange(max_rows + 1, dtype=np.int32)  # 0, 1, ..., max_rows: for the offsets fields
        self.num_row_copies = 0  # rows written whole: a request started (or resumed) decoding

    def __len__(self) -> int:
        return len(self._row_of)

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a step's diffs (tpu-inference's update_states): the requests that left go, state and row; new
        ones come; held ones get their new blocks."""
        states = self.states
        for req_id in scheduler_output.finished_req_ids + scheduler_output.preempted_req_ids:
            states.pop(req_id, None)
            self.remove(req_id)
        for data in scheduler_output.new_requests:
            states[data.req_id] = CachedRequestState.of(data)
        for req_id, ids in scheduler_output.new_block_ids.items():
            states[req_id].block_ids.extend(ids)
        for req_id, fills in scheduler_output.filled_block_ids.items():  # prefilling: no decode row to change
            block_ids = states[req_id].block_ids
            for entry, block_id in fills:
                block_ids[entry] = block_id
        self.append_blocks(scheduler_output.new_block_ids)

    def commit(self, scheduler_output: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """A step ran: its sampled tokens become its requests' (the scheduler appends the same to its own), and
        the decode rows move on (`advance`)."""
        states, sampled = self.states, out.sampled
        for chunk in scheduler_output.prefills:
            if chunk.samples and chunk.req_id in sampled:
                states[chunk.req_id].output_token_ids.append(sampled[chunk.req_id])
        if out.decode_tokens is not None:
            self.append_outputs(scheduler_output.decodes, out.decode_tokens)
        else:
            for req_id in scheduler_output.decodes:
                if req_id in sampled:
                    states[req_id].output_token_ids.append(sampled[req_id])
        self.advance()

    def append_outputs(self, req_ids: list[str], tokens: list[int]) -> None:
        """Each request's sampled token becomes its own, for those still held (under async scheduling a request
        may leave while its last call is in flight)."""
        for state, token in zip(map(self.states.get, req_ids), tokens):  # the whole batch, every step
            if state is not None:
                state.output_token_ids.append(token)

    def append_blocks(self, new_block_ids: dict[str, list[int]]) -> None:
        """Blocks the scheduler appended to requests that hold a row (the others copy their table when they start
        one): their ids after each row's last, in one numpy write when each got one."""
        row_of = self._row_of
        grown = [(row_of[req_id], ids) for req_id, ids in new_block_ids.items() if req_id in row_of]
        if not grown:
            return
        if all(len(ids) == 1 for _, ids in grown):
            rows = np.array([row for row, _ in grown], np.int64)
            lengths = self.lengths[rows]
            self.tables[rows, lengths] = [ids[0] for _, ids in grown]
            self.lengths[rows] = lengths + 1
            return
        for row, ids in grown:
            length = int(self.lengths[row])
            self.tables[row, length:length + len(ids)] = ids
            self.lengths[row] = length + len(ids)

    def remove(self, req_id: str) -> None:
        """The request left (finished, aborted or preempted): its row, if it has one, is free."""
        row = self._row_of.pop(req_id, None)
        if row is not None:
            self._release(row)
            self._free_rows.append(row)
            self._last_req_ids = None  # the next sync assigns its rows anew

    def sync(self, req_ids: list[str]) -> tuple[slice | np.ndarray, np.ndarray, np.ndarray]:
        """Bring the rows up to date with `req_ids` (this step's decoders; any other request's row is released).
        Returns, in order, their rows (a slice when consecutive, else i64[n]), positions (num_tokens - 1) and
        input tokens (the last ones; where `fed`, the device has them): i64[len(req_ids)] each. Python touches
        only rows whose inputs are not known: new ones, and those that ran without an advance."""
        if req_ids != self._last_req_ids:  # the same requests as the last step, in the same order: the same rows
            self._assign_rows(req_ids)
        index = self._last_index
        positions, tokens, known = self.positions[index].copy(), self.tokens[index].copy(), self.known[index]
        if known.all():
            return index, positions, tokens
        states = self.states
        for i in np.flatnonzero(~known).tolist():
            state = states[req_ids[i]]
            positions[i], tokens[i] = state.num_tokens - 1, state.last_token_id
            self.fed[self._last_rows[i]] = -1
        return index, positions, tokens

    def _assign_rows(self, req_ids: list[str]) -> None:
        """Release the rows of requests not in `req_ids`, give a row to each that has none, and remember their
        rows (as a slice when consecutive)."""
        row_of, wanted = self._row_of, set(req_ids)
        for req_id in [r for r in row_of if r not in wanted]:
            row = row_of.pop(req_id)
            self._release(row)
            self._free_rows.append(row)
        for req_id in req_ids:
            if req_id not in row_of:
                row_of[req_id] = row = self._free_rows.pop()
                self._start(row, self.states[req_id])
        self._last_req_ids = list(req_ids)
        self._last_rows = rows = np.array([row_of[r] for r in req_ids], np.int64)
        n = len(rows)
        consecutive = n == 0 or (rows[-1] - rows[0] == n - 1 and (np.diff(rows) == 1).all())
        self._last_index = slice(int(rows[0]), int(rows[0]) + n) if n and consecutive else rows

    def _start(self, row: int, state: CachedRequestState) -> None:
        """A request takes a free row: its block table, and what its stop check and sampler mode need, once."""
        ids = state.block_ids
        self.tables[row, :len(ids)] = ids
        self.lengths[row] = len(ids)
        self.num_row_copies += 1
        self.stop_at[row] = min(len(state.prompt_token_ids) + state.max_tokens, self.max_model_len)
        self.every_token[row] = state.has_grammar
        self.plain[row] = state.plain_argmax
        self.needs_host[row] = state.needs_host
        self._row_stop_ids[row] = ids = tuple(set(state.stop_token_ids))
        counts = self._stop_id_rows
        if any(t not in counts for t in ids):
            self._stop_ids = np.array(sorted(set(counts) | set(ids)), np.int64)
        for t in ids:
            counts[t] = counts.get(t, 0) + 1

    def _release(self, row: int) -> None:
        self.tables[row, :self.lengths[row]] = NULL_BLOCK
        self.lengths[row] = 0
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

    def pack(self, req_ids: list[str], layout: StepLayout) -> np.ndarray:
        """The decode step's buffer for `req_ids` (each feeds its last token at position num_tokens - 1);
        equal to packing.pack() over the same requests. In a prefill layout (a ragged step) they are its first
        sequences, one token row each, and the rest is padding for pack(after=...) to fill."""
        n = len(req_ids)
        index, positions, tokens = self.sync(req_ids)
        self._packed = index, positions
        buf = np.empty(layout.size, np.int32)  # every field is written whole below: no zeroing pass first
        views = split_fields(buf, layout)
        fed = self.fed[index]
        if not layout.decode and (fed >= 0).any():  # a ragged step reads every input token from the host
            raise RuntimeError("a ragged step's decode rows need their last tokens on the host (land the step in "
                               "flight)")
        width, groups = layout.table_width, layout.kv_groups
        tables = views["block_tables"].reshape(layout.num_seqs, width)
        tables[:n] = self.tables[index]  # consecutive rows (the usual case): one block copy
        if n < layout.num_seqs:
            tables[n:] = NULL_BLOCK
        bs, counts = self.block_size, self._counts
        # A flat gather from the packed tables (cheaper than a 2-D fancy index); no int64 `%` (dearer than `//`)
        page = positions // bs
        entries = counts[:n] * width + page * groups
        offsets = positions - page * bs
        slot_mapping = views["slot_mapping"].reshape(groups, -1)
        for g in range(groups):  # a group's slot of each row: its block of the row's page, group-minor
            slot_mapping[g, :n] = tables.reshape(-1)[entries + g] * bs + offsets
            if n < layout.num_tokens:
                slot_mapping[g, n:] = 0
        # Padding rows: token 0 at position 0, writing into the null block's slot 0, attending to nothing.
        for name, values in (("token_ids", tokens), ("token_source", fed), ("positions", positions),
                             ("context_lens", positions + 1), ("logits_indices", counts[:n])):
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
        """Every row of the last pack is plain argmax (CachedRequestState.plain_argmax): the greedy sampler
        serves them."""
        return bool(self.plain[self._packed[0]].all())

    def may_stop(self, tokens: np.ndarray, packed: tuple | None = None) -> np.ndarray:
        """bool[n]: for the last pack's rows (or `packed`, an earlier `packed_rows()`) and the tokens they sampled,
        where the scheduler's stop check may end the request (a stop or EOS id of any row, its length reached, a
        grammar); elsewhere it surely goes on."""
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
        """The tokens given to `sampled` since the last advance are their requests' now: each row that still
        has its request feeds its token next, one position on."""
        for index, generations, positions, tokens in self._pending:
            same = self.generation[index] == generations
            if not same.all():  # some rows changed hands since (fault isolation's partial runs)
                index, positions, tokens = np.arange(len(self.known))[index][same], positions[same], tokens[same]
            self.positions[index], self.tokens[index], self.known[index] = positions, tokens, True
            self.fed[index] = -1
        self._pending.clear()
