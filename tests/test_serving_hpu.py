"""The serving engine's Gaudi path on the test double of habana_frameworks (tests/habana_double), lazy mode.

The model gets the kernels and runtime an HPU run resolves (paged attention through FusedSDPA over the gathered
blocks with --use_flash_attention, the native gather without), and the runner pads every step to static buckets
(prefill and decode apart). With --use_hpu_graphs a graph is captured per bucket: a second wave of requests of other
lengths within the same buckets captures nothing new. The greedy tokens equal the CPU engine's.
"""

from __future__ import annotations

import pytest
import torch
from helpers import one_thread, tiny_config  # noqa: F401  (one_thread: autouse fixture)
from test_hpu_backend import _forget_habana, _import_double, _on_hpu_backend

from polyfuse.models.llama import LlamaForCausalLM
from polyfuse.serving import Engine, EngineConfig, SamplingParams


class Tok:
    eos_token_id = 7

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


WAVES = [[3, 5, 9, 13], [2, 7, 10, 15]]  # the second wave's lengths fall in the first wave's buckets
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompts(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 290, (n,), generator=gen).tolist() for n in lengths]


def run_wave(eng, wave, tag) -> list:
    for i, p in enumerate(wave):
        eng.add_request(f"{tag}{i}", p, PARAMS)
    out: dict = {}
    while eng.has_work():
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return [out[f"{tag}{i}"] for i in range(len(wave))]


def config():
    return EngineConfig(max_model_len=64, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                        bucket_size=8)  # fmt: skip


@pytest.fixture
def lazy_double(monkeypatch):
    double = _import_double(monkeypatch, True)
    import habana_frameworks.torch  # noqa: F401  (the double's hpu device, as the bridge registers it)

    yield double
    _forget_habana()


@pytest.mark.parametrize("flash", [True, False], ids=["fused_sdpa", "native"])
def test_hpu_buckets_capture_per_bucket_not_per_request(lazy_double, flash):
    from polyfuse.core import registry
    from polyfuse.core.context import SelectionContext

    hf = lazy_double
    cfg = tiny_config(num_key_value_heads=2)
    waves = [prompts(lengths, seed) for seed, lengths in enumerate(WAVES)]
    cpu = Engine(LlamaForCausalLM.from_config(cfg, seed=4).eval(), Tok(), config())
    want = [run_wave(cpu, w, f"w{i}") for i, w in enumerate(waves)]

    flags = {"use_hpu_graphs": True}
    model = _on_hpu_backend(LlamaForCausalLM.from_config(cfg, seed=4).eval(), flags)
    if not flash:  # the reference gather + eager attention, forced
        ctx = SelectionContext(torch.device("hpu"), torch.float32, flags=flags, overrides="-paged_attention")
        model.kernels = registry.resolve(ctx)
    expected = "paged_fused_sdpa" if flash else "native"
    assert model.kernels.choices["paged_attention"].implementation.name == expected
    eng = Engine(model, Tok(), config())
    assert eng.runner.mode == "buckets" and len(hf.calls("wrap_in_hpu_graph")) == 1  # one module, both phases
    hf.reset()
    got = [run_wave(eng, waves[0], "w0")]
    first = hf.calls("hpu_graph_capture")
    assert 0 < len(first) <= 8  # one per (phase, sequences, chunk, width) bucket met
    got.append(run_wave(eng, waves[1], "w1"))
    assert got == want
    assert len(hf.calls("hpu_graph_capture")) == len(first)  # nothing captured for the new lengths
    assert len(hf.calls("hpu_graph_replay")) > 0
    assert len(hf.calls("mark_step")) > 0
    sdpa = hf.calls("FusedSDPA")
    if flash:  # the paged attention's FusedSDPA calls (the model's own attention op is not used in paged steps)
        assert sdpa and all(a[4:] == (0.0, False, None, "None", False, None, "None") for a, _ in sdpa)
        assert any(a[0].shape[2] == 1 for a, _ in sdpa)  # decode steps: one query per sequence
    else:
        assert sdpa == []


def test_hpu_buckets_with_speculative_decoding(lazy_double):
    """Prompt lookup's verify rows are prefill chunks of the bucketed step (chunk padded to a multiple of
    --bucket_size, logits rows to a power of two): the CPU engine's tokens without speculation, graphs per bucket."""
    from polyfuse.generation.speculative.settings import SpeculativeSetting

    hf = lazy_double
    cfg = tiny_config(num_key_value_heads=2)
    wave = prompts(WAVES[0], 0)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    cpu = Engine(LlamaForCausalLM.from_config(cfg, seed=4).eval(), Tok(), config())
    for i, p in enumerate(wave):
        cpu.add_request(str(i), p, params)
    want: dict = {}
    while cpu.has_work():
        for d in cpu.step():
            want.setdefault(d.request_id, []).extend(d.token_ids)
    model = _on_hpu_backend(LlamaForCausalLM.from_config(cfg, seed=4).eval(), {"use_hpu_graphs": True})
    spec = config()
    spec.speculative = SpeculativeSetting("prompt_lookup", 4, 2)
    eng = Engine(model, Tok(), spec)
    hf.reset()
    shapes, real = set(), eng.runner.run

    def run(batches):
        for b in batches:
            parts = [t for t in (*(b.prefill or ()), *(b.decode or ())) if t is not None]
            shapes.add((b.prefill is None, b.width, b.input_ids.shape, b.logits_rows.shape, *(t.shape for t in parts)))
            if b.prefill is not None:
                n, q = b.prefill[2].shape
                assert q % 8 == 0 and n & (n - 1) == 0 and b.input_ids.numel() == n * q
            assert len(b.logits_rows) & (len(b.logits_rows) - 1) == 0
        return real(batches)

    eng.runner.run = run
    for i, p in enumerate(wave):
        eng.add_request(str(i), p, params)
    got: dict = {}
    while eng.has_work():
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
    assert got == want
    assert eng.spec.accepted > 0 and eng.blocks.num_used == 0
    assert eng.spec.draft_steps > 4
    assert len(hf.calls("hpu_graph_capture")) == len(shapes)  # one graph per bucket met, none per step
