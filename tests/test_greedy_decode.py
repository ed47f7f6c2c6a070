"""Greedy decoding through generation.TokenStep: one in-place call per token, the same ids as a plain loop of
model.step + argmax (EOS rows padded, generation stopping where the last row finished); and GraphedStep(inplace=True)
around it, with torch.cuda's graph API faked on the CPU (a capture records the step, a replay runs it)."""

import contextlib
import gc

import pytest
import torch
from helpers import FakeGraph, Recorded, decode_llama, fake_cuda_graphs

from polyfuse.backends.cuda.graphs import GraphedStep
from polyfuse.core.runtime import Step
from polyfuse.generation.hooks import PhaseTimer
from polyfuse.generation.kv_cache import bucketed, ensure_cache
from polyfuse.generation.steps import TokenStep, forget_steps
from polyfuse.generation.token_state import TokenState


@pytest.fixture(scope="module")
def model():
    return decode_llama()


@pytest.fixture(autouse=True)
def fresh_steppers(model):
    forget_steps(model)
    yield
    forget_steps(model)


IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [0, 16, 17, 18, 19, 20, 21]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]])


@torch.inference_mode()
def reference(model, ids, mask, max_new_tokens, eos=(), pad=0, bucket_size=-1):
    """What generate() returns, written out: model.step + argmax per token, EOS rows padded, stop once all done."""
    b, n = ids.shape
    ensure_cache(model, b, bucketed(n + max_new_tokens, bucket_size, 100))
    max_len = model.cache.max_len
    key_mask = torch.ones(b, max_len, dtype=torch.bool)
    key_mask[:, :n] = mask.bool()
    pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits = model.step(ids, pos, torch.arange(n), key_mask, n)
    pos = pos[:, -1:] + 1
    finished = torch.zeros(b, dtype=torch.bool)
    new = []
    for i in range(max_new_tokens):
        tok = torch.where(finished, pad, logits.argmax(-1))
        finished |= torch.isin(tok, torch.tensor(list(eos), dtype=torch.long))
        new.append(tok)
        if eos and bool(finished.all()):
            break
        kv_len = bucketed(n + i + 1, bucket_size, max_len) if bucket_size > 0 else max_len
        logits = model.step(tok[:, None], pos, torch.tensor([n + i]), key_mask, kv_len)
        pos = pos + 1
    return torch.cat([ids, torch.stack(new, 1)], 1)


def _first_eos(out, n, eos):
    """Per row, the index of the first new token that is an EOS id (None: never)."""
    hits = torch.isin(out[:, n:], torch.tensor(list(eos)))
    return [int(h.nonzero()[0]) if h.any() else None for h in hits]


def _old_path(model, *args, **kw):
    """generate() through the per-token loop (StepModule + argmax outside), as on runtimes without in-place decode."""
    model.runtime.inplace_decode = False
    forget_steps(model)
    try:
        return model.generate(*args, **kw)
    finally:
        del model.runtime.inplace_decode
        forget_steps(model)


@pytest.mark.parametrize("bucket_size", [-1, 8])
def test_greedy_matches_reference_loop(model, bucket_size):
    want = reference(model, IDS, MASK, 30, bucket_size=bucket_size)
    timer = PhaseTimer(model.runtime)
    got = model.generate(IDS, MASK, max_new_tokens=30, ignore_eos=True, bucket_size=bucket_size, hooks=timer)
    assert torch.equal(got, want)
    assert timer.new_tokens == 30 and timer.first_token_s > 0 and timer.rest_s > 0
    assert torch.equal(_old_path(model, IDS, MASK, max_new_tokens=30, ignore_eos=True, bucket_size=bucket_size), want)


def test_one_token_step_call_per_token(model, monkeypatch):
    calls, marks = [], []
    real = TokenStep.forward
    monkeypatch.setattr(TokenStep, "forward", lambda self, kv_len, *a: calls.append(kv_len) or real(self, kv_len, *a))
    monkeypatch.setattr(model.runtime, "mark_step", lambda: marks.append(1))
    out = model.generate(IDS, MASK, max_new_tokens=20, ignore_eos=True, bucket_size=8)
    assert out.shape == (3, 27)
    assert calls == [bucketed(7 + i + 1, 8, 32) for i in range(19)]  # every token but the prefill's; KV buckets grow
    assert sorted(set(calls)) == [8, 16, 24, 32]
    assert len(marks) == 20  # the lazy-mode step boundary: once per token


def test_rows_finishing_at_different_steps(model):
    free = reference(model, IDS, MASK, 30)
    # Row 0 stops at its 10th new token, row 2 at its 19th (checks every 8 tokens: the loop runs on to 24, trims).
    eos = (int(free[0, 7 + 9]), int(free[2, 7 + 18]))
    want = reference(model, IDS, MASK, 30, eos=eos, pad=0)
    stops = _first_eos(want, 7, eos)
    assert stops[0] is not None and stops[2] is not None and len(set(stops)) > 1, f"scenario not met: {stops}"
    timer = PhaseTimer()
    got = model.generate(IDS, MASK, max_new_tokens=30, eos_token_id=list(eos), pad_token_id=0, hooks=timer)
    assert torch.equal(got, want)
    assert timer.timings["new_tokens"] == want.shape[1] - 7
    assert torch.equal(_old_path(model, IDS, MASK, max_new_tokens=30, eos_token_id=list(eos), pad_token_id=0), want)


def test_all_rows_finish_early_output_trimmed(model):
    free = reference(model, IDS, MASK, 30)
    eos = tuple(int(t) for t in free[:, 7 + 10])  # every row has an EOS id by its 11th new token
    for pad in (0, eos[0]):  # a pad that is not an EOS id, and one that is (the default)
        want = reference(model, IDS, MASK, 30, eos=eos, pad=pad)
        assert want.shape[1] <= 7 + 11, "scenario not met: generation did not stop early"
        got = model.generate(IDS, MASK, max_new_tokens=30, eos_token_id=list(eos), pad_token_id=pad, bucket_size=4)
        assert torch.equal(got, want)
    # Finished on the very first token: nothing is decoded past it.
    first = tuple(int(t) for t in free[:, 7])
    assert torch.equal(model.generate(IDS, MASK, max_new_tokens=30, eos_token_id=list(first)), free[:, :8])


def test_state_and_graph_key_reused_across_calls(model):
    a = model.generate(IDS, MASK, max_new_tokens=12, ignore_eos=True)
    cache = model.cache
    b = model.generate(IDS[:, 1:], MASK[:, 1:], max_new_tokens=12, ignore_eos=True)  # same cache, shorter prompt
    assert model.cache is cache
    assert torch.equal(b, reference(model, IDS[:, 1:], MASK[:, 1:], 12))
    assert torch.equal(model.generate(IDS, MASK, max_new_tokens=12, ignore_eos=True), a)


# -- GraphedStep(inplace=True) with a fake torch.cuda graph API --------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    fake_cuda_graphs(monkeypatch)


def _graph_token_steps(model, monkeypatch):
    """Make the model's runtime wrap the token step as the CUDA runtime does under --use_cuda_graphs."""
    made = []

    def graph_module(module, phase, flags):
        if phase != "token":
            return Step(module)
        made.append(GraphedStep(Recorded(module), inplace=True))
        return made[-1]

    monkeypatch.setattr(model.runtime, "graph_module", graph_module)
    return made


def test_graphed_token_step_replays_in_place(model, fake_cuda, monkeypatch):
    made = _graph_token_steps(model, monkeypatch)
    eos = (int(reference(model, IDS, MASK, 30)[0, 7 + 12]),)
    kw = dict(max_new_tokens=30, bucket_size=8, eos_token_id=list(eos), pad_token_id=0)
    want = reference(model, IDS, MASK, 30, eos=eos, bucket_size=8)
    got = model.generate(IDS, MASK, **kw)
    # Without undoing the two warm-up runs every replay would run two tokens ahead of the loop: at a KV bucket too
    # short for its position, and past the end of the cache.
    assert torch.equal(got, want)
    assert int(TokenState.of(model.cache).cache_position) == 7 + 30 - 1  # the last token fed in
    (step,) = made
    assert step.disabled_reason is None and sorted(k[0] for k in step.graphs) == [8, 16, 24, 32, 40]
    runs = step.fn.runs
    assert runs == 2 * 5  # only the warm-ups ran outside replays
    assert torch.equal(model.generate(IDS, MASK, **kw), want)  # same cache, same buffers: replays only
    assert step.fn.runs == runs and len(step.graphs) == 5
    one = model.generate(IDS[:1], MASK[:1], max_new_tokens=5, ignore_eos=True)  # another cache: captured anew
    assert torch.equal(one, reference(model, IDS[:1], MASK[:1], 5))
    (key,) = step.graphs
    assert key[1][0] == (1, 1) and key[1][3] == TokenState.of(model.cache).tok.data_ptr()  # the buffers' address


def test_graphed_token_step_capture_failure_runs_eagerly(model, fake_cuda, monkeypatch, caplog):
    made = _graph_token_steps(model, monkeypatch)

    @contextlib.contextmanager
    def broken(graph, pool=None):
        raise RuntimeError("capture not supported here")
        yield

    monkeypatch.setattr(torch.cuda, "graph", broken)
    model.cache = None
    want = reference(model, IDS, MASK, 16)
    with caplog.at_level("WARNING", logger="polyfuse"):
        got = model.generate(IDS, MASK, max_new_tokens=16, ignore_eos=True)
    assert torch.equal(got, want)
    assert int(TokenState.of(model.cache).cache_position) == 7 + 16 - 1  # the warm-ups were undone before the fallback
    assert made[0].disabled_reason.startswith("RuntimeError") and not made[0].graphs
    assert sum("capture failed" in r.message for r in caplog.records) == 1


def test_no_garbage_collection_inside_a_capture(fake_cuda, monkeypatch):
    # A collected cycle that holds an old CUDA graph resets it mid-capture and breaks the new capture.
    seen = []

    def step(kv_len, x):
        seen.append((FakeGraph.capturing is not None, gc.isenabled()))
        return x * 2

    graphed = GraphedStep(step)
    x = torch.ones(3)
    assert torch.equal(graphed(4, x), x * 2)
    assert seen == [(False, True), (False, True), (True, False)]  # two warm-ups, then the capture
    assert gc.isenabled() and graphed.disabled_reason is None

    @contextlib.contextmanager
    def broken(graph, pool=None):
        raise RuntimeError("capture not supported here")
        yield

    monkeypatch.setattr(torch.cuda, "graph", broken)
    assert torch.equal(GraphedStep(step)(4, x), x * 2)
    assert gc.isenabled()  # restored after a failed capture too
