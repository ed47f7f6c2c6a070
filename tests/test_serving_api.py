"""``polyfuse serve`` over HTTP with the built-in model (SmolLM2-135M-Instruct, CPU, float32), called with the official
``openai`` client and httpx. One server for the module, in this process, on 127.0.0.1 with an ephemeral port.

* the greedy chat answer equals run_generation.py's for the same prompt;
* streamed deltas concatenate to the non-streamed text, with a final usage chunk under include_usage;
* 8 concurrent greedy requests give the answers they give one at a time;
* stop strings, ``n``, usage counts, logprobs, /v1/completions and /metrics are right;
* every bad request gets its 4xx with OpenAI's error object (and the server keeps serving);
* a client hanging up mid-stream gets its request cancelled and its blocks freed;
* a shared prompt hits the prefix cache; a full queue answers 429; an API key guards every route but /health.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers import one_thread, start_server, stop_server  # noqa: F401  (one_thread: autouse fixture)

from polyfuse.serving.cli import build_parser
from polyfuse.serving.server import build


MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Hamlet?",
    "What is the boiling point of water?",
    "Say hello in Spanish.",
    "What is a prime number?",
]


@pytest.fixture(scope="module")
def served():
    args = build_parser().parse_args(
        [
            "--port",
            "0",
            "--max_model_len",
            "512",
            "--num_kv_blocks",
            "400",
            "--max_num_seqs",
            "8",
            "--max_num_batched_tokens",
            "256",
        ]  # fmt: skip
    )
    engine, name, _ = build(args)
    url, server, thread, aengine = start_server(engine, name, args)
    yield {"url": url, "engine": engine, "aengine": aengine, "state": server.config.app.state.serving}
    stop_server(server, thread)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, question, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], **kw)


def wait_idle(engine, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while (engine.has_work() or engine.blocks.num_used) and time.monotonic() < deadline:
        time.sleep(0.05)


def metrics(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key.split("{")[0] + ("{" + key.split("{")[1] if "finished_reason" in key else "")] = float(value)
    return out


# -- answers ---------------------------------------------------------------------------------------------------------


def test_greedy_chat_equals_run_generation(client, capsys):
    from polyfuse.cli.args import build_parser as generation_parser
    from polyfuse.cli.generate import run as run_generation

    for question in QUESTIONS[:2]:
        args = generation_parser().parse_args(
            [
                "--prompt",
                question,
                "--use_chat_template",
                "--max_new_tokens",
                "24",
                "--use_kv_cache",
                "--print_new_text_only",
                "--warmup",
                "0",
                "--n_iterations",
                "1",
                "--no-ignore_eos",  # run_generation.py keeps optimum-habana's default (on); a chat answer ends at EOS
            ]  # fmt: skip
        )
        want = run_generation(args)["output"][0]
        got = chat(client, question)
        assert got.choices[0].message.content == want
        assert got.choices[0].message.role == "assistant" and got.model == MODEL
    capsys.readouterr()


def test_stream_concatenates_to_the_whole_answer(client):
    whole = chat(client, QUESTIONS[3], max_tokens=30)
    chunks = list(chat(client, QUESTIONS[3], max_tokens=30, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.model_dump()["completion_tokens"] == whole.usage.completion_tokens
    )
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_concurrent_requests_equal_one_at_a_time(client, served):
    alone = [chat(client, q, max_tokens=16).choices[0].message.content for q in QUESTIONS]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda q: chat(client, q, max_tokens=16).choices[0].message.content, QUESTIONS))
    assert together == alone
    wait_idle(served["engine"])
    assert served["engine"].blocks.num_used == 0


def test_stop_strings_n_usage_and_logprobs(client, served):
    full = chat(client, QUESTIONS[0]).choices[0].message.content
    assert "Paris" in full
    cut = chat(client, QUESTIONS[0], stop=["Paris"])
    assert cut.choices[0].message.content == full[: full.index("Paris")] and cut.choices[0].finish_reason == "stop"

    tok = served["engine"].tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[1]}], tokenize=False,
                                     add_generation_prompt=True)  # fmt: skip
    r = chat(client, QUESTIONS[1], n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # independent draws
    lengths = [len(c.logprobs.content) for c in r.choices]
    assert r.usage.completion_tokens == sum(lengths) and all(1 <= n <= 12 for n in lengths)
    assert r.usage.prompt_tokens == len(tok(prompt, add_special_tokens=False).input_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    for c in r.choices:
        joined = "".join(e.token for e in c.logprobs.content)
        assert joined.startswith(c.message.content) or c.message.content.startswith(joined.rstrip())
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in c.logprobs.content)
        if c.finish_reason == "length":
            assert lengths[c.index] == 12
    again = chat(client, QUESTIONS[1], n=3, temperature=1.0, seed=7, max_tokens=12)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeded


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt=["The capital of France is", "One, two,"], max_tokens=6,
                                  temperature=0, logprobs=2)  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    one = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=6, temperature=0)
    assert r.choices[1].text == one.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)
    assert r.usage.completion_tokens == 12


def test_metrics_count_what_was_served(client, served):
    wait_idle(served["engine"])
    before = metrics(served["url"])
    r = chat(client, QUESTIONS[4], max_tokens=10)
    wait_idle(served["engine"])
    after = metrics(served["url"])
    assert (
        after["polyfuse_generation_tokens_total"] - before["polyfuse_generation_tokens_total"]
        == r.usage.completion_tokens
    )
    assert after["polyfuse_prompt_tokens_total"] - before["polyfuse_prompt_tokens_total"] == r.usage.prompt_tokens
    key = f'polyfuse_request_success_total{{finished_reason="{r.choices[0].finish_reason}",model_name="{MODEL}"}}'
    assert after[key] - before.get(key, 0) == 1
    assert (
        after["polyfuse_time_to_first_token_seconds_count"] - before["polyfuse_time_to_first_token_seconds_count"] == 1
    )
    assert after["polyfuse_num_requests_running"] == 0 and after["polyfuse_kv_blocks_used"] == 0
    assert after["polyfuse_kv_blocks_total"] == 399


def test_models_and_health(served):
    models = httpx.get(served["url"] + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
    assert httpx.get(served["url"] + "/health").status_code == 200


# -- bad requests ----------------------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
BAD = [
    ("chat", {"messages": USER}, 400, "model"),
    ("chat", {"model": "gpt-4", "messages": USER}, 404, "model"),
    ("chat", {"model": MODEL}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("chat", {"model": MODEL, "messages": USER, "max_tokens": -1}, 400, "max_tokens"),
    ("chat", {"model": MODEL, "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"model": MODEL, "messages": USER, "max_tokens": 100000}, 400, "max_tokens"),
    ("chat", {"model": MODEL, "messages": USER, "max_completion_tokens": "ten"}, 400, "max_completion_tokens"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    ("chat", {"model": MODEL, "messages": USER, "temperature": 5}, 400, "temperature"),
    ("chat", {"model": MODEL, "messages": USER, "top_p": 0}, 400, "top_p"),
    ("chat", {"model": MODEL, "messages": USER, "n": 0}, 400, "n"),
    ("chat", {"model": MODEL, "messages": USER, "stop": [""]}, 400, "stop"),
    ("chat", {"model": MODEL, "messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat", {"model": MODEL, "messages": USER, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {"model": MODEL, "messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat", {"model": MODEL, "messages": USER, "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("chat", [1, 2], 400, None),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [[1, 10**9]]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("route, body, status, param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_their_4xx(served, route, body, status, param):
    r = httpx.post(f"{served['url']}/v1/{'chat/completions' if route == 'chat' else route}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param


def test_malformed_json_unknown_routes_and_the_server_goes_on(served, client):
    url = served["url"]
    r = httpx.post(url + "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing").status_code == 404 and "error" in httpx.get(url + "/v1/nothing").json()
    assert httpx.get(url + "/v1/chat/completions").status_code == 405
    assert chat(client, QUESTIONS[2], max_tokens=4).choices[0].message.content


# -- faults and limits ---------------------------------------------------------------------------------------------


def test_hang_up_mid_stream_frees_the_blocks(served):
    engine, url = served["engine"], served["url"]
    wait_idle(engine)
    assert engine.blocks.num_used == 0
    before = metrics(url)["polyfuse_request_aborted_total"]
    body = {"model": MODEL, "messages": USER, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks: the request is running
        assert any(line.startswith("data: {") for line in got)
        assert engine.blocks.num_used > 0
    deadline = time.monotonic() + 20
    while (engine.blocks.num_used or engine.has_work()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.blocks.num_used == 0 and not engine.has_work()
    assert metrics(url)["polyfuse_request_aborted_total"] == before + 1


def test_shared_prompt_hits_the_prefix_cache(client):
    question = "Summarize this: " + "the quick brown fox jumps over the lazy dog. " * 8
    first = chat(client, question, max_tokens=8)
    second = chat(client, question, max_tokens=8)
    assert second.choices[0].message.content == first.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (second.usage.prompt_tokens - 1) // 16 * 16 - 16 and cached > 0


def test_full_queue_answers_429(served):
    aengine = served["aengine"]
    aengine.max_waiting = 0
    try:
        r = httpx.post(served["url"] + "/v1/chat/completions", json={"model": MODEL, "messages": USER})
    finally:
        aengine.max_waiting = 256
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"


def test_api_key_guards_every_route_but_health(served):
    state, url = served["state"], served["url"]
    state.api_key = "s3cret"
    try:
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401
        bad = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert chat(keyed, QUESTIONS[2], max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            chat(openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0), QUESTIONS[2], max_tokens=2)
    finally:
        state.api_key = None


def test_sse_lines_are_openai_chunks(served):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", served["url"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
