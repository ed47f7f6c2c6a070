"""Multi-step decoding (``--num_scheduler_steps N``) in the serving engine, on the CPU with a tiny random Llama.

* mixed requests (lengths, ``max_tokens``, stop strings, stop tokens, logprobs, seeded sampling): the tokens, texts,
  finish reasons and logprobs of N = 2, 4 and 8 equal N = 1's, in every runner mode (the CPU's exact shapes, CUDA
  graphs' buckets, Gaudi's buckets), with preemption too; chains of N steps ran, fed on the device (one read-back
  per chain); block tables cover the computed tokens after every step and every block comes back;
* an answer ending inside a chain (EOS, stop string, ``max_tokens``) returns nothing past its end;
* a request arriving while a batch decodes is admitted at the next scheduling, not after the batch finishes;
* the flag: bad values and the combination with speculative decoding are one error each.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import one_thread, tiny_config  # noqa: F401  (one_thread: autouse fixture)
from test_serving_engine import PROMPTS, CharTokenizer

from polyfuse.models import AutoModelForCausalLM
from polyfuse.serving import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(cfg, seed=3).eval()


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def engine(model, steps, blocks=200, block_size=4, seqs=4, budget=64, mode=None):
    eng = Engine(model, CharTokenizer(), EngineConfig(128, blocks, block_size, seqs, budget, bucket_size=8,
                                                      num_scheduler_steps=steps))  # fmt: skip
    if mode is not None:
        eng.runner.mode = mode
    return eng


def requests(reference: dict) -> list:
    """(id, prompt, params): every kind of end, some ending inside a chain of 4, a seeded sampled one."""
    decode = CharTokenizer().decode
    out = []
    for i, p in enumerate(PROMPTS):
        ref = reference[i]
        out.append((f"len{i}", p, dataclasses.replace(GREEDY, max_tokens=3 + 2 * i)))
        out.append((f"tok{i}", p, dataclasses.replace(GREEDY, max_tokens=20, stop_token_ids=(ref[2 + i],))))
        text = decode(ref)
        out.append((f"str{i}", p, dataclasses.replace(GREEDY, max_tokens=20, stop=(text[5 + i : 7 + i],))))
    out.append(("lp", PROMPTS[2], dataclasses.replace(GREEDY, max_tokens=9, logprobs=2)))
    out.append(("seeded", PROMPTS[3], SamplingParams(max_tokens=11, temperature=0.8, top_k=30, seed=9,
                                                     ignore_eos=True)))  # fmt: skip
    out.append(("eos", PROMPTS[4], SamplingParams(max_tokens=20, temperature=0.0)))  # EOS (7) may end it
    return out


@pytest.fixture(scope="module")
def reference(model):
    return {i: model.generate(torch.tensor([p]), max_new_tokens=20, ignore_eos=True)[0, len(p) :].tolist()
            for i, p in enumerate(PROMPTS)}  # fmt: skip


def serve(eng, reqs) -> dict:
    """Every request's tokens, text, finish reason and logprobs; checks the block tables after every step."""
    for rid, p, params in reqs:
        eng.add_request(rid, p, params)
    out, done = {}, {}
    real = eng.scheduler.finish
    eng.scheduler.finish = lambda seq, reason: done.update({seq.request_id: seq}) or real(seq, reason)
    while eng.has_work():
        for d in eng.step():
            e = out.setdefault(d.request_id, {"tokens": [], "text": "", "finish": None})
            e["tokens"] += d.token_ids
            e["text"] += d.text
            e["finish"] = d.finish_reason or e["finish"]
        for s in eng.scheduler.running:
            assert len(eng.blocks.table(s.seq_id)) == eng.blocks.blocks_for(s.computed)
    for rid, seq in done.items():
        out[rid]["logprobs"] = seq.logprobs
    assert eng.blocks.num_used == 0
    return out


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        x, y = dict(a[rid]), dict(b[rid])
        lx, ly = x.pop("logprobs"), y.pop("logprobs")
        assert x == y, rid
        assert [t for t, _, _ in lx] == [t for t, _, _ in ly]
        for (_, own_x, alts_x), (_, own_y, alts_y) in zip(lx, ly):
            assert abs(own_x - own_y) < 1e-4 and [t for t, _ in alts_x] == [t for t, _ in alts_y]


@pytest.mark.parametrize("mode", [None, "graphs", "buckets"], ids=["exact", "graph-buckets", "gaudi-buckets"])
def test_multi_step_equals_single_step(model, reference, mode):
    reqs = requests(reference)
    want = serve(engine(model, 1, mode=mode), reqs)
    assert want["eos"]["finish"] in ("stop", "length") and all(want[f"str{i}"]["finish"] == "stop" for i in range(6))
    for n in (2, 4, 8):
        eng = engine(model, n, mode=mode)
        chains, real = [], eng.runner.run_chain
        eng.runner.run_chain = lambda batches, choose: chains.append(len(batches)) or real(batches, choose)
        got = serve(eng, reqs)
        same(got, want)
        assert chains and max(chains) == n and sum(chains) > len(chains) * 1.5, chains


def test_one_host_read_back_per_chain(model, monkeypatch):
    """Greedy decodes: the chain's steps feed each other on the device; the tokens come back once, at its end."""
    eng = engine(model, 4, budget=128)
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(str(i), p, dataclasses.replace(GREEDY, max_tokens=13))
    eng.step()  # the prefills
    reads = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, real=real, name=name: reads.append(name) or real(self, *a)
        )
    calls = []
    while eng.has_work():
        before = len(reads)
        chain = eng.stats.steps
        eng.step()
        calls.append((eng.stats.steps - chain, len(reads) - before))
    monkeypatch.undo()
    assert calls == [(4, 1), (4, 1), (4, 1)], calls  # 12 tokens after the first, chains of 4, one read-back each


def test_an_answer_ending_inside_a_chain_returns_nothing_past_its_end(model, reference):
    """Stops chosen so the completing token is the 2nd or 3rd of a chain of 4: later tokens of the chain dropped."""
    eng = engine(model, 4)
    dropped, real = [], eng._emit

    def emit(seq, tokens, logprobs, now):
        delta = real(seq, tokens, logprobs, now)
        if len(delta.token_ids) < len(tokens):
            dropped.append(seq.request_id)
        return delta

    eng._emit = emit
    decode = CharTokenizer().decode
    reqs = []
    for i, p in enumerate(PROMPTS):  # alone in the batch: chains start at its 2nd token (the 1st is the prefill's)
        ref = reference[i]
        reqs.append((f"tok{i}", p, dataclasses.replace(GREEDY, max_tokens=20, stop_token_ids=(ref[2],))))
        text = decode(ref)
        reqs.append((f"str{i}", p, dataclasses.replace(GREEDY, max_tokens=20, stop=(text[1:3],))))
    for rid, p, params in reqs:
        out = serve(eng, [(rid, p, params)])[rid]
        ref = reference[int(rid[3:])]
        if rid.startswith("tok"):
            end = ref.index(params.stop_token_ids[0]) + 1
            assert out["tokens"] == ref[:end] and out["finish"] == "stop"
        else:
            text = decode(ref)
            cut = text.find(params.stop[0])
            assert out["text"] == text[:cut] and out["finish"] == "stop"
            assert len(decode(out["tokens"])) == cut + 2  # up to the token completing the stop
    assert len(dropped) >= 6, dropped


def test_preemption_with_multi_step(model):
    reqs = [(str(i), p, dataclasses.replace(GREEDY, max_tokens=20)) for i, p in enumerate(PROMPTS)]
    want = serve(engine(model, 1, blocks=40, seqs=6, budget=32), reqs)
    eng = engine(model, 4, blocks=40, seqs=6, budget=32)
    same(serve(eng, reqs), want)
    assert eng.scheduler.preemptions > 0


def test_a_new_request_joins_at_the_next_scheduling(model):
    eng = engine(model, 8)
    eng.add_request("a", PROMPTS[1], dataclasses.replace(GREEDY, max_tokens=40))
    eng.step()  # its prefill
    eng.step()  # a chain of 8
    assert len(eng.requests["a"][0].output) == 9
    eng.add_request("b", PROMPTS[2], GREEDY)
    eng.step()
    (b,) = eng.requests["b"]
    assert b.computed == len(PROMPTS[2]) and len(b.output) == 1  # prefilled in the very next step


def test_flags():
    from polyfuse.cli.generate import UsageError
    from polyfuse.serving.cli import build_parser, validate

    assert build_parser().parse_args(["--num-scheduler-steps", "4"]).num_scheduler_steps == 4
    for argv, needle in [
        (["--num_scheduler_steps", "0"], "must be in 1..64"),
        (["--num_scheduler_steps", "4", "--prompt_lookup_num_tokens", "3"], "give one of them"),
    ]:
        with pytest.raises(UsageError, match=needle):
            validate(build_parser().parse_args(argv))
    from polyfuse.generation.speculative.settings import SpeculativeSetting

    with pytest.raises(ValueError, match="1 with speculative decoding"):
        Engine(None, None, EngineConfig(16, 4, speculative=SpeculativeSetting("prompt_lookup", 2),
                                        num_scheduler_steps=2))  # fmt: skip
