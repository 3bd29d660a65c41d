"""``layout.block_rows``: the registered KV tensors seen as one row of bytes per (layer, plane, block)."""

from __future__ import annotations

import pytest
import torch

from range_connector.errors import ConfigError
from range_connector.kv.layout import block_rows

pytestmark = pytest.mark.timeout(30)

NUM_BLOCKS = 6
BLOCK_SIZE = 16


def _filled(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _check_rows_share_storage(tensor_block, rows: torch.Tensor, num_blocks: int) -> None:
    """Writing row ``b`` changes exactly the tensor's block ``b`` (``tensor_block(b)`` returns that block)."""
    for b in (0, num_blocks - 1):
        before = [tensor_block(i).clone() for i in range(num_blocks)]
        rows[b] = torch.arange(rows.shape[1], dtype=rows.dtype) + 1
        for i in range(num_blocks):
            changed = not torch.equal(tensor_block(i).view(torch.uint8), before[i].view(torch.uint8))
            assert changed == (i == b), (b, i)
        # The row's bytes are the block's bytes.
        assert tensor_block(b).contiguous().view(torch.uint8).reshape(-1).tolist() == (
            rows[b].view(torch.uint8).tolist()
        )


# ---------------------------------------------------------------------- supported shapes
def test_cpu_dense_layout() -> None:
    num_kv_heads, head_size = 2, 8
    shape = (NUM_BLOCKS, num_kv_heads, BLOCK_SIZE, 2 * head_size)
    caches = {"layer.0": _filled(shape, seed=0), "layer.1": _filled(shape, seed=1)}

    layout, rows = block_rows(caches, ["layer.0", "layer.1"], NUM_BLOCKS)

    row_bytes = num_kv_heads * BLOCK_SIZE * 2 * head_size * 2  # bf16
    assert layout.row_bytes == row_bytes == 1024
    assert layout.num_planes == 1 and layout.num_row_groups == 2
    assert layout.block_bytes == 2 * row_bytes
    assert layout.layer_names == ("layer.0", "layer.1") and layout.num_blocks == NUM_BLOCKS
    assert layout.row_dtype is torch.int64 and layout.row_elems == row_bytes // 8
    assert len(rows) == 2
    for name, r in zip(["layer.0", "layer.1"], rows):
        assert r.dtype is torch.int64 and r.shape == (NUM_BLOCKS, row_bytes // 8)
        assert r.untyped_storage().data_ptr() == caches[name].untyped_storage().data_ptr()
    _check_rows_share_storage(lambda b: caches["layer.1"][b], rows[1], NUM_BLOCKS)


def test_cpu_dense_rows_are_layer_major_and_independent() -> None:
    shape = (NUM_BLOCKS, 2, BLOCK_SIZE, 16)
    caches = {f"l{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(3)}

    _, rows = block_rows(caches, ["l0", "l1", "l2"], NUM_BLOCKS)
    rows[1][3] = -1

    assert not caches["l0"].any() and not caches["l2"].any()
    assert caches["l1"][3].view(torch.int16).eq(-1).all()
    assert not caches["l1"][:3].any() and not caches["l1"][4:].any()


def test_mla_layout() -> None:
    shape = (NUM_BLOCKS, 1, BLOCK_SIZE, 576)  # [latent 512 | rope 64]
    caches = {"mla.0": _filled(shape)}

    layout, rows = block_rows(caches, ["mla.0"], NUM_BLOCKS)

    assert layout.row_bytes == BLOCK_SIZE * 576 * 2
    assert layout.num_planes == 1 and layout.row_dtype is torch.int64
    assert rows[0].shape == (NUM_BLOCKS, BLOCK_SIZE * 576 * 2 // 8)
    _check_rows_share_storage(lambda b: caches["mla.0"][b], rows[0], NUM_BLOCKS)


def test_mla_layout_without_head_dim() -> None:
    caches = {"mla.0": _filled((NUM_BLOCKS, BLOCK_SIZE, 576))}

    layout, rows = block_rows(caches, ["mla.0"], NUM_BLOCKS)

    assert layout.row_bytes == BLOCK_SIZE * 576 * 2
    _check_rows_share_storage(lambda b: caches["mla.0"][b], rows[0], NUM_BLOCKS)


def test_two_plane_layout() -> None:
    heads, head = 2, 8
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, heads, head)
    caches = {"a": _filled(shape, seed=0), "b": _filled(shape, seed=1)}

    layout, rows = block_rows(caches, ["a", "b"], NUM_BLOCKS)

    assert layout.num_planes == 2 and layout.num_row_groups == 4
    assert layout.row_bytes == BLOCK_SIZE * heads * head * 2
    assert layout.block_bytes == 4 * layout.row_bytes
    assert [r.shape for r in rows] == [(NUM_BLOCKS, layout.row_bytes // 8)] * 4
    # Order: layer a's K plane, a's V plane, then b's.
    _check_rows_share_storage(lambda blk: caches["a"][0][blk], rows[0], NUM_BLOCKS)
    _check_rows_share_storage(lambda blk: caches["a"][1][blk], rows[1], NUM_BLOCKS)
    _check_rows_share_storage(lambda blk: caches["b"][1][blk], rows[3], NUM_BLOCKS)


def test_rows_whose_size_is_not_a_multiple_of_8_bytes_are_uint8() -> None:
    caches = {"x": torch.zeros((NUM_BLOCKS, 1, 3, 1), dtype=torch.bfloat16)}  # 6 bytes per block

    layout, rows = block_rows(caches, ["x"], NUM_BLOCKS)

    assert layout.row_bytes == 6 and layout.row_dtype is torch.uint8 and layout.row_elems == 6
    assert rows[0].dtype is torch.uint8 and rows[0].shape == (NUM_BLOCKS, 6)
    _check_rows_share_storage(lambda b: caches["x"][b], rows[0], NUM_BLOCKS)


def test_uint8_cache_rows() -> None:
    caches = {"fp8": torch.zeros((NUM_BLOCKS, 2, BLOCK_SIZE, 16), dtype=torch.uint8)}

    layout, rows = block_rows(caches, ["fp8"], NUM_BLOCKS)

    assert layout.row_bytes == 2 * BLOCK_SIZE * 16 and layout.row_dtype is torch.int64
    _check_rows_share_storage(lambda b: caches["fp8"][b], rows[0], NUM_BLOCKS)


def test_only_the_named_layers_are_served() -> None:
    shape = (NUM_BLOCKS, 1, BLOCK_SIZE, 8)
    caches = {"attn": torch.zeros(shape, dtype=torch.bfloat16), "other": torch.zeros((3, 3), dtype=torch.float32)}

    layout, rows = block_rows(caches, ["attn"], NUM_BLOCKS)

    assert layout.layer_names == ("attn",) and len(rows) == 1


def test_token_major_pages_of_vllm_kv_cache_layout_lbnhc() -> None:
    """vLLM 0.32 views each layer as ``[num_blocks, heads, block_size, C]`` laid out by the engine's KVCacheLayout;
    under ``LBNHC`` (FlashAttention's default) a block is the dense page ``[block_size, heads, C]`` in memory: a row
    is that page as it lies, and heads come in ``block_size`` runs."""
    num_kv_heads, c = 2, 16
    physical = {f"layer.{i}": _filled((NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, c), seed=i) for i in range(2)}
    caches = {name: t.permute(0, 2, 1, 3) for name, t in physical.items()}  # the logical [B, H, N, C] view
    assert not caches["layer.0"].is_contiguous()

    layout, rows = block_rows(caches, ["layer.0", "layer.1"], NUM_BLOCKS, num_kv_heads)

    assert layout.num_planes == 1 and layout.row_bytes == BLOCK_SIZE * num_kv_heads * c * 2
    assert layout.head_runs == BLOCK_SIZE and layout.num_heads == num_kv_heads
    for name, r in zip(["layer.0", "layer.1"], rows):
        assert r.data_ptr() == physical[name].data_ptr()  # a view, not a copy
        assert torch.equal(r.view(torch.uint8), physical[name].view(torch.uint8).reshape(NUM_BLOCKS, -1))
    _check_rows_share_storage(lambda b: physical["layer.1"][b], rows[1], NUM_BLOCKS)


def test_block_outermost_layouts_are_refused() -> None:
    """A layout whose blocks hold every layer's page (``BLNHC``): a layer's pages are not one run per block apart
    from the others' layers, and Range refuses it at start-up, by name."""
    num_layers, num_kv_heads, c = 2, 2, 16
    raw = torch.zeros((NUM_BLOCKS, num_layers, BLOCK_SIZE, num_kv_heads, c), dtype=torch.bfloat16)
    layer0 = raw[:, 0].permute(0, 2, 1, 3)
    with pytest.raises(ConfigError, match=r"kv_caches: layer l0: unsupported KV tensor shape"):
        block_rows({"l0": layer0}, ["l0"], NUM_BLOCKS, num_kv_heads)


# ---------------------------------------------------------------------- unsupported shapes
UNSUPPORTED = {
    "wrong_num_blocks": torch.zeros((NUM_BLOCKS + 1, 2, BLOCK_SIZE, 16), dtype=torch.bfloat16),
    "three_planes": torch.zeros((3, NUM_BLOCKS, BLOCK_SIZE, 2, 8), dtype=torch.bfloat16),
    "blocks_not_outer": torch.zeros((2, BLOCK_SIZE, NUM_BLOCKS, 16), dtype=torch.bfloat16),
    "non_contiguous": torch.zeros((2, BLOCK_SIZE, NUM_BLOCKS, 16), dtype=torch.bfloat16).transpose(0, 2),
    "non_contiguous_planes": torch.zeros((NUM_BLOCKS, 2, BLOCK_SIZE, 8), dtype=torch.bfloat16).transpose(0, 1),
    "one_dim": torch.zeros((NUM_BLOCKS * 7,), dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_shape_raises_config_error(name: str) -> None:
    tensor = UNSUPPORTED[name]

    with pytest.raises(ConfigError, match=r"kv_caches: layer bad: unsupported KV tensor shape") as exc_info:
        block_rows({"bad": tensor}, ["bad"], NUM_BLOCKS)
    assert str(tuple(tensor.shape)) in str(exc_info.value)


def test_missing_layer_raises_config_error() -> None:
    caches = {"l0": torch.zeros((NUM_BLOCKS, 2, BLOCK_SIZE, 16), dtype=torch.bfloat16)}

    with pytest.raises(ConfigError, match="kv_caches: layer l1 was not registered"):
        block_rows(caches, ["l0", "l1"], NUM_BLOCKS)


def test_layers_with_different_row_sizes_raise_config_error() -> None:
    caches = {
        "l0": torch.zeros((NUM_BLOCKS, 2, BLOCK_SIZE, 16), dtype=torch.bfloat16),
        "l1": torch.zeros((NUM_BLOCKS, 4, BLOCK_SIZE, 16), dtype=torch.bfloat16),
    }

    with pytest.raises(ConfigError, match="kv_caches: layers have different block sizes"):
        block_rows(caches, ["l0", "l1"], NUM_BLOCKS)


def test_two_plane_layout_with_two_blocks() -> None:
    heads, head = 2, 8
    caches = {"a": _filled((2, 2, BLOCK_SIZE, heads, head))}

    layout, rows = block_rows(caches, ["a"], 2)

    assert layout.num_planes == 2
    assert layout.row_bytes == BLOCK_SIZE * heads * head * 2
    _check_rows_share_storage(lambda blk: caches["a"][0][blk], rows[0], 2)
