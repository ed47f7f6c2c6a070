"""Checkpoint reads straight into their destination (polyfuse/checkpoint/staging.py): byte-exact against safetensors'
own reader, for every dtype path, and the device stager on a GPU."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from polyfuse.checkpoint.readers import iter_safetensors
from polyfuse.checkpoint.staging import DeviceStager, SpanReader, copy_weight, read_spans
from polyfuse.core.errors import CheckpointError


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(3, 129, generator=g),
        "c.bias": torch.randn(11, generator=g).half(),
        "d.idx": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path, tensors


def test_spans_read_the_same_bytes_as_safetensors(ckpt):
    path, tensors = ckpt
    spans = read_spans(str(path / "model.safetensors"))
    assert set(spans) == set(tensors)
    reader = SpanReader()
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name, span in spans.items():
            assert span.dtype == tensors[name].dtype and span.shape == tuple(tensors[name].shape)
            dst = torch.full_like(tensors[name], 7)  # poisoned: every byte must be written
            reader.pread_into(dst, span.file, span.start)
            assert torch.equal(dst, f.get_tensor(name)), name
    reader.close()


def test_copy_weight_paths(ckpt):
    """Same dtype and contiguous: read in place; a cast or a strided destination: read, then copy."""
    path, tensors = ckpt
    reader = SpanReader()
    items = dict(iter_safetensors(str(path)))
    assert all(getattr(r, "span", None) is not None for r in items.values())
    same = torch.empty(7, 5, dtype=torch.bfloat16)
    copy_weight(same, items["a.weight"], "a.weight", reader)
    assert torch.equal(same, tensors["a.weight"])
    cast = torch.empty(7, 5, dtype=torch.float32)
    copy_weight(cast, items["a.weight"], "a.weight", reader)
    assert torch.equal(cast, tensors["a.weight"].float())
    wide = torch.zeros(3, 200)
    copy_weight(wide[:, :129], items["b.weight"], "b.weight", reader)  # a strided view of a wider tensor
    assert torch.equal(wide[:, :129], tensors["b.weight"]) and not wide[:, 129:].any()
    with pytest.raises(CheckpointError, match="has shape"):
        copy_weight(torch.empty(5, 7, dtype=torch.bfloat16), items["a.weight"], "a.weight", reader)
    reader.close()


def test_truncated_file_is_a_checkpoint_error(ckpt):
    path, _ = ckpt
    file = path / "model.safetensors"
    spans = read_spans(str(file))
    data = file.read_bytes()
    file.write_bytes(data[: spans["b.weight"].start + 10])
    reader = SpanReader()
    with pytest.raises(CheckpointError, match="truncated"):
        reader.pread_into(torch.empty(3, 129), str(file), spans["b.weight"].start)
    reader.close()


@pytest.mark.cuda
def test_device_stager_matches_the_host_tensors(ckpt):
    path, tensors = ckpt
    reader = SpanReader()
    stager = DeviceStager(torch.device("cuda"), reader, chunk_bytes=64)  # tiny chunks: many buffer swaps
    items = dict(iter_safetensors(str(path)))
    out = {n: torch.empty_like(t, device="cuda") for n, t in tensors.items()}
    for n, r in items.items():
        copy_weight(out[n], r, n, reader, stager)
    stager.finish()
    reader.close()
    for n, t in tensors.items():
        assert torch.equal(out[n].cpu(), t), n


def test_loader_reports_progress_for_every_byte(tmp_path):
    """The loading bar's hook: called as each tensor is copied, adding up to the model's parameter bytes."""
    import threading

    import transformers

    from polyfuse.models import AutoModelForCausalLM, LlamaForCausalLM

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    LlamaForCausalLM.from_config(cfg, seed=1).save_pretrained(str(tmp_path))
    seen, lock = [], threading.Lock()

    def progress(nbytes, total):
        with lock:
            seen.append((nbytes, total))

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), progress=progress)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert seen and {t for _, t in seen} == {total} and sum(n for n, _ in seen) == total
