"""Static shapes on Gaudi, against the TEST DOUBLE's device (tests/habana_double, ``_device.py``): in lazy mode the
double compiles a graph the first time its signature (ops, shapes, constants) is seen, as a Gaudi does, and counts
the compilations through Habana's own ``metric_global("graph_compilation")``; it records every read of an HPU
tensor back to the host; HPU graphs replay their captured ops without running Python. Nothing here has run on a
Gaudi."""

import pytest
import torch
from helpers import tiny_config
from test_hpu_backend import _forget_habana, _import_double

from polyfuse.models.llama import LlamaForCausalLM


@pytest.fixture
def device(monkeypatch):
    """The double in lazy mode with its bridge imported: ``hpu`` is a device."""
    double = _import_double(monkeypatch, True)
    import habana_frameworks.torch  # noqa: F401

    yield double
    _forget_habana()


def _compilations() -> int:
    from habana_frameworks.torch.hpu.metrics import metric_global

    return dict(metric_global("graph_compilation").stats())["TotalNumber"]


def _model(flags=None):
    cfg = tiny_config(num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM.from_config(cfg, seed=1, device="hpu", flags=flags or {}).eval()


def _prompts(lengths, width, seed=0):
    """Left-padded to ``width`` (what --max_input_tokens does): varied real lengths, one static prompt shape."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(10, 300, (n,), generator=g)
        mask[r, width - n :] = 1
    return ids.to("hpu"), mask.to("hpu")


GRAPHS = [pytest.param({}, id="lazy"), pytest.param({"use_hpu_graphs": True}, id="hpu-graphs")]


@pytest.mark.parametrize(
    "flags,do_sample",
    [(GRAPHS[0].values[0], False), (GRAPHS[0].values[0], True), (GRAPHS[1].values[0], False)],
    ids=["lazy-greedy", "lazy-sample", "hpu-graphs-greedy"],
)
def test_no_compilation_after_warm_up_across_100_decode_steps(device, flags, do_sample):
    """A warm-up generate compiles the prompt's and the decode step's graphs; then 100 decode steps on prompts of
    other real lengths (padded to the same width) compile nothing, and no token reads back to the host (sampling
    draws on the device: no [rows, vocab] copy per token)."""
    model = _model(flags)
    gen = model.runtime.sampling_generator(0)
    kw = dict(max_new_tokens=101, ignore_eos=True, do_sample=do_sample, top_k=20, generator=gen)
    from habana_frameworks.torch import _device

    for _ in range(2):  # warm-up (run_generation's --warmup): the first graph also holds the weights' initialization
        model.generate(*_prompts([5, 9], 12), **kw).cpu()  # read back, as a caller does: the graph ends there
    warm = _compilations()
    _device.STATE.host_reads.clear()
    for lengths in ([3, 12], [7, 1]):
        out = model.generate(*_prompts(lengths, 12, seed=sum(lengths)), **kw).cpu()
        assert out.shape == (2, 12 + 101)
    assert _compilations() == warm, "recompiled after warm-up"
    reads = _device.host_reads()
    assert len(reads) <= 2 * 3, reads  # per generate: "any padding?", the result, at most one more; not per token
    assert warm > 0


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv-cache", "no-cache"])
def test_decode_graphs_do_not_grow_with_the_number_of_tokens(device, use_cache):
    """Static shapes per token (optimum-habana's token_idx): a generate of 60 tokens compiles as many graphs as one of
    20, with the KV cache and without it (the cache-less forward runs over prompt + max_new_tokens positions)."""
    counts = []
    for n in (20, 60):
        model = _model()
        device.reset()
        model.generate(*_prompts([4, 6], 6), max_new_tokens=n, ignore_eos=True, use_cache=use_cache)
        counts.append(_compilations())
    assert counts[0] == counts[1], counts


def test_cacheless_static_decode_gives_the_dynamic_tokens(device):
    """The static cache-less forward (future positions masked) gives the tokens of the growing one on the CPU."""
    cfg = tiny_config(num_key_value_heads=2, max_position_embeddings=256)
    ids, mask = _prompts([4, 6], 6)
    want = (
        LlamaForCausalLM.from_config(cfg, seed=1)
        .eval()
        .generate(ids.cpu(), mask.cpu(), max_new_tokens=12, ignore_eos=True, use_cache=False)
    )
    got = _model().generate(ids, mask, max_new_tokens=12, ignore_eos=True, use_cache=False)
    assert torch.equal(got.cpu(), want)


def test_replay_runs_no_python(device):
    """An HPU graph replays the ops its capture ran: a branch the Python took on a tensor's value at capture is taken
    again on new inputs (the live answer would differ), as on a Gaudi; the host read inside the capture is recorded."""
    from habana_frameworks.torch.hpu import wrap_in_hpu_graph

    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if bool(x.sum() > 0) else x * -1

    m = wrap_in_hpu_graph(Branchy())
    x = torch.ones(3, device="hpu")
    assert m(x).cpu().tolist() == [2.0, 2.0, 2.0]
    assert m(-x).cpu().tolist() == [-2.0, -2.0, -2.0]  # captured branch: -1 * 2, not the live (-1) * -1
    assert [n for n, _, _ in device.CALLS if n == "hpu_graph_host_read"] == ["hpu_graph_host_read"]


def test_device_refuses_what_a_gaudi_refuses(device):
    """Host tensors mixed into HPU ops, float64 on the HPU, a CPU generator for HPU draws, Habana's ops on host
    tensors."""
    x = torch.ones(2, 3, device="hpu")
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(2, 3)
    with pytest.raises(RuntimeError, match="not supported on HPU"):
        torch.zeros(2, dtype=torch.float64, device="hpu")
    with pytest.raises(RuntimeError, match="generator"):
        torch.randn(2, device="hpu", generator=torch.Generator())
    with pytest.raises(RuntimeError, match="HPU tensors only"):
        torch.ops.hpu.cast_to_fp8_v2(torch.ones(2, 2), None, False, False, torch.float8_e4m3fn)
    assert (x + torch.tensor(1.0)).device.type == "hpu"  # a 0-dim host tensor is a scalar, as in torch


def _host_prompts(lengths, seed=0):
    """Left-padded to the longest (what the tokenizer gives without --max_input_tokens), on the host."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(10, 300, (n,), generator=g)
        mask[r, width - n :] = 1
    return ids, mask


def test_prompt_buckets_compile_nothing_after_their_warm_up(device):
    """--bucket_size 8 on Gaudi: prompts are left-padded to whole buckets, so a warm-up at each bucket (the longest
    first, as the CLI's --simulate_dyn_prompt warm-up runs them; twice, as --warmup 2 or more: the first run also
    allocates the KV cache) compiles every graph; then prompts of other lengths (widths 5, 12, 16, 9: no two alike)
    run 100 decode steps with no compilation, prepared on the host and returned there (--reduce_recompile), and give
    the CPU's greedy tokens of the unpadded prompts."""
    cfg = tiny_config(num_key_value_heads=2, max_position_embeddings=256)
    cpu = LlamaForCausalLM.from_config(cfg, seed=1).eval()
    model = _model()
    kw = dict(max_new_tokens=26, ignore_eos=True, bucket_size=8)
    for _ in range(2):  # the warm-up, one prompt per bucket (16 and 8), longest first; twice: the first allocates
        for width in (15, 7):
            model.generate(*_host_prompts([width, 2], seed=width), **kw).cpu()
    warm = _compilations()
    for lengths in ([5, 3], [12, 1], [16, 9], [9, 4]):
        ids, mask = _host_prompts(lengths, seed=sum(lengths))
        out = model.generate(ids, mask, **kw).cpu()
        assert out.shape == (2, ids.shape[1] + 26)  # the bucket's padding is not returned
        assert torch.equal(out, cpu.generate(ids, mask, **kw))
    assert _compilations() == warm, "recompiled after the bucket warm-up"
    ids, mask = _host_prompts([11, 2], seed=5)
    model.generate(ids.to("hpu"), mask.to("hpu"), **kw).cpu()  # prepared on the device: its width 11 is new there
    assert _compilations() > warm, "the host preparation made no difference: the test would pass without it"
