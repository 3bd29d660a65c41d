"""The per-request state of the scheduler half and the plans it turns into: which blocks a committed load writes
(:func:`plan_load`), which new full chunks a step saves (:func:`plan_save`), and how many tokens a lookup can
promise (:func:`hit_tokens`). Pure functions of the request's state; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from range_connector.cost.decision import Decision
from range_connector.kv.metadata import ChunkTransfer, RequestTransfer
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.tickets import Ticket


def hit_tokens(num_stored_chunks: int, chunk_tokens: int, num_prompt_tokens: int, block_size: int) -> int:
    """Tokens the connector can promise for a prompt.

    The stored prefix is cut so that at least one prompt token is left to compute (vLLM needs one to produce
    logits), then rounded down to whole engine blocks (loads write whole blocks only).

    Args:
        num_stored_chunks: leading chunks present on every shard.
        chunk_tokens: tokens per chunk.
        num_prompt_tokens: prompt length in tokens.
        block_size: engine block size in tokens.

    Returns:
        A multiple of ``block_size`` in ``[0, num_prompt_tokens - 1]``.
    """
    cap = max(0, num_prompt_tokens - 1)
    return min(num_stored_chunks * chunk_tokens, cap) // block_size * block_size


def lookup_hit(num_found: int, num_full_chunks: int, chunk_tokens: int, num_prompt_tokens: int,
               block_size: int) -> tuple[int, bool, int]:
    """What a lookup that found ``num_found`` entries of a prompt's chain (its ``num_full_chunks`` full chunks, then
    its partial last chunk's tail) can promise.

    Returns:
        ``(stored full chunks, whether the tail is stored, hit tokens)``: :func:`hit_tokens` of the stored chunks,
        or with the tail stored (the whole prompt) all of the prompt but the last token.
    """
    stored = min(num_found, num_full_chunks)
    has_tail = num_found > num_full_chunks
    hit = hit_tokens(stored, chunk_tokens, num_prompt_tokens, block_size)
    return stored, has_tail, max(hit, num_prompt_tokens - 1) if has_tail else hit


@dataclass
class RequestState:
    """What the scheduler half knows of a request vLLM committed to (from ``update_state_after_alloc`` on)."""

    req_id: str
    prompt_token_ids: list[int]
    chunk_hashes: list[ChunkHash]
    tail_hash: ChunkHash | None = None  # the partial last chunk (saved by producers only)
    block_ids: list[int] = field(default_factory=list)
    num_saved_chunks: int = 0  # chunks [0, num_saved_chunks) are stored or scheduled for saving
    tail_saved: bool = False
    num_stored_chunks: int = 0  # full chunks the tier held at lookup (a load of them that timed out left them there)
    skip_saves: bool = False  # the tier could not pay for any hit of this prompt: it was not looked up, nor is saved
    promote_chunks: list[int] = field(default_factory=list)  # loaded from farther tiers, to copy into DRAM


@dataclass
class LookupResult:
    """The latest lookup of a request (``get_num_new_matched_tokens`` may run several times; the last one counts)."""

    chunk_hashes: list[ChunkHash]
    tickets: list[tuple[Ticket, ...]]  # [num_stored_chunks (+1 with the tail)] x [num_shards]
    num_stored_chunks: int  # full chunks
    num_computed_tokens: int
    num_hit_tokens: int
    mode: str = "pipelined"
    tail_hash: ChunkHash | None = None
    has_tail: bool = False
    decision: Decision | None = None
    #: predicted (load_s, recompute_s) of the hit, when the configuration chose its mode (no gate decision)
    predicted_s: tuple[float, float] | None = None
    skip_saves: bool = False  # see RequestState.skip_saves
    #: in a tier hierarchy, ``[(tier type, end token)]``: the hit's runs, tier by tier, in chain order
    runs: list[tuple[str, int]] | None = None


def unread_lookup(tickets: list[tuple[Ticket, ...]] | None, hashes: list[ChunkHash], tail: ChunkHash | None,
                  num_computed_tokens: int, stats: dict[str, Any]) -> LookupResult:
    """The lookup of a request whose answer vLLM does not read: ``skip_reading_prefix_cache`` (prompt logprobs,
    token-level pooling), for which vLLM 0.32 asks the connector and then sets the external tokens to 0
    (``Scheduler.schedule``, ``v1/core/sched/scheduler.py`` L979-984; vllm#57596). Its stored chunks (``tickets``,
    ``None`` while the lookup runs on) only keep its saves from writing them again: nothing is promised, weighed by
    the gate or counted as a hit or as left-out hit tokens; ``stats["lookups_not_read"]`` counts it."""
    stats["lookups_not_read"] = stats.get("lookups_not_read", 0) + 1
    tickets = tickets or []
    return LookupResult(hashes, tickets, min(len(tickets), len(hashes)), num_computed_tokens, num_computed_tokens,
                        "pipelined", tail, has_tail=len(tickets) > len(hashes))


def plan_load(state: RequestState, lookup: LookupResult, block_ids: Sequence[int], num_external_tokens: int, *,
              block_size: int, blocks_per_chunk: int) -> list[ChunkTransfer]:
    """The chunks a committed load writes: tokens ``[num_computed_tokens, + num_external_tokens)`` of the lookup,
    whole blocks (a hit that ends inside a block, a stored tail, loads that whole block; vLLM computes the rest).

    Args:
        block_ids: the request's engine block ids, ``[num_blocks]`` from its first token.
    """
    first_token = lookup.num_computed_tokens
    last_token = first_token + num_external_tokens
    bpc = blocks_per_chunk
    chunks = []
    first_block, end_block = first_token // block_size, -(-last_token // block_size)
    for chunk_idx in range(first_block // bpc, (end_block + bpc - 1) // bpc):
        positions = [p for p in range(bpc) if first_block <= chunk_idx * bpc + p < end_block]
        chunk_hash = state.chunk_hashes[chunk_idx] if chunk_idx < len(state.chunk_hashes) else state.tail_hash
        chunks.append(ChunkTransfer(chunk_idx, chunk_hash, tuple(positions),  # type: ignore[arg-type]
                                    tuple(block_ids[chunk_idx * bpc + p] for p in positions),
                                    lookup.tickets[chunk_idx]))
    return chunks


def computed_block_ids(lookup: LookupResult, block_ids: Sequence[int], num_external_tokens: int, *,
                       block_size: int) -> tuple[int, ...]:
    """The block of a committed load that vLLM writes into as well (``RequestTransfer.computed_block_ids``): the one
    holding the first token it computes, when the load ends inside it (a stored tail); ``()`` when the load ends on a
    block boundary."""
    last_token = lookup.num_computed_tokens + num_external_tokens
    if last_token % block_size == 0 or last_token // block_size >= len(block_ids):
        return ()
    return (block_ids[last_token // block_size],)


def failed_load(req_id: str, lookup: LookupResult | None, block_ids: Sequence[int], num_external_tokens: int, *,
                block_size: int, blocks_per_chunk: int) -> RequestTransfer:
    """A load vLLM asked for that was not promised: every block of it is reported failed, so that vLLM recomputes
    them rather than reading blocks nobody wrote."""
    start = (lookup.num_computed_tokens if lookup else 0) // block_size
    end = (start * block_size + num_external_tokens + block_size - 1) // block_size
    ids = tuple(block_ids[start:end])
    chunk = ChunkTransfer(start // blocks_per_chunk, ChunkHash(b""), tuple(range(len(ids))), ids)
    return RequestTransfer(req_id, (chunk,), num_external_tokens, fail=True)


def plan_save(state: RequestState, num_computed_tokens: int, *, chunk_tokens: int, block_size: int,
              blocks_per_chunk: int, save_tail: bool, already_stored: Any = ()) -> RequestTransfer | None:
    """The new full chunks of the request whose tokens are computed by the end of the step (and, for a pure
    producer, ``save_tail``, the partial last chunk once the whole prompt is computed); ``None`` if nothing is new.
    Updates ``state`` (``num_saved_chunks``, ``tail_saved``).

    Args:
        already_stored: chunk hashes not to save again (the DRAM tier's index).
    """
    if state.skip_saves:
        return None
    bpc = blocks_per_chunk
    num_full = min(num_computed_tokens, len(state.prompt_token_ids)) // chunk_tokens
    num_full = min(num_full, len(state.chunk_hashes), len(state.block_ids) // bpc)
    chunks = [
        ChunkTransfer(c, state.chunk_hashes[c], tuple(range(bpc)), tuple(state.block_ids[c * bpc:(c + 1) * bpc]))
        for c in range(state.num_saved_chunks, num_full)
        if state.chunk_hashes[c] not in already_stored
    ]
    state.num_saved_chunks = max(state.num_saved_chunks, num_full)
    num_tokens = len(chunks) * chunk_tokens
    num_prompt = len(state.prompt_token_ids)
    if (save_tail and state.tail_hash is not None and not state.tail_saved and num_computed_tokens >= num_prompt
            and state.num_saved_chunks == len(state.chunk_hashes)):
        # The partial last chunk, as a whole chunk whose slots past the prompt are never loaded (padded with
        # its last block, so every stripe keeps one geometry).
        first = len(state.chunk_hashes) * bpc
        ids = state.block_ids[first:-(-num_prompt // block_size)]
        if ids:
            ids = ids + [ids[-1]] * (bpc - len(ids))
            chunks.append(ChunkTransfer(len(state.chunk_hashes), state.tail_hash, tuple(range(bpc)), tuple(ids)))
            num_tokens += num_prompt - first * block_size
            state.tail_saved = True
    if not chunks:
        return None
    return RequestTransfer(state.req_id, tuple(chunks), num_tokens)


def scheduled_progress(requests: dict[str, RequestState], schedule: Any) -> list[tuple[RequestState, int]]:
    """Follow vLLM's step schedule: update each known request's block ids (new, running, resumed) and return
    ``(state, tokens computed by the end of the step)`` for each (``schedule``: vLLM's ``SchedulerOutput``, read
    as :class:`~range_connector.scheduler.engine_view.StepSchedule`)."""
    progress: list[tuple[RequestState, int]] = []
    for new in schedule.scheduled_new_reqs:
        state = requests.get(new.req_id)
        if state is None:
            continue
        state.block_ids = list(new.block_ids[0])
        progress.append((state, new.num_computed_tokens + schedule.num_scheduled_tokens[new.req_id]))
    cached = schedule.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        state = requests.get(req_id)
        if state is None:
            continue
        new_ids = cached.new_block_ids[i]
        if req_id in cached.resumed_req_ids:
            state.block_ids = list(new_ids[0]) if new_ids else []
        elif new_ids:
            state.block_ids.extend(new_ids[0])
        progress.append((state, cached.num_computed_tokens[i] + schedule.num_scheduled_tokens[req_id]))
    return progress


def redo_from(state: RequestState, chunk_idx: int, dropped: set[ChunkHash]) -> None:
    """A load of the request failed from ``chunk_idx`` on: chunks computed in that step on top of it were not
    saved, and chunks found gone or corrupt (``dropped``) were forgotten, so both are saved again once recomputed.
    Chunks whose load only ran out of time are still stored and are not written twice."""
    redo = max(chunk_idx, state.num_stored_chunks)
    redo = min([redo] + [i for i in range(chunk_idx, len(state.chunk_hashes)) if state.chunk_hashes[i] in dropped])
    state.num_saved_chunks = min(state.num_saved_chunks, redo)
    if state.tail_hash in dropped:
        state.tail_saved = False
