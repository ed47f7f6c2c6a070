"""The whole model on an NVIDIA GPU (make test-cuda): bf16 logits against transformers, CUDA-graph replay against
eager, flag combinations, re-capture when the batch or cache leaves the captured shapes."""

import pytest
import torch
import transformers

from benchmarks.harness.measure import weight_bytes
from polyfuse.compat import DTYPE_KW
from polyfuse.loader.load import set_kernels
from polyfuse.models.llama import LlamaForCausalLM


pytestmark = pytest.mark.cuda


def _config(**kw):
    base = dict(
        vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _prompts(vocab, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (3, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    mask[2, :13] = 0
    ids[mask == 0] = 0
    return ids.to(device), mask.to(device)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """polyfuse model (all CUDA kernels) and transformers' model on the same bf16 weights."""
    path = tmp_path_factory.mktemp("ckpt")
    LlamaForCausalLM.from_config(_config(), dtype=torch.float32, seed=1).save_pretrained(str(path))
    hf = transformers.LlamaForCausalLM.from_pretrained(
        path, **{DTYPE_KW: torch.bfloat16}, attn_implementation="sdpa"
    ).cuda()
    ours = LlamaForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, device="cuda", flags={"use_flash_attention": True}
    )
    return ours.eval(), hf.eval(), str(path)


def test_kernels_were_selected(pair):
    ours, _, _ = pair
    chosen = {k: v["implementation"] for k, v in ours.kernels.as_dict().items()}
    assert chosen["rms_norm"] == "triton" and chosen["swiglu"] == "triton" and chosen["rotary_kv_write"] == "triton"
    assert chosen["attention"] in ("triton_decode", "sdpa_flash")


def test_bf16_logits_match_transformers(pair):
    ours, hf, _ = pair
    ids, mask = _prompts(1000, "cuda")
    with torch.inference_mode():
        a = ours(ids, attention_mask=mask).logits.float()
        b = hf(ids, attention_mask=mask).logits.float()
    keep = mask.bool()
    a, b = a[keep], b[keep]
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((a - b).norm() / b.norm()).item()
    assert top1 >= 0.97, f"top-1 agreement {top1:.3f}"
    assert rel <= 2e-2, f"relative logits error {rel:.4f} (bf16 tolerance 2e-2)"


@pytest.mark.parametrize(
    "flags,bucket",
    [
        ({}, -1),
        ({"use_flash_attention": True}, -1),
        ({"use_cuda_graphs": True}, -1),
        ({"use_flash_attention": True, "use_cuda_graphs": True}, -1),
        ({"use_flash_attention": True, "use_cuda_graphs": True}, 16),
    ],
    ids=["eager", "flash", "graphs", "flash+graphs", "flash+graphs+buckets"],
)
def test_flags_give_the_same_greedy_tokens(pair, flags, bucket):
    ours, _, path = pair
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, device="cuda", flags=flags)
    ref = LlamaForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        device="cuda",
        overrides="-rms_norm,-add_rms_norm,-rotary,-rotary_kv_write,-swiglu,-attention",
    )
    ids, mask = _prompts(1000, "cuda")
    want = ref.generate(ids, mask, max_new_tokens=40, ignore_eos=True)
    got = model.generate(ids, mask, max_new_tokens=40, ignore_eos=True, bucket_size=bucket)
    again = model.generate(ids, mask, max_new_tokens=40, ignore_eos=True, bucket_size=bucket)  # graph replays
    assert torch.equal(got, again)
    agree = (got[:, 21:] == want[:, 21:]).float().mean().item()
    assert agree >= 0.95, f"fp32 greedy tokens agree {agree:.3f} with the native reference"


def test_graph_replay_matches_eager_exactly(pair):
    _, _, path = pair
    eager = LlamaForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, device="cuda", flags={"use_flash_attention": True}
    )
    graphed = LlamaForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, device="cuda", flags={"use_flash_attention": True, "use_cuda_graphs": True}
    )
    ids, mask = _prompts(1000, "cuda")
    a = eager.generate(ids, mask, max_new_tokens=48, ignore_eos=True)
    b = graphed.generate(ids, mask, max_new_tokens=48, ignore_eos=True)
    assert torch.equal(a, b), "CUDA-graph replay changed the tokens"
    step = graphed.steps.token  # greedy decoding replays the in-place token step
    assert step.inplace and len(step.graphs) == 1 and step.disabled_reason is None
    # Another batch size needs another cache: the old graphs (which point at the old cache) are dropped and the
    # step is captured anew for the new shapes, giving the eager tokens again.
    one = graphed.generate(ids[:1], mask[:1], max_new_tokens=8, ignore_eos=True)
    (key,) = step.graphs
    assert key[1][0][0] == 1, f"graph key {key} is not for batch 1"
    assert torch.equal(one, eager.generate(ids[:1], mask[:1], max_new_tokens=8, ignore_eos=True))
    # With --bucket_size the attended KV length grows in buckets: 21 + 40 tokens in buckets of 16 decode over KV
    # lengths 32, 48 and 64 of one 64-slot cache, so three graphs, reused by the next identical call.
    kw = dict(max_new_tokens=40, ignore_eos=True, bucket_size=16)
    b1 = graphed.generate(ids[:1], mask[:1], **kw)
    assert sorted(k[0] for k in step.graphs) == [32, 48, 64]
    assert torch.equal(graphed.generate(ids[:1], mask[:1], **kw), b1) and len(step.graphs) == 3
    assert torch.equal(b1, eager.generate(ids[:1], mask[:1], **kw))


@pytest.mark.parametrize("quant", [None, "fp8", "int4", "int8"])
def test_pdl_gives_the_same_tokens(pair, quant):
    """The inference kernels launched with programmatic dependent launch (Hopper and up: each waits for the kernel
    before it) give the tokens of plain stream order, under CUDA graphs, for bf16 weights and through the quantized
    one-row GEMVs (fp8 / int8: gemv_int8_fp8, int4: gemv_int4)."""
    from polyfuse.backends.triton import _pdl

    if torch.cuda.get_device_capability() < (9, 0) or not _pdl.TRITON_HAS_PDL:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 and Triton 3.4+")
    _, _, path = pair
    ids, mask = _prompts(1000, "cuda")
    flags = {"use_flash_attention": True, "use_cuda_graphs": True}
    out = {}
    for on in (False, True):
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device="cuda", flags=flags, quant=quant,
                                                 pdl=on)  # fmt: skip
        assert _pdl.pdl(torch.device("cuda"), model.kernels.context.options) is on
        out[on] = model.generate(ids, mask, max_new_tokens=48, ignore_eos=True)
    assert torch.equal(out[True], out[False])


def test_graphed_token_step_with_eos_matches_eager(pair):
    """The in-place token step under graphs: rows finishing at different steps, the output trimmed where the last
    one finished, the warm-ups undone (the first replayed tokens are the eager ones), and the sampling path (the
    copying decode graph) still replaying."""
    _, _, path = pair
    eager = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
    graphed = LlamaForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, device="cuda", flags={"use_cuda_graphs": True}
    )
    ids, mask = _prompts(1000, "cuda")
    free = eager.generate(ids, mask, max_new_tokens=40, ignore_eos=True)
    eos = [int(free[0, 21 + 3]), int(free[1, 21 + 13]), int(free[2, 21 + 26])]
    for bucket in (-1, 16):
        kw = dict(max_new_tokens=40, eos_token_id=eos, pad_token_id=0, bucket_size=bucket)
        want = eager.generate(ids, mask, **kw)
        assert want.shape[1] < 21 + 40, "scenario not met: generation did not stop early"
        assert torch.equal(graphed.generate(ids, mask, **kw), want)
        assert torch.equal(graphed.generate(ids, mask, **kw), want)  # replays of the graphs captured above
    token = graphed.steps.token
    assert token.disabled_reason is None and token.graphs
    sample = dict(max_new_tokens=24, do_sample=True, top_k=20, ignore_eos=True)
    a = eager.generate(ids, mask, generator=torch.Generator("cuda").manual_seed(3), **sample)
    b = graphed.generate(ids, mask, generator=torch.Generator("cuda").manual_seed(3), **sample)
    decode = graphed.steps.decode
    assert not decode.inplace and decode.graphs and decode.disabled_reason is None
    assert torch.equal(a, b)


def test_cuda_graph_prefill_matches_eager(pair):
    """--cuda_graph_prefill: the prompt step captured once per (batch, length) and replayed; padded and unpadded
    prompts, greedy tokens equal to those of the same kernels with an eager prompt step, and the second generate()
    replays the captured prompt graph."""
    _, _, path = pair
    flags = {"use_flash_attention": True, "use_cuda_graphs": True}
    eager = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device="cuda", flags=flags)
    flags = dict(flags, cuda_graph_prefill=True)
    graphed = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device="cuda", flags=flags)
    ids, mask = _prompts(1000, "cuda")
    for m in (mask, torch.ones_like(mask)):
        want = eager.generate(ids, m, max_new_tokens=24, ignore_eos=True)
        assert torch.equal(graphed.generate(ids, m, max_new_tokens=24, ignore_eos=True), want)
        prefill = graphed.steps.prefill
        assert prefill.disabled_reason is None and prefill.graphs
        count = len(prefill.graphs)
        assert torch.equal(graphed.generate(ids, m, max_new_tokens=24, ignore_eos=True), want)
        assert len(prefill.graphs) == count  # replayed, not captured again


def test_weight_bytes_counts_tied_head_once():
    model = LlamaForCausalLM.from_config(_config(tie_word_embeddings=True), dtype=torch.bfloat16, device="cuda")
    total = sum(p.numel() * 2 for p in model.parameters())
    assert weight_bytes(model) == total == weight_bytes(model, exclude_embedding=True)


def test_torch_compile_flag_runs_on_gpu(pair):
    _, _, path = pair
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device="cuda", flags={"torch_compile": True})
    ref = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
    ids, mask = _prompts(1000, "cuda")
    with torch.inference_mode():
        a = model(ids, attention_mask=mask).logits.float()[mask.bool()]
        b = ref(ids, attention_mask=mask).logits.float()[mask.bool()]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.97
    assert ((a - b).norm() / b.norm()).item() <= 2e-2
    out = model.generate(ids, mask, max_new_tokens=16, ignore_eos=True)  # compiled ops through a whole generation
    assert out.shape == (3, 21 + 16)
    set_kernels(model, {})  # back to eager kernels


def test_torch_compile_on_the_gpu_stays_within_the_recompile_limit(pair):
    """issue 14: --torch_compile on the GPU hit dynamo's recompile limit ("function: 'fn' ... register.py"): every
    lazily imported CUDA op shared one wrapper code object. Each op now compiles as its own frame. In fp32 (so that
    inductor's fusions cannot move a bf16 rounding) the greedy tokens equal the eager run's."""
    from torch._dynamo.utils import counters

    _, _, path = pair
    flags, ops = {"use_flash_attention": True}, "-rms_norm,-rotary"  # two native ops for torch.compile to take
    eager = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, device="cuda", flags=flags, overrides=ops)
    compiled = LlamaForCausalLM.from_pretrained(
        path, dtype=torch.float32, device="cuda", flags=dict(flags, torch_compile=True), overrides=ops
    )
    eager.eval(), compiled.eval()
    assert {"rms_norm", "rotary"} <= set(compiled.kernels.compiled_ops)
    assert compiled.kernels.choices["attention"].implementation.name == "triton_decode"  # fused: runs uncompiled
    ids, mask = _prompts(1000, "cuda")
    torch._dynamo.reset()
    counters.clear()
    want = eager.generate(ids, mask, max_new_tokens=12, ignore_eos=True)
    got = compiled.generate(ids, mask, max_new_tokens=12, ignore_eos=True)
    limits = {k: v for k, v in counters["unimplemented"].items() if "recompile limit" in k}
    assert not limits, limits
    assert counters["stats"]["unique_graphs"] > 0
    assert (got == want).float().mean().item() >= 0.97, (got, want)
