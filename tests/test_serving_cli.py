"""``polyfuse serve`` as users start it: ``python -m polyfuse serve`` in a process of its own, and under torchrun.

* a random two-layer Llama with the built-in tokenizer: the server answers, SIGTERM during a streamed answer lets it
  finish (drained), refuses new connections and exits 0;
* tensor parallelism: ``torchrun --nproc-per-node 2 -m polyfuse serve`` on the CPU (gloo): rank 0 serves, rank 1
  follows; concurrent greedy answers equal the single process's; SIGTERM to rank 0 ends both ranks with 0;
* bad flags: one ``error:`` line and exit 2 (a flag out of range, a port in use); dash spellings parse; the
  ``polyfuse`` command's help and an unknown command.

Every process runs in its own session with a timeout that kills the whole group.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import dist_env, run_session, torchrun_cmd, write_tiny_cli_model

from polyfuse.serving.cli import build_parser


ROOT = Path(__file__).resolve().parents[1]
SERVE = [sys.executable, "-m", "polyfuse", "serve"]
PROMPTS = ["What is the capital of France?", "Name a color.", "Count to five.", "Hello!"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    try:
        tokenizer = load_tokenizer(*builtin_model())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return write_tiny_cli_model(str(tmp_path_factory.mktemp("serve")), tokenizer, max_position_embeddings=128)


class Server:
    """A server process; ``url`` once it printed its address (its stdout and stderr are read by threads)."""

    def __init__(self, cmd, timeout=120.0):
        env = dist_env(POLYFUSE_DIST_TIMEOUT="60", PYTHONPATH=str(ROOT))
        self.p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)  # fmt: skip
        self.out, self.err, self.url, self.pid = [], [], None, None
        ready = threading.Event()

        def read(stream, sink):
            for line in stream:
                sink.append(line)
                m = re.search(r"on (http://[\d.]+:\d+) \(pid (\d+)", line)
                if m:
                    self.url, self.pid = m.group(1), int(m.group(2))
                    ready.set()
            ready.set()

        for stream, sink in ((self.p.stdout, self.out), (self.p.stderr, self.err)):
            threading.Thread(target=read, args=(stream, sink), daemon=True).start()
        if not ready.wait(timeout) or self.url is None:
            self.kill()
            pytest.fail(f"the server did not start:\n{''.join(self.out)}\n{''.join(self.err)[-3000:]}")

    def wait(self, timeout=60.0) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the server did not exit in {timeout} s:\n{''.join(self.err)[-3000:]}")

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


def answers(url: str, concurrent: bool) -> list:
    """(text, the log-probabilities of each token and its 3 runners-up) of each prompt's greedy answer."""

    def one(prompt):
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0,
                "logprobs": True, "top_logprobs": 3}  # fmt: skip
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lps = [[e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]] for e in choice["logprobs"]["content"]]
        return choice["message"]["content"], lps

    if not concurrent:
        return [one(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def stream_lines(url: str, sink: list, done: threading.Event) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            sink.append(line)
            if len(sink) == 3:
                done.set()
    done.set()


@pytest.fixture(scope="module")
def single_answers(tiny_model):
    server = Server([*SERVE, "--model_name_or_path", tiny_model, "--served_model_name", "m", "--port", "0"])
    try:
        got = answers(server.url, concurrent=False)
        # SIGTERM while a stream is running: it finishes, then the process exits 0
        lines, started = [], threading.Event()
        t = threading.Thread(target=stream_lines, args=(server.url, lines, started))
        t.start()
        assert started.wait(60)
        os.kill(server.pid, signal.SIGTERM)
        t.join(60)
        assert server.wait() == 0, "".join(server.err)[-3000:]
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=5)
    finally:
        server.kill()
    return got, lines


def test_sigterm_drains_the_running_stream_and_exits_0(single_answers):
    _, lines = single_answers
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) == 60 + 1  # every token's chunk, then the end


def test_served_answers(single_answers):
    got, _ = single_answers
    assert all(text and len(lps) == 12 for text, lps in got)
    assert len({tuple(lps[0]) for _, lps in got}) == len(PROMPTS)  # each prompt its own distribution


def same_answers(a: list, b: list) -> None:
    """Equal texts; log-probabilities within 1e-4 (TP sums each row-parallel product in two halves)."""
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert max(abs(u - v) for rx, ry in zip(x, y) for u, v in zip(rx, ry)) < 1e-4


@pytest.mark.slow
def test_tensor_parallel_serve_matches_one_process(tiny_model, single_answers):
    cmd = torchrun_cmd("-m", "polyfuse", "serve", "--model_name_or_path", tiny_model, "--served_model_name", "m",
                       "--port", "0")  # fmt: skip
    server = Server(cmd)
    try:
        same_answers(answers(server.url, concurrent=True), single_answers[0])
        time.sleep(2.5)  # idle past two heartbeats: the follower keeps waiting for steps
        same_answers(answers(server.url, concurrent=False), single_answers[0])
        os.kill(server.pid, signal.SIGTERM)  # rank 0: drains, stops the follower; torchrun sees two clean exits
        assert server.wait(90) == 0, "".join(server.err)[-3000:]
    finally:
        server.kill()


# -- flags -----------------------------------------------------------------------------------------------------------


def _one_error(p, needle):
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and needle in errors[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_bad_flag_one_error_line():
    p = run_session([*SERVE, "--max_num_seqs", "0"], 120, dist_env(PYTHONPATH=str(ROOT)), ROOT)
    _one_error(p, "--max_num_seqs must be >= 1")


def test_port_in_use_one_error_line(tiny_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = run_session([*SERVE, "--model_name_or_path", tiny_model, "--port", str(port)], 120,
                        dist_env(PYTHONPATH=str(ROOT)), ROOT)  # fmt: skip
    _one_error(p, f"cannot listen on 127.0.0.1:{port}")


def test_dash_spellings_parse():
    a = build_parser().parse_args(["--max-num-seqs", "3", "--block-size", "8", "--model-name-or-path", "x",
                                   "--use-cuda-graphs", "--no-enable-prefix-caching", "--api-key", "k"])  # fmt: skip
    assert (a.max_num_seqs, a.block_size, a.model_name_or_path, a.use_cuda_graphs) == (3, 8, "x", True)
    assert a.enable_prefix_caching is False and a.api_key == "k"


def test_polyfuse_command():
    from polyfuse.__main__ import main

    assert main(["--help"]) == 0
    assert main(["nonsense"]) == 2
