"""Tensor parallelism for packed weights (quant/shards.py), in process: a rank's slice of every component of
every format, cut from the whole projection's, dequantizes to exactly the rank's rows or columns of the whole
weight; shards that split a packed entry are refused with the reason. The TP=2 runs against TP=1 on checkpoints
of each format are in tests/tp_worker.py (test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from polyfuse.distributed.sharding import Shard
from polyfuse.ops.quant_formats import K_QUANTS, QuantizedWeight, components, dequantize, quantize
from polyfuse.quant.shards import cannot_split, take


FORMATS = [
    "int8",
    "fp8",
    "fp8_block",
    "int4",
    "gguf_q8_0",
    "gguf_q4_0",
    "gguf_q4_1",
    "gguf_q4_k",
    "gguf_q5_k",
    "gguf_q6_k",
]
N, K = 48, 512

SHARDS = [
    Shard(0, ((16, 40),), N),  # column-parallel: one block of output rows
    Shard(0, ((0, 8), (0, 8), (24, 32)), N),  # kv heads repeated per block of queries (groups straddling ranks)
    Shard(1, ((256, 512),), K),  # row-parallel: the second half of the input columns
    Shard(1, ((0, 128), (384, 512)), K),  # two blocks of columns
]


def _local(qw: QuantizedWeight, shard: Shard) -> QuantizedWeight:
    n = sum(b - a for a, b in shard.blocks) if shard.dim == 0 else qw.shape[0]
    k = sum(b - a for a, b in shard.blocks) if shard.dim == 1 else qw.shape[1]
    spec = components(qw.format, *qw.shape, qw.group_size or 128)
    parts = {name: take(name, getattr(qw, name), spec[name], shard, qw.group_size) for name in spec}
    for name, comp in components(qw.format, n, k, qw.group_size or 128).items():
        assert tuple(parts[name].shape) == comp.shape, name
    return QuantizedWeight(qw.format, (n, k), group_size=qw.group_size, **parts)


def _rows(w: torch.Tensor, shard: Shard) -> torch.Tensor:
    index = [slice(a, b) for a, b in shard.blocks]
    return torch.cat([w[i] if shard.dim == 0 else w[:, i] for i in index], shard.dim)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shard", SHARDS, ids=["rows", "repeated_rows", "columns", "two_column_blocks"])
def test_a_ranks_slice_dequantizes_to_its_part_of_the_whole(fmt, shard):
    if fmt.startswith("gguf"):
        pytest.importorskip("gguf")
    torch.manual_seed(0)
    w = torch.randn(N, K) * torch.linspace(0.5, 2.0, K)
    qw = quantize(fmt, w)
    if fmt in K_QUANTS and shard.blocks == ((0, 128), (384, 512)):  # inside 256-weight blocks
        assert "one entry per 256 input columns" in cannot_split(fmt, shard, qw.group_size)
        return
    assert cannot_split(fmt, shard, qw.group_size) is None
    local = _local(qw, shard)
    assert torch.equal(dequantize(local), _rows(dequantize(qw), shard))


def test_int4_last_partial_group_stays_whole_on_its_rank():
    """K = 320 in groups of 128: the rank holding columns 256..320 holds the partial third group."""
    torch.manual_seed(1)
    w = torch.randn(16, 320)
    qw = quantize("int4", w)
    for shard in (Shard(1, ((0, 256),), 320), Shard(1, ((256, 320),), 320), Shard(1, ((128, 320),), 320)):
        assert cannot_split("int4", shard, 128) is None
        assert torch.equal(dequantize(_local(qw, shard)), _rows(dequantize(qw), shard))


def test_int4_act_order_slices_by_rows_only():
    torch.manual_seed(2)
    qw = quantize("int4", torch.randn(16, 256))
    perm = torch.randperm(256)
    act = QuantizedWeight("int4", qw.shape, qw.qweight, qw.scales, qw.qzeros, qw.g_idx[perm].contiguous(), 128, True)
    rows = Shard(0, ((8, 16),), 16)
    assert cannot_split("int4", rows, 128, act_order=True) is None
    local = _local(act, rows)
    assert torch.equal(local.g_idx, act.g_idx)  # the whole permutation: every rank holds all of K
    assert torch.equal(dequantize(local), dequantize(act)[8:16])
    assert "act-order" in cannot_split("int4", Shard(1, ((0, 128),), 256), 128, act_order=True)


@pytest.mark.parametrize(
    "fmt, shard, needle",
    [
        ("int4", Shard(1, ((0, 192),), 384), "holds one entry per 128 input columns"),  # a group split
        ("int4", Shard(1, ((192, 384),), 384), "192..384"),
        ("int4", Shard(0, ((0, 4),), 16), "one entry per 8 output rows"),  # packed zeros: 8 columns of N a word
        ("fp8_block", Shard(1, ((0, 200),), 400), "one entry per 128 input columns"),
        ("gguf_q4_1", Shard(1, ((0, 48),), 96), "one entry per 32 input columns"),
    ],
)
def test_a_shard_that_splits_a_packed_entry_is_refused(fmt, shard, needle):
    why = cannot_split(fmt, shard, 128)
    assert why is not None and needle in why


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_per_channel_formats_split_anywhere(fmt):
    torch.manual_seed(3)
    qw = quantize(fmt, torch.randn(10, 70))
    for shard in (Shard(1, ((0, 33),), 70), Shard(0, ((3, 7),), 10)):
        assert cannot_split(fmt, shard) is None
        assert torch.equal(dequantize(_local(qw, shard)), _rows(dequantize(qw), shard))


def test_the_load_reads_g_idx_to_refuse_act_order_by_columns_only():
    """QuantSetup's check before any weight is copied: a GPTQ checkpoint's g_idx tells act-order apart; by rows it
    splits, by columns it is refused with one error naming the projection and the way out."""
    from polyfuse.distributed.sharding import TensorParallelError
    from polyfuse.quant.checkpoint import Checkpoint
    from polyfuse.quant.quantize import QuantSetup

    in_order = torch.arange(256, dtype=torch.int32) // 128
    shuffled = in_order[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    for g_idx, refused in ((in_order, False), (shuffled, True)):
        name = "model.layers.0.mlp.down_proj"
        ckpt = Checkpoint("gptq", "int4", 128, keys={f"{name}.g_idx"}, read=lambda key, g=g_idx: g)
        setup = QuantSetup(None, ckpt, False, "cpu", torch.float32)
        setup.shards = {"mlp.down_proj": Shard(1, ((128, 256),), 256), "mlp.up_proj": Shard(0, ((0, 64),), 128)}
        setup._check_split("int4", 128, [("model.layers.0.mlp.up_proj", 64)])  # rows: act-order or not
        if refused:
            with pytest.raises(
                TensorParallelError, match=r"down_proj \(int4\) cannot be split .*act-order.*--quant none"
            ):
                setup._check_split("int4", 128, [(name, 128)])
        else:
            setup._check_split("int4", 128, [(name, 128)])


def test_one_group_over_all_of_k_is_taken_whole_by_every_rank():
    """AutoGPTQ's group_size -1 (per-channel int4): the load sets the group to the whole projection's K, and each
    rank of a row-parallel split holds that one group's scales and zeros."""
    torch.manual_seed(4)
    qw = quantize("int4", torch.randn(16, 256), group_size=256)
    for shard in (Shard(1, ((0, 128),), 256), Shard(1, ((128, 256),), 256)):
        assert cannot_split("int4", shard, 256) is None
        assert torch.equal(dequantize(_local(qw, shard)), _rows(dequantize(qw), shard))


def test_gguf_blocks_kept_under_tensor_parallelism_are_checked_when_built():
    from torch import nn

    from polyfuse.distributed.sharding import TensorParallelError
    from polyfuse.quant.checkpoint import Checkpoint
    from polyfuse.quant.quantize import QuantSetup

    name = "model.layers.0.mlp.down_proj"
    setup = QuantSetup("gguf", Checkpoint("gguf", gguf_types={f"{name}.weight": "Q4_1"}), True, "cpu", torch.float32)
    setup.shards = {"mlp.down_proj": Shard(1, ((16, 48),), 96)}  # 32 columns, but from the middle of a block
    with pytest.raises(TensorParallelError, match=r"down_proj \(gguf_q4_1\) cannot be split .*one entry per 32"):
        setup._module_format(name, nn.Linear(32, 16, device="meta"), [(name, 16)])
    setup.shards = {"mlp.down_proj": Shard(1, ((32, 64),), 96)}
    assert setup._module_format(name, nn.Linear(32, 16, device="meta"), [(name, 16)])[0] == "gguf_q4_1"
