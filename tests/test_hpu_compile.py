"""--torch_compile on Gaudi, against the TEST DOUBLE (tests/habana_double) in eager mode: the whole decoder compiled
with ``hpu_backend`` as optimum-habana's ``get_torch_compiled_model`` does (its options passed through), each layer
with --regional_compile, ``dynamic=False`` with --force_static_compile. The double's backend lowers every graph
through AOT autograd and refuses what the device could not compile (host inputs, non-ATen nodes), and records each
graph: a graph break or a recompile per token would show as more graphs. Nothing here has run on a Gaudi."""

import pytest
import torch
from helpers import one_thread, tiny_config  # noqa: F401  (one_thread: autouse fixture)
from test_hpu_backend import _forget_habana, _import_double

from polyfuse.generation.kv_cache import bucketed
from polyfuse.loader import load as loading
from polyfuse.models.llama import LlamaForCausalLM


TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
# torch 2.7's fake tensors refuse the double's hpu device (Habana's own torch build registers it); 2.13 takes it.
needs_fake_hpu = pytest.mark.skipif(TORCH < (2, 8), reason="dynamo's fake tensors on the double's hpu: torch >= 2.8")


IDS = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
MASK = (IDS != 0).long()
NEW = 8
SLOW_PARAMS = ("force-static", "fused-sdpa")  # conftest.py: `make test-all` runs these (each ~15 s here)


@pytest.fixture
def double(monkeypatch):
    """The double in eager mode (torch.compile's mode on Gaudi), dynamo's caches cleared around the test."""
    habana = _import_double(monkeypatch, False)
    import habana_frameworks.torch  # noqa: F401

    torch._dynamo.reset()
    yield habana
    torch._dynamo.reset()
    _forget_habana()


def _cfg():
    return tiny_config(num_key_value_heads=2, max_position_embeddings=256)


def _graphs(double) -> list:
    """The ATen op names of every graph hpu_backend compiled."""
    return [args[0] for args, _ in double.calls("hpu_backend.graph")]


def _norms(graph) -> int:
    return sum(op == "aten.rsqrt.default" for op in graph)  # one per RMSNorm (the double's FusedRMSNorm math)


def _decode_buckets(bucket_size: int, max_len: int) -> set:
    n = bucketed(IDS.shape[1], bucket_size, max_len)  # on Gaudi the prompt is left-padded to a whole bucket
    return {bucketed(n + i + 1, bucket_size, max_len) for i in range(NEW - 1)}


@pytest.mark.parametrize(
    "flags",
    [{}, {"force_static_compile": True}, {"use_flash_attention": True, "flash_attention_causal_mask": True}],
    ids=["default", "force-static", "fused-sdpa"],
)
@needs_fake_hpu
def test_whole_decoder_reaches_hpu_backend_once_per_shape(double, flags):
    """Every layer and the final norm are in one graph per step shape (the prompt, each KV bucket of the decode):
    no graph break, no recompile per token; a second generate compiles nothing; the greedy tokens are the CPU's."""
    want = LlamaForCausalLM.from_config(_cfg(), seed=1).eval().generate(IDS, MASK, max_new_tokens=NEW,
                                                                       ignore_eos=True, bucket_size=4)  # fmt: skip
    model = LlamaForCausalLM.from_config(_cfg(), seed=1, device="hpu").eval()
    loading.set_kernels(model, {"torch_compile": True, **flags})
    double.reset()
    got = model.generate(IDS.to("hpu"), MASK.to("hpu"), max_new_tokens=NEW, ignore_eos=True, bucket_size=4)
    assert torch.equal(got.cpu(), want)
    graphs = _graphs(double)
    assert len(graphs) == 1 + len(_decode_buckets(4, model.cache.max_len)), [len(g) for g in graphs]
    layers = model.config.num_hidden_layers
    assert all(_norms(g) == 2 * layers + 1 for g in graphs)  # the whole decoder in each
    static = bool(flags.get("force_static_compile"))
    assert [args[0] for args, _ in double.calls("hpu_backend.options")] == [
        {"force_static_compile": static, "keep_input_mutations": True}
    ] * len(graphs)  # optimum-habana's hpu_backend options
    assert not double.calls("FusedRMSNorm"), "a compiled graph runs no Python: the kernels ran eagerly"
    again = model.generate(IDS.to("hpu"), MASK.to("hpu"), max_new_tokens=NEW, ignore_eos=True, bucket_size=4)
    assert len(_graphs(double)) == len(graphs) and torch.equal(again.cpu(), want)


@needs_fake_hpu
def test_regional_compile_compiles_each_layer(double):
    """--regional_compile: graphs of one decoder layer each (its two norms), not of the decoder; same tokens."""
    want = LlamaForCausalLM.from_config(_cfg(), seed=1).eval().generate(IDS, MASK, max_new_tokens=NEW,
                                                                       ignore_eos=True)  # fmt: skip
    model = LlamaForCausalLM.from_config(_cfg(), seed=1, device="hpu").eval()
    loading.set_kernels(model, {"torch_compile": True, "regional_compile": True})
    double.reset()
    got = model.generate(IDS.to("hpu"), MASK.to("hpu"), max_new_tokens=NEW, ignore_eos=True)
    assert torch.equal(got.cpu(), want)
    graphs = _graphs(double)
    assert graphs and all(_norms(g) == 2 for g in graphs)
    assert double.calls("FusedRMSNorm"), "the final norm runs outside the layers, eagerly"
    # Kernels set again without --torch_compile: nothing stays compiled.
    loading.set_kernels(model, {})
    assert "forward" not in vars(model.model.layers[0]) and "hidden_states" not in vars(model)


def test_graph_break_or_host_input_fails_in_the_backend(double):
    """The double's backend is strict where a Gaudi is: a host tensor as a graph input is refused."""
    with pytest.raises(Exception, match="not an HPU tensor"):
        torch.compile(lambda x: x * 2, backend="hpu_backend")(torch.ones(3))


def test_cpu_regional_compile_compiles_layers_with_the_runtime_backend(monkeypatch):
    """Off Gaudi, --torch_compile alone compiles the ops (as before); --regional_compile each decoder layer, with
    the runtime's backend (inductor; "eager" here: the same dynamo graphs, no C++ build); same tokens."""
    from torch._dynamo.utils import counters

    from polyfuse.core.runtime import DeviceRuntime

    monkeypatch.setattr(DeviceRuntime, "compile_backend", lambda self: "eager")
    want = LlamaForCausalLM.from_config(_cfg(), seed=1).eval().generate(IDS, MASK, max_new_tokens=NEW,
                                                                       ignore_eos=True)  # fmt: skip
    torch._dynamo.reset()
    counters.clear()
    model = LlamaForCausalLM.from_config(_cfg(), seed=1).eval()
    loading.set_kernels(model, {"torch_compile": True, "regional_compile": True, "force_static_compile": True})
    assert "forward" in vars(model.model.layers[0]) and not getattr(model.kernels, "compiled_ops", None)
    got = model.generate(IDS, MASK, max_new_tokens=NEW, ignore_eos=True)
    assert torch.equal(got, want) and counters["stats"]["unique_graphs"] > 0
    loading.set_kernels(model, {"torch_compile": True})
    assert "forward" not in vars(model.model.layers[0]) and model.kernels.compiled_ops
    torch._dynamo.reset()


def test_regional_compile_where_layers_do_not_compile_falls_back_to_the_ops(monkeypatch, caplog):
    """CUDA's layers launch Triton kernels (runtime.compiles_layers False): one warning, the ops compiled."""
    from polyfuse.core.runtime import DeviceRuntime
    from polyfuse.loader.compile import compile_for_run

    monkeypatch.setattr(DeviceRuntime, "compiles_layers", False)
    model = LlamaForCausalLM.from_config(_cfg(), seed=1).eval()
    dynamics = []
    monkeypatch.setattr(type(model.kernels), "compiled", lambda self, backend, dynamic=None: dynamics.append(dynamic)
                        or self)  # fmt: skip
    with caplog.at_level("WARNING", logger="polyfuse"):
        compile_for_run(model, {"torch_compile": True, "regional_compile": True, "force_static_compile": True})
    assert dynamics == [False] and "forward" not in vars(model.model.layers[0])
    assert "--regional_compile on cpu" in caplog.text
