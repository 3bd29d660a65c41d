"""How many tokens of a prompt an engine would find stored, and on which tier, asked without an engine.

The answer comes from the scheduler's own code: the chain is the one :meth:`OfflineSpec.chain` computes (the
scheduler's hashing), the lookup is :func:`~range_connector.scheduler.tiers.make_lookup`'s (per tier the minimum
over shards and ticket groups of each one's stored prefix; across tiers runs nearest first), and the hit is
:func:`~range_connector.scheduler.planning.lookup_hit` (whole engine blocks, one prompt token left to compute, a
stored tail counts). It is the hit before the cost gate: with ``load_mode`` ``"auto"`` the engine's gate may take
less (it weighs the hit with what it measured), and vLLM's own prefix cache may already hold part of it (the engine
then reports only the rest as external). The DRAM tier lives inside the engine and counts as holding nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from range_connector.backends.tiered import leaf_backends
from range_connector.errors import BackendError
from range_connector.ops.offline_spec import OfflineSpec, open_offline_lookup_backends
from range_connector.scheduler.planning import lookup_hit
from range_connector.scheduler.tiers import TieredLookup, entry_tier, make_lookup

__all__ = ["LookupAnswer", "TierHit", "lookup_prompt"]


@dataclass(frozen=True, slots=True)
class TierHit:
    """One tier's part of a prompt's hit.

    Attributes:
        tier_idx: the tier's place in ``tiers``.
        tier_type: ``"memory"``, ``"valkey"`` or ``"file"``.
        served_tokens: tokens of the hit loaded from this tier (the nearest tier holding each chunk).
        stored_tokens: the hit this tier alone could serve (its own stored prefix, from the first token).
        visible: ``False`` for the DRAM tier (it lives inside the engine: counted as holding nothing).
    """

    tier_idx: int
    tier_type: str
    served_tokens: int
    stored_tokens: int
    visible: bool = True


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    """A prompt's stored prefix, as the engine's scheduler would find it.

    Attributes:
        namespace_hex: the namespace the chain was hashed in.
        num_prompt_tokens: prompt length, tokens.
        chunk_tokens: tokens per chunk.
        block_size: the scheduler's block, tokens.
        hit_tokens: tokens the connector would promise (before the cost gate), a multiple of ``block_size`` or all
            of the prompt but its last token (a stored tail).
        num_stored_chunks: leading full chunks stored.
        tail_stored: the prompt's partial last chunk is stored too (saved by a ``kv_producer``).
        tiers: ``[num_tiers]`` per-tier parts.
        load_mode: the config's ``load_mode`` (``"auto"``: the engine's gate may take less).
    """

    namespace_hex: str
    num_prompt_tokens: int
    chunk_tokens: int
    block_size: int
    hit_tokens: int
    num_stored_chunks: int
    tail_stored: bool
    tiers: tuple[TierHit, ...]
    load_mode: str

    def as_dict(self) -> dict:
        """JSON-safe fields (``tiers`` as a list of dicts)."""
        return asdict(self)


def lookup_prompt(spec: OfflineSpec, token_ids: Sequence[int], *, cache_salt: str | None = None,
                  lora_name: str | None = None) -> LookupAnswer:
    """Ask every tier of ``spec.config``, nearest first, for the prompt's stored prefix (see the module docstring).

    Args:
        spec: from :func:`~range_connector.ops.offline_spec.offline_namespace`.
        token_ids: ``[num_prompt_tokens]`` the prompt's token ids, as the engine receives them.
        cache_salt: the request's ``cache_salt``, if any.
        lora_name: the request's adapter, if any.

    Returns:
        The answer.

    Raises:
        ConfigError: a tier cannot be opened (no embedded servers recorded, a server that does not answer or
            refuses the credentials: names the key).
        BackendError: a tier fails during the lookup (the scheduler would count that as a miss; here it is an
            error, with the backend's message).
    """
    config = spec.config
    backends = open_offline_lookup_backends(config)
    stats: dict[str, int] = defaultdict(int)
    lookup = make_lookup(config, spec.plan, backends, num_layers=spec.num_layers,
                         layer_block_bytes=spec.group.page_size_bytes, stats=stats, groups=spec.ranks.groups)
    try:
        for backend in leaf_backends(backends or ()):
            backend.ping()  # (the lookup turns a failure into a miss; an operator wants the reason)
        hashes, tail = spec.chain(token_ids, cache_salt=cache_salt, lora_name=lora_name)
        n = len(token_ids)

        def hit_of(entries: list) -> tuple[int, bool, int]:
            return lookup_hit(len(entries), len(hashes), spec.chunk_tokens, n, spec.block_size)

        entries = lookup.stored_prefix(hashes, tail)
        per_tier = lookup.tiers if isinstance(lookup, TieredLookup) else [lookup]
        alone = [hit_of(sub.stored_prefix(hashes, tail))[2] for sub in per_tier]
        if stats["lookup_errors"]:
            raise BackendError(f"the lookup of {n} tokens failed on a tier that answered a ping just before")
    finally:
        lookup.close()
    stored, has_tail, hit = hit_of(entries)
    served = [0] * len(config.tiers)
    for c, entry in enumerate(entries):  # (each chunk's tokens inside the hit, to the tier it is loaded from)
        served[entry_tier(entry)] += max(0, min((c + 1) * spec.chunk_tokens, hit) - c * spec.chunk_tokens)
    tiers = tuple(TierHit(i, t.type, served[i], alone[i], visible=t.type != "memory")
                  for i, t in enumerate(config.tiers))
    return LookupAnswer(spec.namespace_hex, n, spec.chunk_tokens, spec.block_size, hit, stored, has_tail, tiers,
                        config.load_mode)
