"""The serving engine on a tiny random Llama (CPU, float32): continuous batching against one-at-a-time generation.

* the block manager: tables, freeing, prefix hashes (collisions never share a block), eviction order;
* greedy tokens of many concurrent requests equal ``generate()``'s for each prompt alone, whatever the batch,
  chunk budget or block size, with the cache shapes padded as for CUDA graphs and as for Gaudi's buckets;
* a tiny block budget forces preemption (recompute) and the tokens stay the same; a request that can never fit is
  refused; an aborted request gives its blocks back;
* prefix caching: a second request with the same prompt computes only its last block and gives the same tokens;
* per-request sampling: a seeded request draws the same tokens alone and in a batch; ``n`` choices differ;
* stop strings cut the text (never streamed past), EOS and stop tokens end a sequence, ``max_tokens`` too;
* logprobs are the log-softmax of the step's logits.
"""

from __future__ import annotations

import pytest
import torch
from helpers import one_thread, tiny_config  # noqa: F401  (one_thread: autouse fixture)

from polyfuse.models import AutoModelForCausalLM
from polyfuse.serving import Engine, EngineConfig, SamplingParams
from polyfuse.serving.block_manager import BlockManager


class CharTokenizer:
    """ids -> letters (id 7 is EOS and decodes to nothing)."""

    eos_token_id = 7

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if (i == 7 and skip_special_tokens) else chr(97 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(cfg, seed=3).eval()


PROMPTS = [[10 + (i * 7 + j * 3) % 280 for j in range(4 + 9 * i)] for i in range(6)]
NEW = 10


@pytest.fixture(scope="module")
def reference(model):
    return [model.generate(torch.tensor([p]), max_new_tokens=NEW, ignore_eos=True)[0, len(p) :].tolist()
            for p in PROMPTS]  # fmt: skip


def engine(model, blocks=200, block_size=4, seqs=4, budget=64, mode=None, **kw):
    eng = Engine(model, CharTokenizer(), EngineConfig(128, blocks, block_size, seqs, budget, **kw))
    if mode is not None:
        eng.runner.mode = mode
    return eng


def run(eng, prompts, params, ids=None) -> dict:
    ids = ids or [str(i) for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    out = {}
    while eng.has_work():
        for d in eng.step():
            entry = out.setdefault((d.request_id, d.index), {"tokens": [], "text": "", "finish": None})
            entry["tokens"] += d.token_ids
            entry["text"] += d.text
            entry["finish"] = d.finish_reason or entry["finish"]
    return out


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


# -- block manager ---------------------------------------------------------------------------------------------------


def test_block_tables_grow_and_free():
    bm = BlockManager(9, 4)
    assert bm.usable_blocks == 8 and bm.num_free == 8
    assert bm.grow("a", 9) and bm.table("a") == [1, 2, 3]
    assert bm.grow("a", 12) and len(bm.table("a")) == 3  # still fits
    assert bm.grow("b", 16) and bm.num_free == 1
    assert not bm.grow("c", 8) and bm.table("c") == []  # nothing taken when it does not fit
    assert bm.slot("a", 5) == 2 * 4 + 1
    bm.release("a")
    assert bm.num_free == 4 and 0 not in bm.free


def test_prefix_blocks_are_shared_and_evicted_last():
    bm = BlockManager(9, 4)
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks, the last token always computed
    bm.grow("a", len(prompt))
    bm.register_prompt_blocks("a", prompt, len(prompt))
    assert bm.cached_prefix(prompt) == bm.table("a")[:2]
    assert bm.cached_prefix(prompt[:8]) == bm.table("a")[:1]  # 8 tokens: the 2nd block would hold the last one
    other = prompt[:4] + [99] + prompt[5:]
    assert bm.cached_prefix(other) == bm.table("a")[:1]  # the chain hash: block 2 differs once block 1 does
    shared = bm.table("a")[:2]
    bm.adopt("b", bm.cached_prefix(prompt))
    assert [bm.refs[b] for b in shared] == [2, 2]
    bm.release("a")
    bm.release("b")
    assert bm.cached_prefix(prompt) == shared  # freed but kept
    assert list(bm.free)[-2:] == shared[::-1]  # freed last (the first block last of all): evicted last
    bm.grow("c", 4 * 6)  # takes the 6 blocks freed before them
    assert bm.cached_prefix(prompt) == shared
    bm.grow("d", 4)  # now one of them is reused: its hash goes
    assert len(bm.cached_prefix(prompt)) < 2


def test_hash_collisions_never_share(monkeypatch):
    bm = BlockManager(9, 2)
    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda parent, tokens: 42))
    bm.grow("a", 3)
    bm.register_prompt_blocks("a", [1, 2, 3], 3)
    assert bm.cached_prefix([5, 6, 7]) == []  # same hash, other tokens
    assert bm.cached_prefix([1, 2, 9]) == bm.table("a")[:1]


# -- greedy parity -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block_size, seqs, budget, mode",
    [(4, 4, 64, None), (16, 6, 7, None), (4, 6, 64, "graphs"), (8, 3, 16, "buckets")],
    ids=["exact", "chunked-prefill", "graph-buckets", "gaudi-buckets"],
)
def test_concurrent_greedy_equals_one_at_a_time(model, reference, block_size, seqs, budget, mode):
    eng = engine(model, block_size=block_size, seqs=seqs, budget=budget, mode=mode, bucket_size=8)
    shapes, real = [], eng.runner.run
    eng.runner.run = lambda batches: shapes.extend(batches) or real(batches)
    out = run(eng, PROMPTS, GREEDY)
    for b in shapes:  # the padded shapes each mode promises
        rows, seqs_d = b.input_ids.numel(), None if b.decode is None else b.decode[0].shape[0]
        if mode == "graphs" and b.prefill is None:
            assert seqs_d in (1, 2, 4, 6) and b.decode[0].shape[1] == eng.runner.max_blocks
        if mode == "buckets":
            assert (b.prefill is None) != (b.decode is None)  # prefill and decode steps apart
            if b.prefill is not None:
                n, q = b.prefill[2].shape
                assert rows == n * q and q % 8 == 0 and n & (n - 1) == 0
            else:
                assert rows == seqs_d and seqs_d & (seqs_d - 1) == 0
            assert len(b.logits_rows) & (len(b.logits_rows) - 1) == 0
    assert [out[(str(i), 0)]["tokens"] for i in range(len(PROMPTS))] == reference
    assert all(out[(str(i), 0)]["finish"] == "length" for i in range(len(PROMPTS)))
    assert eng.blocks.num_used == 0  # every block back


def test_preemption_keeps_the_greedy_answers(model, reference):
    eng = engine(model, blocks=18, block_size=4, seqs=6, budget=32)  # 17 blocks: not enough for all at once
    out = run(eng, PROMPTS, GREEDY)
    assert eng.scheduler.preemptions > 0
    assert [out[(str(i), 0)]["tokens"] for i in range(len(PROMPTS))] == reference
    assert eng.blocks.num_used == 0


def test_a_request_that_can_never_fit_is_refused(model):
    eng = engine(model, blocks=5, block_size=4)
    with pytest.raises(ValueError, match="more KV blocks than the cache has"):
        eng.add_request("x", list(range(10, 20)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="exceed max_model_len"):
        eng.add_request("y", list(range(10, 20)), SamplingParams(max_tokens=200))


def test_abort_frees_blocks(model):
    eng = engine(model)
    eng.add_request("a", PROMPTS[3], GREEDY)
    eng.add_request("b", PROMPTS[4], GREEDY)
    eng.step()
    eng.step()
    assert eng.blocks.num_used > 0
    eng.abort("a")
    eng.abort("b")
    assert eng.blocks.num_used == 0 and not eng.has_work()


def test_prefix_cache_hit_gives_the_same_tokens(model, reference):
    eng = engine(model, block_size=4)
    first = run(eng, [PROMPTS[5]], GREEDY, ids=["first"])
    computed = []
    real = eng.runner.run
    eng.runner.run = lambda batches: computed.append(sum(b.input_ids.numel() for b in batches)) or real(batches)
    second = run(eng, [PROMPTS[5]], GREEDY, ids=["second"])
    n = len(PROMPTS[5])
    assert eng.blocks.hit_tokens == (n - 1) // 4 * 4
    assert computed[0] == n - eng.blocks.hit_tokens  # only the uncached tail is prefilled
    assert first[("first", 0)]["tokens"] == second[("second", 0)]["tokens"] == reference[5]


# -- sampling, stopping, logprobs ----------------------------------------------------------------------------------


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=1234, ignore_eos=True)
    alone = run(engine(model), [PROMPTS[2]], params)[("0", 0)]["tokens"]
    noisy = SamplingParams(max_tokens=8, temperature=1.3, ignore_eos=True)
    eng = engine(model)
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(f"n{i}", p, noisy)
    batch = run(eng, [PROMPTS[2]], params, ids=["s"])
    assert batch[("s", 0)]["tokens"] == alone


def test_n_choices_share_the_prompt_and_differ(model):
    eng = engine(model, block_size=4)
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5, ignore_eos=True)
    out = run(eng, [PROMPTS[5]], params)
    choices = [out[("0", i)]["tokens"] for i in range(3)]
    assert all(len(c) == 8 for c in choices) and len({tuple(c) for c in choices}) == 3
    assert eng.blocks.hit_tokens == 2 * ((len(PROMPTS[5]) - 1) // 4 * 4)  # choices 2 and 3 from the cache


def test_stop_string_cuts_the_text(model, reference):
    text = CharTokenizer().decode(reference[4])
    stop = text[3:5]
    out = run(engine(model), [PROMPTS[4]], SamplingParams(max_tokens=NEW, temperature=0.0, stop=(stop,),
                                                          ignore_eos=True))[("0", 0)]  # fmt: skip
    cut = text.find(stop)
    assert out["finish"] == "stop" and out["text"] == text[:cut]
    assert out["tokens"] == reference[4][: cut + len(stop)]


def test_eos_and_stop_tokens_end_a_sequence(model, reference):
    tok = reference[1][4]
    out = run(engine(model), [PROMPTS[1]], SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=(tok,),
                                                          ignore_eos=True))[("0", 0)]  # fmt: skip
    assert out["finish"] == "stop" and out["tokens"] == reference[1][: reference[1].index(tok) + 1]
    short = run(engine(model), [PROMPTS[1]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert short[("0", 0)]["tokens"] == reference[1][:3] and short[("0", 0)]["finish"] == "length"


def test_logprobs_are_the_log_softmax(model):
    eng = engine(model)
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, ignore_eos=True))
    (delta,) = eng.step()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    lp = torch.log_softmax(logits.float(), -1)
    token, own, alts = delta.logprobs[0]
    assert token == int(lp.argmax()) and abs(own - float(lp.max())) < 1e-4
    assert [a for a, _ in alts] == lp.topk(3).indices.tolist()
    assert all(abs(b - float(lp[a])) < 1e-4 for a, b in alts)


def test_cuda_graph_buckets_captured_once_at_warmup(model, reference, monkeypatch):
    """The runner's CUDA-graph path on the CPU: torch.cuda's graph API faked (tests/helpers.py), the decode step
    wrapped by the real GraphedStep. warmup() captures one graph per batch bucket; serving then only replays them
    (the batch copied into the graphs' static buffers) and the tokens stay the same."""
    from helpers import Recorded, fake_cuda_graphs

    from polyfuse.backends.cuda.graphs import GraphedStep

    fake_cuda_graphs(monkeypatch)
    eng = engine(model, block_size=4, seqs=6, budget=64, mode="graphs")
    step = GraphedStep(Recorded(eng.runner.module, inplace=False))
    eng.runner.decode_step = step
    eng.runner.warmup()
    assert len(step.graphs) == len(eng.runner.buckets) == len([1, 2, 4, 6])
    replays = []
    for entry in step.graphs.values():
        graph = entry[2]
        real = graph.replay
        graph.replay = lambda real=real: replays.append(1) or real()
    out = run(eng, PROMPTS, GREEDY)
    assert [out[(str(i), 0)]["tokens"] for i in range(len(PROMPTS))] == reference
    assert len(step.graphs) == 4 and len(replays) >= NEW - 1  # no capture after the warm-up


@pytest.mark.cuda
@pytest.mark.parametrize("flags", [{}, {"use_cuda_graphs": True}], ids=["eager", "cuda-graphs"])
def test_gpu_serving_greedy_equals_generate(flags):
    """On an NVIDIA GPU: the Triton paged kernels (decode and prefill chunks) and, with --use_cuda_graphs, the
    graphed decode buckets give generate()'s greedy tokens (float32, each prompt alone) for concurrent requests."""
    cfg = tiny_config(num_key_value_heads=2, max_position_embeddings=512, hidden_size=256, intermediate_size=512)
    model = AutoModelForCausalLM.from_config(cfg, seed=3, device="cuda", flags=flags).eval()
    chain = [i.name for i in model.kernels.choices["paged_attention"].chain]
    assert chain[:2] == ["triton_paged_decode", "triton_paged_prefill"]
    prompts = [[10 + (i * 7 + j * 3) % 280 for j in range(4 + 37 * i)] for i in range(8)]
    want = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, ignore_eos=True)[0, len(p):].tolist()
            for p in prompts]  # fmt: skip
    eng = Engine(model, CharTokenizer(), EngineConfig(512, 400, 16, 8, 96))  # chunked: 96 tokens a step
    eng.runner.warmup()
    out = run(eng, prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [out[(str(i), 0)]["tokens"] for i in range(8)] == want
    assert eng.runner.mode == ("graphs" if flags else "exact")
