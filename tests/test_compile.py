"""--torch_compile compiles standalone op functions: decoding must not recompile per token or per layer."""

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from polyfuse.models.llama import LlamaForCausalLM


def _tiny(seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM.from_config(cfg, seed=seed).eval()


def _frames():
    return sum(counters["frames"].values()), counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_ops_do_not_recompile_while_decoding():
    torch._dynamo.reset()
    counters.clear()
    model = _tiny()
    eager_ids = model.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=12, ignore_eos=True)
    model.kernels = model.kernels.compiled(backend="eager")  # dynamo without inductor: same guards, fast
    ids = torch.tensor([[3, 4, 5, 6]])
    out = model.generate(ids, max_new_tokens=4, ignore_eos=True)
    graphs_after_short = counters["stats"]["unique_graphs"]
    assert graphs_after_short > 0, "nothing was compiled: the test would pass vacuously"
    out = model.generate(ids, max_new_tokens=12, ignore_eos=True)
    # 8 more decode steps over 3 layers: any per-token or per-layer recompilation would add graphs here.
    # A longer static cache changes the KV length once (one new shape, marked dynamic by dynamo), nothing more.
    grown = counters["stats"]["unique_graphs"] - graphs_after_short
    assert grown <= 2, f"{grown} new graphs while decoding 8 more tokens"
    again = counters["stats"]["unique_graphs"]
    model.generate(ids, max_new_tokens=12, ignore_eos=True)
    assert counters["stats"]["unique_graphs"] == again, "the same generate call recompiled"
    assert torch.equal(out, eager_ids), "compiled ops changed the greedy tokens"


def test_lazily_imported_implementations_never_hit_the_recompile_limit(monkeypatch):
    """Backends register lazily imported kernels through one wrapper (polyfuse.core.plugins.lazy_function): one code
    object shared by every op. Compiling those wrappers made dynamo count each op as a recompile of that one frame
    and give up at its recompile limit (issue 14: "hit config.recompile_limit (8) ... function: 'fn'" on the GPU).
    Now fused implementations run uncompiled (they are kernels already) and every native op compiles as its own
    frame: with the limit at 1, the two native ops compile to two graphs and nothing falls back."""
    from polyfuse.core import registry
    from polyfuse.core.plugins import lazy_function
    from polyfuse.core.registry import Implementation, SelectionContext

    registry.ops()
    monkeypatch.setattr(registry, "_IMPLS", {op: list(impls) for op, impls in registry._IMPLS.items()})
    for op, module, attr in (("rms_norm", "polyfuse.ops.rms_norm", "rms_norm_native"),
                             ("swiglu", "polyfuse.ops.swiglu", "swiglu_native")):  # fmt: skip
        fn = lazy_function(module, attr)
        registry.register(Implementation(op, "lazy_" + op, "test", ("cpu",), fn, priority=500, supports_backward=True))
    kernels = registry.resolve(SelectionContext(torch.device("cpu")))
    assert kernels.choices["rms_norm"].implementation.name == "lazy_rms_norm"
    assert kernels.rms_norm.__code__ is kernels.swiglu.__code__, "the test needs the shared wrapper"
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled = kernels.compiled(backend="eager")
        assert "rms_norm" not in compiled.compiled_ops and "swiglu" not in compiled.compiled_ops
        assert {"add_rms_norm", "rotary"} <= set(compiled.compiled_ops)
        x, w = torch.randn(2, 3, 8), torch.rand(8) + 0.5
        q, k, cos = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 3, 8)
        for _ in range(3):
            torch.testing.assert_close(compiled.rms_norm(x, w, 1e-6), kernels.rms_norm(x, w, 1e-6))
            torch.testing.assert_close(compiled.swiglu(x, x), kernels.swiglu(x, x))
            torch.testing.assert_close(compiled.add_rms_norm(x, x, w, 1e-6), kernels.add_rms_norm(x, x, w, 1e-6))
            torch.testing.assert_close(compiled.rotary(q, k, cos, cos), kernels.rotary(q, k, cos, cos))
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not any("recompile limit" in k for k in counters["unimplemented"]), dict(counters["unimplemented"])


def test_composite_ops_are_not_compiled_around_fused_parts(monkeypatch):
    """An op that runs its composite definition (swiglu_linear where no fused one is chosen: the run's swiglu, then
    linear) is not compiled itself: its fused parts would be traced into its graph (on the GPU the Triton swiglu
    inside the compiled composite, under inference_mode, gave wrong logits). Its parts run by their own rule: the
    fused swiglu as it is, linear uncompiled too (one library call: compiling it hit dynamo's recompile limit on an
    H100, one graph per input rank and shape), and the result is the eager one's."""
    from polyfuse.core import registry
    from polyfuse.core.plugins import lazy_function
    from polyfuse.core.registry import Implementation, SelectionContext

    registry.ops()
    monkeypatch.setattr(registry, "_IMPLS", {op: list(impls) for op, impls in registry._IMPLS.items()})
    fn = lazy_function("polyfuse.ops.swiglu", "swiglu_native")  # a "fused" swiglu: not compiled
    registry.register(Implementation("swiglu", "fused_swiglu", "test", ("cpu",), fn, priority=500))
    kernels = registry.resolve(SelectionContext(torch.device("cpu")))
    assert kernels.choices["swiglu_linear"].implementation.name == "native"  # its composite runs
    torch._dynamo.reset()
    compiled = kernels.compiled(backend="eager")
    assert not {"swiglu_linear", "swiglu", "linear"} & set(compiled.compiled_ops), compiled.compiled_ops
    assert {"rms_norm", "rotary"} <= set(compiled.compiled_ops)
    g, u, w = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(8, 16)
    with torch.inference_mode():
        torch.testing.assert_close(compiled.swiglu_linear(g, u, w), kernels.swiglu_linear(g, u, w))
