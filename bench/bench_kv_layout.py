"""The bench GQA model's KV layout, and the payload a restore is checked against.

32 layers, 8 KV heads, head size 128, bf16 (K and V: 4 KiB per token per layer), block size 32. :class:`KV`
allocates KV-cache tensors the way vLLM allocates them on CPU (one shared buffer, layer-major); :class:`Payload`
fills a source :class:`KV` with random bytes, picks shuffled block ids for the payload and keeps its expected image,
so that a restore into any destination blocks can be compared byte for byte. Imports only torch. Used by
``bench/granularity.py`` and ``bench/partition.py``.
"""

from __future__ import annotations

import torch

NUM_LAYERS = 32
NUM_KV_HEADS = 8
HEAD_SIZE = 128
KV_DTYPE = torch.bfloat16
BYTES_PER_TOKEN_PER_LAYER = NUM_KV_HEADS * 2 * HEAD_SIZE * 2  # K and V, bf16: 4 KiB
BLOCK_SIZE = 32


# ---------------------------------------------------------------------------------------------------- KV tensors
class KV:
    """KV-cache tensors as vLLM allocates them on CPU: one shared buffer, layer-major, per-layer views
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (bf16)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.layer_bytes = num_blocks * BLOCK_SIZE * BYTES_PER_TOKEN_PER_LAYER
        self.buf = torch.zeros(NUM_LAYERS * self.layer_bytes, dtype=torch.uint8)
        self.layer_names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))
        self.layers = {
            name: self.buf[i * self.layer_bytes:(i + 1) * self.layer_bytes].view(KV_DTYPE)
            .view(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
            for i, name in enumerate(self.layer_names)
        }
        words = BLOCK_SIZE * BYTES_PER_TOKEN_PER_LAYER // 8
        #: int64 row views ``[num_blocks, words]`` per layer (for the resident copy and verification).
        self.rows = [t.view(torch.int64).view(num_blocks, words) for t in self.layers.values()]


class Payload:
    """Source KV (payload at shuffled block ids, random bytes) and the expected image of its blocks."""

    def __init__(self, num_blocks: int, payload_blocks: int, seed: int) -> None:
        self.kv = KV(num_blocks)
        g = torch.Generator().manual_seed(seed)
        self.kv.buf.view(torch.int64).random_(generator=g)
        self.src_ids = torch.randperm(num_blocks, generator=g)[:payload_blocks]
        #: ``[layers, payload blocks, words]``: the payload's bytes in block order (resident source, expectation).
        self.image = torch.stack([r.index_select(0, self.src_ids) for r in self.kv.rows])

    def equal_at(self, dst: KV, dst_ids: torch.Tensor, lo: int = 0, hi: int | None = None) -> bool:
        """Payload blocks ``[lo, hi)`` (default all) are at ``dst_ids[lo:hi]`` of ``dst``, byte for byte."""
        hi = len(dst_ids) if hi is None else hi
        return all(torch.equal(d.index_select(0, dst_ids[lo:hi]), self.image[i][lo:hi]) for i, d in enumerate(dst.rows))
