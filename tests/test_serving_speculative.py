"""Speculative decoding (prompt lookup) in the serving engine, on the CPU.

* tiny random Llama: greedy tokens with speculation equal generate()'s for each prompt alone, with the batch shapes
  of every runner mode, chunked prefill and preemption; drafts were accepted and rejected; after every step each
  sequence's block table covers exactly its computed tokens (rollback frees the blocks only rejected drafts filled)
  and every block is back at the end;
* several tokens a step: stop tokens, stop strings and ``max_tokens`` cut exactly where they cut without
  speculation, the text pieces concatenate to the text, logprobs are those without speculation;
* sampling: the tokens after the prompt have the target's exact distribution (chi-square on a fixed seed), and the
  same test catches a rule that accepts every draft;
* the built-in model over HTTP (``--speculative_method ngram``): 8 concurrent mixed requests answer as a server
  without speculation on the same weights; streaming, stops, usage, /metrics and the blocks coming back.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import one_thread, start_server, stop_server, tiny_config  # noqa: F401  (one_thread: autouse fixture)
from speculative_cases import tiny
from test_serving_engine import CharTokenizer, run
from test_speculative import SMALL, accept_all, chi_square_p

import polyfuse.serving.speculation as speculation
from polyfuse.generation.speculative.settings import SpeculativeSetting
from polyfuse.models import AutoModelForCausalLM
from polyfuse.serving import Engine, EngineConfig, SamplingParams


def lookup(k: int = 4, ngram: int = 2) -> SpeculativeSetting:
    return SpeculativeSetting("prompt_lookup", k, ngram)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(cfg, seed=3).eval()


# prompts with repeated spans, so that prompt lookup finds matches from the start
PROMPTS = [[10 + (i * 7 + j * 3) % 280 for j in range(4 + 9 * i)] * 2 for i in range(6)]
NEW = 30


@pytest.fixture(scope="module")
def reference(model):
    return [model.generate(torch.tensor([p]), max_new_tokens=NEW, ignore_eos=True)[0, len(p) :].tolist()
            for p in PROMPTS]  # fmt: skip


def engine(model, spec=None, blocks=200, block_size=4, seqs=4, budget=64, mode=None, **kw):
    eng = Engine(model, CharTokenizer(), EngineConfig(128, blocks, block_size, seqs, budget, speculative=spec, **kw))
    if mode is not None:
        eng.runner.mode = mode
    return eng


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def checked_run(eng, prompts, params) -> dict:
    """``run``, asserting after every step that each running sequence holds the blocks of its computed tokens."""
    real = eng.step

    def step():
        deltas = real()
        for s in eng.scheduler.running:
            assert len(eng.blocks.table(s.seq_id)) == eng.blocks.blocks_for(s.computed), (s.computed, s.num_tokens)
            assert s.computed == s.num_tokens - 1 or s.prefilling or s.preemptions
        return deltas

    eng.step = step
    return run(eng, prompts, params)


# -- greedy --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block_size, seqs, budget, blocks, mode, k",
    [(4, 4, 64, 200, None, 4), (2, 6, 64, 400, None, 10), (16, 6, 7, 200, None, 4), (4, 6, 64, 200, "graphs", 4),
     (8, 3, 16, 200, "buckets", 3), (4, 6, 32, 36, None, 4)],
    ids=["exact", "small-blocks", "chunked-prefill", "graph-buckets", "gaudi-buckets", "preemption"],
)  # fmt: skip
def test_greedy_with_speculation_equals_without(model, reference, block_size, seqs, budget, blocks, mode, k):
    eng = engine(model, lookup(k), blocks=blocks, block_size=block_size, seqs=seqs, budget=budget, mode=mode,
                 bucket_size=8)  # fmt: skip
    shrunk, real = [], eng.blocks.shrink
    eng.blocks.shrink = lambda sid, n: (
        shrunk.append(len(eng.blocks.table(sid)) - eng.blocks.blocks_for(n)) or real(sid, n)
    )
    out = checked_run(eng, PROMPTS, GREEDY)
    assert [out[(str(i), 0)]["tokens"] for i in range(len(PROMPTS))] == reference
    spec = eng.spec
    assert spec.accepted > 20 and spec.drafted - spec.accepted > 20, spec  # both, many
    assert eng.stats.generation_tokens == len(PROMPTS) * NEW
    if blocks == 36:
        assert eng.scheduler.preemptions > 0
    if block_size == 2:
        assert sum(shrunk) > 5  # rollbacks that emptied blocks gave them back
    assert eng.blocks.num_used == 0 and not eng.has_work()


def test_fewer_steps_than_tokens(model, reference):
    plain, spec = engine(model), engine(model, lookup(4))
    run(plain, PROMPTS[:2], GREEDY)
    run(spec, PROMPTS[:2], GREEDY)
    assert spec.stats.steps < plain.stats.steps
    s = spec.spec
    assert s.tokens_per_step == pytest.approx((s.accepted + s.decode_steps) / s.decode_steps) and s.tokens_per_step > 1


# -- several tokens a step: where the answers end ---------------------------------------------------------------


def mid_chunk_stops(model, reference) -> list:
    """(request, stop string) pairs whose stop is completed by a token in the middle of what one step of a
    speculative run added (its first occurrence), so the tokens accepted after it must be dropped."""
    eng, chunks = engine(model, lookup(6), blocks=400, seqs=16, budget=256), {}
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, GREEDY)
    while eng.has_work():
        for d in eng.step():
            chunks.setdefault(int(d.request_id), []).append(len(d.token_ids))
    found = []
    for i, sizes in chunks.items():
        decode = CharTokenizer().decode
        text, at = decode(reference[i]), 0
        char_of = [len(decode(reference[i][: t + 1])) - 1 for t in range(len(reference[i]))]
        for n in sizes:
            end = char_of[at + n // 2]  # the character of a middle token of the chunk
            at += n
            if n < 3 or not decode([reference[i][at - n + n // 2]]):
                continue
            for length in (2, 3, 4, 5):
                stop = text[end - length + 1 : end + 1]
                if end - length + 1 >= 0 and text.find(stop) == end - length + 1:
                    found.append((i, stop))
                    break
    return found


def test_stops_and_max_tokens_with_several_tokens_a_step(model, reference):
    """Every request of one batch ends somewhere else; each ends exactly where it ends without speculation (the
    references: one token per character), accepted tokens past its end dropped."""
    cases, want = [], {}
    decode = CharTokenizer().decode
    stops = [(i, decode(ref)[c : c + 2]) for i, ref in enumerate(reference) for c in (3, 12)]
    for n, (i, stop) in enumerate(stops + mid_chunk_stops(model, reference)):
        ref, text = reference[i], decode(reference[i])
        cut = text.find(stop)
        token_of = [t for t, tok in enumerate(ref) if decode([tok])]  # the token of each character (EOS has none)
        cases.append((f"str{n}", PROMPTS[i], dict(stop=(stop,))))
        want[f"str{n}"] = (ref[: token_of[cut + len(stop) - 1] + 1], text[:cut], "stop")
    for i, ref in enumerate(reference):
        for c in (3, 7, 12, 20):
            tok = ref[c]
            cases.append((f"tok{i}-{c}", PROMPTS[i], dict(stop_token_ids=(tok,))))
            want[f"tok{i}-{c}"] = (ref[: ref.index(tok) + 1], decode(ref[: ref.index(tok)]), "stop")
            cases.append((f"len{i}-{c}", PROMPTS[i], dict(max_tokens=c)))
            want[f"len{i}-{c}"] = (ref[:c], decode(ref[:c]), "length")
    eng = engine(model, lookup(6), blocks=600, seqs=16, budget=256)
    dropped, real = [], eng._emit

    def emit(seq, tokens, logprobs, now):
        delta = real(seq, tokens, logprobs, now)
        if len(delta.token_ids) < len(tokens):
            dropped.append(seq.request_id)  # accepted tokens after the end: not added
        return delta

    eng._emit = emit
    for rid, prompt, kw in cases:
        eng.add_request(rid, prompt, dataclasses.replace(GREEDY, **kw))
    out = run(eng, [], GREEDY)
    for rid, (tokens, text, finish) in want.items():
        got = out[(rid, 0)]
        assert (got["tokens"], got["text"], got["finish"]) == (tokens, text, finish), rid
    assert len(dropped) >= 5, dropped
    assert eng.blocks.num_used == 0


def test_logprobs_are_those_without_speculation(model):
    params = dataclasses.replace(GREEDY, logprobs=3)
    got = []
    for spec in (None, lookup(4)):
        eng, done = engine(model, spec), {}
        real = eng.scheduler.finish
        eng.scheduler.finish = lambda seq, reason, real=real, done=done: (
            done.update({seq.request_id: seq}) or real(seq, reason)
        )
        run(eng, PROMPTS[2:4], params)
        got.append({rid: seq.logprobs for rid, seq in done.items()})
    plain, spec = got
    for rid in ("0", "1"):
        assert [t for t, _, _ in spec[rid]] == [t for t, _, _ in plain[rid]] and len(spec[rid]) == NEW
        for (_, own_s, alts_s), (_, own_p, alts_p) in zip(spec[rid], plain[rid]):
            assert abs(own_s - own_p) < 1e-4
            assert [a for a, _ in alts_s] == [a for a, _ in alts_p]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(alts_s, alts_p))


# -- sampling: the target's distribution --------------------------------------------------------------------------


PROMPT = list(range(16)) + [3, 4, 5, 3, 4]  # every token occurs: prompt lookup always drafts
SAMPLES, TEMPERATURE, MAX_TOKENS = 6000, 2.5, 4


@pytest.fixture(scope="module")
def small():
    return tiny("llama", seed=21, **SMALL)


def exact(target) -> list:
    """p(x2), p(x3), p(x4) and p(x2, x3) after PROMPT and any x1, at TEMPERATURE, by enumeration."""
    v = target.config.vocab_size

    def probs(prefixes):
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        with torch.no_grad():
            return (target(ids).logits[:, -1].double() / TEMPERATURE).softmax(-1)

    p1 = probs([()])[0]
    j2 = p1[:, None] * probs([(a,) for a in range(v)])  # [x1, x2]
    j3 = j2[..., None] * probs([(a, b) for a in range(v) for b in range(v)]).view(v, v, v)
    p4 = j3[..., None] * probs([(a, b, c) for a in range(v) for b in range(v) for c in range(v)]).view(v, v, v, v)
    return [j2.sum(0), j3.sum((0, 1)), p4.sum((0, 1, 2)), j3.sum(0)]


def sampled(target, k: int = 3):
    eng = Engine(target, CharTokenizer(), EngineConfig(32, 3000, 4, 256, 8192, seed=7, speculative=lookup(k)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, ignore_eos=True)
    out = run(eng, [PROMPT] * SAMPLES, params)
    tokens = torch.tensor([out[(str(i), 0)]["tokens"] for i in range(SAMPLES)])
    assert eng.blocks.num_used == 0
    return tokens, eng.spec


def p_values(target, tokens) -> list:
    v = target.config.vocab_size
    counts = [torch.bincount(tokens[:, j], minlength=v) for j in (1, 2, 3)]
    pairs = torch.bincount(tokens[:, 1] * v + tokens[:, 2], minlength=v * v)
    return [chi_square_p(c, SAMPLES * p) for c, p in zip((*counts, pairs), exact(target))]


def test_sampling_keeps_the_target_distribution(small):
    """6000 answers of 4 tokens: tokens 2 to 4 come from verify steps (k drafts from the prompt); per position and
    tokens 2 and 3 jointly, their counts against the target's exact distribution."""
    tokens, spec = sampled(small)
    assert spec.accepted > 500 and spec.drafted - spec.accepted > 500, spec
    ps = p_values(small, tokens)
    assert min(ps) > 1e-3, ps


def test_the_chi_square_test_catches_accepting_every_draft(small, monkeypatch):
    monkeypatch.setattr(speculation, "sampled_accept", accept_all)
    tokens, _ = sampled(small)
    assert min(p_values(small, tokens)) < 1e-6


# -- the built-in model over HTTP ---------------------------------------------------------------------------------


PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and wrote the "
           "weather in a leather notebook.")  # fmt: skip
REQUESTS = [
    dict(chat=True, content=f"Repeat this sentence exactly: {PASSAGE}"),
    dict(chat=True, content=f"Rewrite in the past tense, keeping every other word: {PASSAGE}", stream=True),
    dict(chat=True, content=f"Copy this text: {PASSAGE}", stop=["lamp"]),
    dict(chat=True, content="What is the capital of France?", logprobs=True, top_logprobs=2),
    dict(chat=False, prompt=f"{PASSAGE}\nThe same sentence again:\n{PASSAGE[:40]}", stream=True),
    dict(chat=False, prompt="def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", max_tokens=20),
    dict(chat=True, content="Name three colors.", n=2, temperature=0),
    dict(chat=True, content=f"Say it twice: {PASSAGE}", max_tokens=13),
]


@pytest.fixture(scope="module")
def servers():
    """Two servers on 127.0.0.1 (ephemeral ports) over one model: with prompt lookup (k=4) and without."""
    from polyfuse.serving.cli import build_parser
    from polyfuse.serving.server import build

    flags = ["--port", "0", "--max_model_len", "512", "--num_kv_blocks", "300", "--max_num_seqs", "8",
             "--max_num_batched_tokens", "256"]  # fmt: skip
    args = build_parser().parse_args([*flags, "--speculative_method", "ngram", "--prompt_lookup_num_tokens", "4"])
    spec_engine, name, _ = build(args)
    plain_engine = Engine(spec_engine.model, spec_engine.tokenizer,
                          dataclasses.replace(spec_engine.config, speculative=None))  # fmt: skip
    out, running = {}, []
    for key, eng in (("spec", spec_engine), ("plain", plain_engine)):
        url, server, thread, _ = start_server(eng, name, args)
        out[key] = {"url": url, "engine": eng}
        running.append((server, thread))
    yield name, out
    for server, thread in running:
        stop_server(server, thread)


def ask(client, name, req: dict) -> dict:
    kw = {k: v for k, v in req.items() if k not in ("chat", "content", "prompt")}
    kw.setdefault("max_tokens", 40)
    kw.setdefault("temperature", 0)
    if req["chat"]:
        call = client.chat.completions.create
        kw["messages"] = [{"role": "user", "content": req["content"]}]
    else:
        call = client.completions.create
        kw["prompt"] = req["prompt"]
        if kw.pop("logprobs", None):
            kw["logprobs"] = kw.pop("top_logprobs", 0)
    if kw.get("stream"):
        kw["stream_options"] = {"include_usage": True}
        chunks = list(call(model=name, **kw))
        pick = (lambda c: c.delta.content or "") if req["chat"] else (lambda c: c.text)
        text = "".join(pick(c.choices[0]) for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return {"texts": [text], "finish": [finish], "tokens": chunks[-1].usage.completion_tokens}
    r = call(model=name, **kw)
    texts = [c.message.content if req["chat"] else c.text for c in r.choices]
    lps = [[(t.token, round(t.logprob, 3)) for t in c.logprobs.content] for c in r.choices if c.logprobs]
    return {"texts": texts, "finish": [c.finish_reason for c in r.choices], "tokens": r.usage.completion_tokens,
            "logprobs": lps}  # fmt: skip


@pytest.mark.slow
def test_builtin_model_answers_as_without_speculation(servers):
    import httpx
    import openai

    name, srv = servers
    answers = {}
    for key in ("spec", "plain"):
        client = openai.OpenAI(base_url=srv[key]["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)
        with ThreadPoolExecutor(8) as pool:  # 8 concurrent requests
            answers[key] = list(pool.map(lambda r, c=client: ask(c, name, r), REQUESTS))
    for i, (got, want) in enumerate(zip(answers["spec"], answers["plain"])):
        if "logprobs" in want:
            for a, b in zip(got.pop("logprobs"), want.pop("logprobs")):
                assert [t for t, _ in a] == [t for t, _ in b] and all(
                    abs(x - y) < 2e-3 for (_, x), (_, y) in zip(a, b)
                )
        assert got == want, (i, REQUESTS[i])
    assert answers["spec"][2]["finish"] == ["stop"] and "lamp" not in answers["spec"][2]["texts"][0]
    spec = srv["spec"]["engine"]
    deadline = time.monotonic() + 20
    while (spec.has_work() or spec.blocks.num_used) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert spec.blocks.num_used == 0 and srv["plain"]["engine"].blocks.num_used == 0
    assert spec.spec.accepted > 20 and spec.stats.steps < srv["plain"]["engine"].stats.steps
    values = {}
    for line in httpx.get(srv["spec"]["url"] + "/metrics").text.splitlines():
        if line.startswith("polyfuse_spec_decode"):
            key, value = line.rsplit(" ", 1)
            values[key.split("{")[0]] = float(value)
    assert values["polyfuse_spec_decode_num_accepted_tokens_total"] == spec.spec.accepted
    assert values["polyfuse_spec_decode_draft_acceptance_rate"] == pytest.approx(spec.spec.acceptance_rate)
    assert values["polyfuse_spec_decode_mean_accepted_tokens_per_step"] == pytest.approx(spec.spec.tokens_per_step)
    assert values["polyfuse_spec_decode_mean_accepted_tokens_per_step"] > 1.2


# -- flags -----------------------------------------------------------------------------------------------------------


def test_speculative_flags():
    from polyfuse.cli.generate import UsageError
    from polyfuse.serving.cli import build_parser, speculative_setting_of

    def setting(*argv):
        return speculative_setting_of(build_parser().parse_args(list(argv)))

    assert setting() is None
    assert setting("--speculative-method", "ngram", "--prompt-lookup-num-tokens", "3") == lookup(3, 2)
    assert setting("--speculative_method", "prompt_lookup") == lookup(10, 2)  # transformers' default k
    assert setting("--prompt_lookup_num_tokens", "5", "--max_matching_ngram_size", "3") == lookup(5, 3)
    assert setting("--speculative_method", "ngram", "--num_speculative_tokens", "6") == lookup(6, 2)
    for argv, needle in [
        (["--num_speculative_tokens", "5"], "need --speculative_method prompt_lookup"),
        (["--prompt_lookup_num_tokens", "40"], "--prompt_lookup_num_tokens must be an integer in 1..32"),
        (["--prompt_lookup_num_tokens", "4", "--num_speculative_tokens", "5"], "give one of them"),
        (["--speculative_method", "ngram", "--max_matching_ngram_size", "0"], "max_matching_ngram_size must be"),
    ]:
        with pytest.raises(UsageError, match=needle):
            setting(*argv)
    with pytest.raises(SystemExit):  # draft models and EAGLE-3 heads are not served: argparse's invalid choice
        build_parser().parse_args(["--speculative_method", "draft"])


def test_bad_speculative_flag_one_error_line():
    import sys
    from pathlib import Path

    from helpers import dist_env, run_session

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "polyfuse", "serve", "--prompt_lookup_num_tokens", "0"]
    p = run_session(cmd, 120, dist_env(PYTHONPATH=str(root)), root)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "1..32" in errors[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
