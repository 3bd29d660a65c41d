"""Save and load KV through the real worker half (``RangeWorker``) without an engine, and without vLLM.

The worker-side data path (tickets, stripes, banks, direct receive, backends, the copier) needs only torch: this
module drives it the way vLLM's model runner would (``register_kv_caches``, ``save``, ``start_load``,
``wait_for_layer`` per layer, ``take_failed_block_ids``), with hand-built metadata in place of the scheduler's
(the tickets a load reads are those the save reported in ``build_worker_meta``). Used by
``tests/unit/test_data_path_without_vllm.py`` (in a process where importing vLLM raises), ``tests/gpu`` and
``bench/gpu_sweep.py``. Imports only torch and ``range_connector`` (never vLLM); no I/O of its own.

KV layouts (``layout``), per layer, with ``H`` KV heads, block size ``N`` and head size ``C``:

* ``"cpu"``: ``[num_blocks, H, N, 2 * C]``, vLLM's CPU attention layout (K and V packed in one plane);
* ``"flash"``: ``[2, num_blocks, N, H, C]``, FlashAttention's (``FlashAttentionBackend.get_kv_cache_shape``):
  K and V planes;
* ``"lbnhc"``: vLLM 0.32's view of every layer, ``[num_blocks, H, N, 2 * C]`` (K and V side by side per token and
  head), laid out token-major in memory (``KVCacheLayout.LBNHC``, FlashAttention's default there): the view is not
  contiguous, each block is a dense ``[N, H, 2 * C]`` page.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from range_connector.backends.base import Backend
from range_connector.config import RangeConfig, TierConfig
from range_connector.kv.metadata import ChunkTransfer, RangeConnectorMetadata, RequestTransfer
from range_connector.kv.namespace import ChunkHash, prefix_hash_chain
from range_connector.kv.tickets import Ticket
from range_connector.worker.device import CopyDevice
from range_connector.worker.facade import RangeWorker

LAYOUTS = ("cpu", "flash", "lbnhc")


@dataclass(frozen=True, slots=True)
class KVShape:
    """The geometry of the KV tensors of a round trip.

    Attributes:
        num_layers: attention layers.
        num_blocks: blocks per layer tensor.
        block_size: tokens per block (``N``).
        num_kv_heads: KV heads per layer (``H``).
        head_size: elements per head (``C``).
        dtype: element type.
        layout: ``"cpu"`` or ``"flash"`` (module docstring).
    """

    num_layers: int = 4
    num_blocks: int = 64
    block_size: int = 16
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    layout: str = "cpu"

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * torch.empty(0, dtype=self.dtype).itemsize

    def tensor_shape(self) -> tuple[int, ...]:
        """The shape of one layer's tensor (raises ``ValueError`` for an unknown layout)."""
        n, h, c = self.block_size, self.num_kv_heads, self.head_size
        if self.layout in ("cpu", "lbnhc"):
            return (self.num_blocks, h, n, 2 * c)
        if self.layout == "flash":
            return (2, self.num_blocks, n, h, c)
        raise ValueError(f"unknown KV layout {self.layout!r} (one of {LAYOUTS})")

    def allocate(self, device: str | torch.device = "cpu", *, seed: int | None = None) -> dict[str, torch.Tensor]:
        """Per-layer KV tensors in one layer-major buffer, as vLLM allocates them: zeros, or random bytes with
        ``seed``."""
        shape = self.tensor_shape()
        per_layer = 1
        for d in shape:
            per_layer *= d
        buf = torch.zeros(self.num_layers * per_layer, dtype=self.dtype, device=device)
        if seed is not None:
            g = torch.Generator(device="cpu").manual_seed(seed)
            words = buf.view(torch.int16)
            words.copy_(torch.randint(-(1 << 15), 1 << 15, words.shape, generator=g, dtype=torch.int16))
        if self.layout == "lbnhc":  # (token-major pages in memory, viewed [num_blocks, H, N, 2C] as vLLM 0.32 does)
            b, h, n, c2 = shape
            return {name: buf[i * per_layer:(i + 1) * per_layer].view(b, n, h, c2).permute(0, 2, 1, 3)
                    for i, name in enumerate(self.layer_names)}
        return {name: buf[i * per_layer:(i + 1) * per_layer].view(shape) for i, name in enumerate(self.layer_names)}


def block_view(kv: torch.Tensor, layout: str, block_ids: Sequence[int]) -> torch.Tensor:
    """The given blocks of one layer's tensor (a copy, as int16 words: random bf16 bits include NaNs, which compare
    unequal to themselves), for byte comparisons: ``[len(block_ids), ...]`` per plane."""
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
    return kv.view(torch.int16).index_select(1 if layout == "flash" else 0, idx)


def config(tier_type: str = "memory", *, chunk_tokens: int = 32, block_size: int = 16, num_banks: int = 2,
           bank_bytes: int = 1 << 16, directory: str | None = None) -> RangeConfig:
    """A resolved one-shard config for a round trip (``bank_bytes`` small, so that a load has several groups)."""
    tier = TierConfig(tier_type, directory=directory) if tier_type == "file" else TierConfig(tier_type)
    return RangeConfig(tiers=(tier,), chunk_tokens=chunk_tokens, num_banks=num_banks,
                       bank_bytes=bank_bytes).resolve(block_size)


def save(worker: RangeWorker, hashes: Sequence[ChunkHash], block_ids: Sequence[int], num_tokens: int,
         req_id: str = "save") -> dict[ChunkHash, tuple[Ticket, ...]]:
    """Save the chunks ``hashes`` from ``block_ids`` (``blocks_per_chunk`` consecutive ids per chunk), and wait for
    the writes (with ``save_mode`` ``"async"`` they end on the worker's saver thread), at most the tier's
    ``timeout_s``.

    Returns:
        ``chunk hash -> [num_shards]`` tickets of the chunks saved (a chunk whose write failed is absent).
    """
    bpc = worker.plan.blocks_per_chunk
    chunks = tuple(ChunkTransfer(i, h, tuple(range(bpc)), tuple(block_ids[i * bpc:(i + 1) * bpc]))
                   for i, h in enumerate(hashes))
    worker.save(RangeConnectorMetadata(saves=[RequestTransfer(req_id, chunks, num_tokens)]))
    worker.wait_for_saves(worker.config.tier.timeout_s)  # (save_mode "async": written on the saver thread)
    meta = worker.build_worker_meta()
    return {} if meta is None else {h: tickets for h, _group, tickets in meta.saved}


def load_meta(hashes: Sequence[ChunkHash], tickets: dict[ChunkHash, tuple[Ticket, ...]], block_ids: Sequence[int],
              blocks_per_chunk: int, num_tokens: int, *, mode: str = "pipelined",
              req_id: str = "load") -> RangeConnectorMetadata:
    """The scheduler's metadata for one request that loads ``hashes`` into ``block_ids``."""
    bpc = blocks_per_chunk
    chunks = tuple(ChunkTransfer(i, h, tuple(range(bpc)), tuple(block_ids[i * bpc:(i + 1) * bpc]), tickets[h])
                   for i, h in enumerate(hashes))
    return RangeConnectorMetadata(loads=[RequestTransfer(req_id, chunks, num_tokens, mode=mode)])


@dataclass
class RoundTrip:
    """A saver and a loader over the same backends, with source and destination KV tensors.

    Attributes:
        shape: the KV geometry.
        saver: the worker that saved ``src`` (closed by :meth:`close`).
        loader: the worker that loads into ``dst``.
        src / dst: ``layer_name -> tensor`` in ``shape.layout``.
        hashes: the chunks saved, in chain order.
        tickets: their tickets.
        src_ids: ``[num_chunks * blocks_per_chunk]`` block ids the chunks were saved from.
        num_tokens: tokens covered by the chunks.
    """

    shape: KVShape
    saver: RangeWorker
    loader: RangeWorker
    src: dict[str, torch.Tensor]
    dst: dict[str, torch.Tensor]
    hashes: list[ChunkHash]
    tickets: dict[ChunkHash, tuple[Ticket, ...]]
    src_ids: list[int]
    num_tokens: int

    @classmethod
    def build(cls, cfg: RangeConfig, shape: KVShape, save_backends: list[Backend], load_backends: list[Backend], *,
              num_chunks: int, device: str | torch.device = "cpu", loader_device: CopyDevice | None = None,
              seed: int = 0, compat_device_reads: bool = False) -> RoundTrip:
        """Save ``num_chunks`` chunks of random KV (from shuffled blocks) through ``save_backends``; register a
        loader over ``load_backends`` (``loader_device``: its device seam, default the tensors' own;
        ``compat_device_reads``: see ``RangeWorker.register_kv_caches``).

        Raises:
            RuntimeError: a chunk was not saved, or the KV pool is too small for ``num_chunks``.
        """
        rng = random.Random(seed)
        bpc = cfg.chunk_tokens // shape.block_size
        if num_chunks * bpc > shape.num_blocks:
            raise RuntimeError(f"{num_chunks} chunks of {bpc} blocks do not fit in {shape.num_blocks} blocks")
        src = shape.allocate(device, seed=seed)
        saver = RangeWorker(cfg, shape.block_size, shape.layer_names, shape.num_blocks, save_backends)
        saver.register_kv_caches(src)
        num_tokens = num_chunks * cfg.chunk_tokens
        tokens = [rng.randrange(100_000) for _ in range(num_tokens)]
        hashes = prefix_hash_chain(b"range-roundtrip", b"", tokens, cfg.chunk_tokens)
        src_ids = rng.sample(range(shape.num_blocks), num_chunks * bpc)
        tickets = save(saver, hashes, src_ids, num_tokens)
        if len(tickets) != len(hashes):
            raise RuntimeError(f"saved {len(tickets)} of {len(hashes)} chunks: {dict(saver.stats)}")
        dst = shape.allocate(device)
        loader = RangeWorker(cfg, shape.block_size, shape.layer_names, shape.num_blocks, load_backends)
        loader.register_kv_caches(dst, device=loader_device, compat_device_reads=compat_device_reads)
        return cls(shape, saver, loader, src, dst, list(hashes), tickets, src_ids, num_tokens)

    def load_meta(self, dst_ids: Sequence[int], *, mode: str = "pipelined", req_id: str = "load"
                  ) -> RangeConnectorMetadata:
        """Metadata that loads every saved chunk into ``dst_ids``."""
        return load_meta(self.hashes, self.tickets, dst_ids, self.loader.plan.blocks_per_chunk, self.num_tokens,
                         mode=mode, req_id=req_id)

    def pick_dst_ids(self, seed: int = 1) -> list[int]:
        """Shuffled destination blocks for every saved block."""
        return random.Random(seed).sample(range(self.shape.num_blocks), len(self.src_ids))

    def load(self, dst_ids: Sequence[int], *, mode: str = "pipelined") -> set[int]:
        """Load every chunk into ``dst_ids`` as vLLM's runner does: ``start_load``, then (pipelined) one
        ``wait_for_layer`` per layer in model order. Returns the block ids reported failed."""
        self.loader.start_load(self.load_meta(dst_ids, mode=mode))
        if mode == "pipelined":
            for name in self.shape.layer_names:
                self.loader.wait_for_layer(name)
        return self.loader.take_failed_block_ids()

    def matches(self, dst_ids: Sequence[int]) -> bool:
        """Every saved block is at its destination, byte for byte, in every layer."""
        layout = self.shape.layout
        return all(torch.equal(block_view(self.dst[n], layout, dst_ids), block_view(self.src[n], layout, self.src_ids))
                   for n in self.shape.layer_names)

    def close(self) -> None:
        """Close both workers (and so their backends)."""
        self.saver.close()
        self.loader.close()
