"""The registered KV tensors, seen as rows of bytes: one row per (layer, plane, block).

vLLM hands the worker one tensor per attention layer. Whatever the platform's inner packing (CPU dense attention
tiles K and V by instruction set; MLA rows are ``[latent 512 | rope 64]``), a whole block of one layer is a fixed
number of bytes that can be copied as-is between machines of the same packing (the packing is in the namespace).
Shapes handled:

* ``[num_blocks, ...]`` contiguous per block (CPU dense ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
  MLA ``[num_blocks, (1,) block_size, 576]``): one plane.
* ``[2, num_blocks, ...]`` (K and V planes, as on CUDA flash-attention layouts): two planes.
* ``[num_blocks, heads, block_size, C]`` views whose blocks are dense pages in another axis order (vLLM 0.32's
  ``KVCacheLayout`` ``LBNHC``: token-major pages in memory): one plane, each row the page as it lies in memory (the
  layout is in the namespace, ``compat.kv_packing``).

Rows are viewed as ``int64`` when the row size allows: scattering int64 rows measured ~5x faster than uint8 rows
on the 2-core development machine (512 MiB as 4,096 scattered 128 KiB blocks: 0.072 s against 0.39 s).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from range_connector.errors import ConfigError


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Byte layout of the registered KV cache.

    Attributes:
        layer_names: attention layers in model order.
        num_blocks: engine blocks per layer tensor.
        num_planes: planes per layer (1, or 2 for separate K and V planes).
        row_bytes: bytes of one (layer, plane, block) row.
        row_dtype: element type of the row views (``torch.int64`` or ``torch.uint8``).
        num_heads: KV heads in a row (this rank's).
        head_runs: how a row splits by head: ``[head_runs, num_heads, row_bytes / (head_runs * num_heads)]``
            (1 where heads are outermost, as on CPU dense attention; the block size for ``[2, num_blocks,
            block_size, heads, head_size]``; 0 when the shape does not tell, and rows cannot be split by head).
    """

    layer_names: tuple[str, ...]
    num_blocks: int
    num_planes: int
    row_bytes: int
    row_dtype: torch.dtype
    num_heads: int = 1
    head_runs: int = 1

    @property
    def num_row_groups(self) -> int:
        """``num_layers * num_planes``: rows per block."""
        return len(self.layer_names) * self.num_planes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers and planes."""
        return self.num_row_groups * self.row_bytes

    @property
    def row_elems(self) -> int:
        """Elements of ``row_dtype`` per row."""
        return self.row_bytes // torch.empty((), dtype=self.row_dtype).element_size()


def _memory_order(tensor: torch.Tensor, num_blocks: int) -> list[int] | None:
    """The axes of a ``[num_blocks, heads, block_size, C]`` view in memory order, when each block is one dense page
    laid out in another order (vLLM 0.32 views every layer so and lays it out by the engine's ``KVCacheLayout``:
    ``LBNHC``, FlashAttention's default, keeps ``[num_blocks, block_size, heads, C]`` in memory); ``None`` for a
    contiguous tensor or one whose blocks are not dense pages (a block-outermost layout: refused)."""
    if tensor.dim() != 4 or tensor.shape[0] != num_blocks or tensor.is_contiguous():
        return None
    order = [0, *sorted(range(1, 4), key=lambda d: -tensor.stride(d))]
    return order if tensor.permute(order).is_contiguous() else None


def _planes(name: str, tensor: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    if (order := _memory_order(tensor, num_blocks)) is not None:  # a row is the page, in memory order
        return [tensor.permute(order).reshape(num_blocks, -1)]
    two_planes = tensor.dim() >= 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks
    # [2, num_blocks, block_size, heads, head] is the only 5-D layout; prefer it when num_blocks == 2 is ambiguous.
    if two_planes and (tensor.dim() == 5 or tensor.shape[0] != num_blocks):
        planes = [tensor[0], tensor[1]]
        if all(p.is_contiguous() for p in planes):
            return [p.reshape(num_blocks, -1) for p in planes]
    if tensor.shape[0] == num_blocks and tensor.is_contiguous():
        return [tensor.reshape(num_blocks, -1)]
    raise ConfigError(
        "kv_caches", f"layer {name}: unsupported KV tensor shape {tuple(tensor.shape)} strides {tensor.stride()}"
    )


def _head_runs(tensor: torch.Tensor, num_blocks: int, num_heads: int) -> int:
    """Runs of ``num_heads`` heads per row of one plane (see :attr:`KVLayout.head_runs`)."""
    shape = tuple(tensor.shape)
    if (order := _memory_order(tensor, num_blocks)) is not None:  # heads inside the axes before them in memory
        if shape[1] != num_heads:
            return 0
        runs = 1
        for d in order[1:order.index(1)]:
            runs *= shape[d]
        return runs
    if len(shape) == 4 and shape[0] == num_blocks and shape[1] == num_heads:  # [blocks, heads, block_size, ...]
        return 1
    if len(shape) == 5 and shape[:2] == (2, num_blocks) and shape[3] == num_heads:  # [2, blocks, bs, heads, hs]
        return shape[2]
    return 1 if num_heads == 1 and len(shape) != 5 else 0


def block_rows(
    kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int, num_heads: int = 1
) -> tuple[KVLayout, list[torch.Tensor]]:
    """View the registered KV tensors as rows.

    Args:
        kv_caches: ``{layer_name: tensor}`` as given to ``register_kv_caches``.
        layer_names: the attention layers to serve, in model order.
        num_blocks: engine blocks per layer (``KVCacheConfig.num_blocks``).
        num_heads: KV heads this rank holds (for :attr:`KVLayout.head_runs`).

    Returns:
        The layout and ``num_layers * num_planes`` views, each ``[num_blocks, row_elems]`` sharing storage with
        the KV cache, ordered layer-major then plane.

    Raises:
        ConfigError: a layer is missing, has an unsupported shape, or rows differ in size between layers.
    """
    views: list[torch.Tensor] = []
    num_planes = None
    for name in layer_names:
        if name not in kv_caches:
            raise ConfigError("kv_caches", f"layer {name} was not registered by vLLM")
        planes = _planes(name, kv_caches[name], num_blocks)
        if num_planes is None:
            num_planes = len(planes)
        byte_rows = [p.view(torch.uint8) if p.dtype != torch.uint8 else p for p in planes]
        views.extend(byte_rows)
    row_bytes = {v.shape[1] for v in views}
    if len(row_bytes) != 1 or num_planes is None:
        raise ConfigError("kv_caches", f"layers have different block sizes in bytes: {sorted(row_bytes)}")
    (rb,) = row_bytes
    row_dtype = torch.int64 if rb % 8 == 0 else torch.uint8
    if row_dtype is torch.int64:
        views = [v.view(torch.int64) for v in views]
    runs = {_head_runs(kv_caches[name], num_blocks, num_heads) for name in layer_names}
    head_runs = runs.pop() if len(runs) == 1 else 0
    if head_runs and rb % (head_runs * num_heads):
        head_runs = 0
    layout = KVLayout(tuple(layer_names), num_blocks, num_planes, rb, row_dtype, num_heads, head_runs)
    return layout, views
