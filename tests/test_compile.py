"""--torch_compile compiles standalone op functions: decoding must not recompile per token or per layer."""

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
