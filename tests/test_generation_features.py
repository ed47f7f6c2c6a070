"""generate()'s transformers options: beam search, repetition penalty, num_return_sequences, stop strings and stop
ids, streaming. Each is compared token for token with transformers' ``generate`` in fp32 on the same weights (a tiny
random Llama saved by polyfuse and loaded by transformers), through every decoding path: the in-place greedy
TokenStep, the per-token loop, no cache, KV buckets, and the steps wrapped in (faked) CUDA graphs."""

import pytest
import torch
from helpers import (
    EOS,
    Recorded,
    fake_cuda_graphs,
    hf_from_pretrained,
    left_padded,
    one_thread,  # noqa: F401  (autouse fixture)
    perturb_,
    random_rows,
    tiny_config,
)

from polyfuse.backends.cuda.graphs import GraphedStep
from polyfuse.core.runtime import Step
from polyfuse.generation.steps import forget_steps
from polyfuse.generation.token_state import TokenState
from polyfuse.models.llama import LlamaForCausalLM


PAD = 3  # not 0: transformers' beam search pads finished hypotheses with `pad_token_id or eos`


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = tiny_config(num_key_value_heads=2, initializer_range=0.1)
    ours = perturb_(LlamaForCausalLM.from_config(cfg, seed=5), seed=5).eval()
    path = str(tmp_path_factory.mktemp("features_pair"))
    ours.save_pretrained(path)
    return ours, hf_from_pretrained(path)


@pytest.fixture(scope="module")
def batch(pair):
    """Two left-padded prompts, and EOS ids that end some beams / rows early (a token the model likes)."""
    ours, _ = pair
    ids, mask = left_padded(random_rows((9, 5), 301, seed=11))
    n = ids.shape[1]
    free = ours.generate(ids, mask, max_new_tokens=12, ignore_eos=True)
    beams = ours.generate(ids, mask, max_new_tokens=12, ignore_eos=True, num_beams=2, num_return_sequences=2)
    return ids, mask, [EOS, int(free[0, n + 3]), int(free[1, n + 7]), int(beams[2, n + 1])]


@pytest.fixture(autouse=True)
def fresh_steppers(pair):
    forget_steps(pair[0])
    yield
    forget_steps(pair[0])


def hf_generate(hf, ids, mask, **kw):
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, do_sample=False, **kw)


def per_token_loop(model, *args, **kw):
    """generate() without the in-place TokenStep, as on runtimes without in-place decoding (HPU)."""
    model.runtime.inplace_decode = False
    forget_steps(model)
    try:
        return model.generate(*args, **kw)
    finally:
        del model.runtime.inplace_decode
        forget_steps(model)


# -- faked CUDA graphs: GraphedStep around the decode and token steps, torch.cuda's graph API faked on the CPU -----


@pytest.fixture
def graphs(pair, monkeypatch):
    """The model's runtime wraps its steps as the CUDA runtime does under --use_cuda_graphs; returns the steps."""

    fake_cuda_graphs(monkeypatch)
    made = {}

    def graph_module(module, phase, flags):
        if phase == "prefill":
            return Step(module)
        made[phase] = GraphedStep(Recorded(module, phase == "token"), inplace=phase == "token")
        return made[phase]

    monkeypatch.setattr(pair[0].runtime, "graph_module", graph_module)
    forget_steps(pair[0])
    return made


# -- beam search ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_beams, num_return_sequences, extra",
    [
        (2, 2, {}),
        (3, 1, {}),
        (3, 3, {"length_penalty": 0.5, "early_stopping": True}),
    ],
)
def test_beam_search_matches_transformers(pair, batch, num_beams, num_return_sequences, extra):
    ours, hf = pair
    ids, mask, eos = batch
    kw = dict(
        max_new_tokens=14, num_beams=num_beams, num_return_sequences=num_return_sequences, eos_token_id=eos,
        pad_token_id=PAD, **extra,
    )  # fmt: skip
    want = hf_generate(hf, ids, mask, **kw)
    got = ours.generate(ids, mask, **kw)
    assert got.shape == want.shape and got.shape[0] == 2 * num_return_sequences
    assert torch.equal(got, want), f"\nours   {got}\ntheirs {want}"
    assert any(set(eos) & set(r) for r in got[:, ids.shape[1] :].tolist()), "no hypothesis ended on EOS"
    if num_beams == 2:  # the other ways through the model give the same beams
        for other in (
            ours.generate(ids, mask, use_cache=False, **kw),
            ours.generate(ids, mask, bucket_size=8, **kw),
            per_token_loop(ours, ids, mask, **kw),
        ):
            assert torch.equal(other, want)


def test_beam_search_without_eos_runs_to_max_new_tokens(pair, batch):
    ours, hf = pair
    ids, mask, _ = batch
    kw = dict(max_new_tokens=9, num_beams=3, num_return_sequences=2, pad_token_id=PAD)
    got = ours.generate(ids, mask, ignore_eos=True, **kw)
    assert got.shape == (4, ids.shape[1] + 9)
    assert torch.equal(got, hf_generate(hf, ids, mask, eos_token_id=None, **kw))


def test_beam_search_under_graphs_reuses_the_decode_graph(pair, batch, graphs):
    ours, hf = pair
    ids, mask, eos = batch
    kw = dict(max_new_tokens=12, num_beams=2, num_return_sequences=2, eos_token_id=eos, pad_token_id=PAD)
    want = hf_generate(hf, ids, mask, **kw)
    got = ours.generate(ids, mask, bucket_size=8, **kw)
    assert torch.equal(got, want)
    step = graphs["decode"]
    assert step.disabled_reason is None and sorted(k[0] for k in step.graphs) == [16, 24]
    assert step.fn.runs == 2 * 2  # warm-ups only: every token replays the decode step's graph
    assert torch.equal(ours.generate(ids, mask, bucket_size=8, **kw), want)  # the cache gathers kept the graphs valid


# -- repetition penalty --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_greedy_matches_transformers(pair, batch, penalty):
    ours, hf = pair
    ids, mask, _ = batch
    kw = dict(max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD)
    want = hf_generate(hf, ids, mask, repetition_penalty=penalty, **kw)
    assert not torch.equal(want, hf_generate(hf, ids, mask, **kw)[:, : want.shape[1]]), "the penalty changed nothing"
    assert torch.equal(ours.generate(ids, mask, repetition_penalty=penalty, **kw), want)  # in-place TokenStep
    assert torch.equal(per_token_loop(ours, ids, mask, repetition_penalty=penalty, **kw), want)
    assert torch.equal(ours.generate(ids, mask, repetition_penalty=penalty, use_cache=False, **kw), want)
    # Sampling with top_k=1 is greedy: the penalty is applied before the warpers there too.
    k1 = ours.generate(ids, mask, repetition_penalty=penalty, do_sample=True, top_k=1, **kw)
    assert torch.equal(k1, want)


def test_repetition_penalty_runs_inside_the_token_graph(pair, batch, graphs):
    ours, hf = pair
    ids, mask, eos = batch
    kw = dict(max_new_tokens=20, repetition_penalty=1.3, eos_token_id=eos, pad_token_id=PAD)
    want = hf_generate(hf, ids, mask, **kw)
    assert torch.equal(ours.generate(ids, mask, **kw), want)
    step = graphs["token"]  # the greedy in-place step, not the per-token loop
    assert step.disabled_reason is None and len(step.graphs) == 1 and step.fn.runs == 2
    seen = TokenState.of(ours.cache).seen(301)
    (key,) = step.graphs
    assert seen.data_ptr() in key[1:][8] and 1.3 in key  # the seen mask is a graph buffer, the penalty a constant
    assert torch.equal(ours.generate(ids, mask, **kw), want) and step.fn.runs == 2  # replays only
    # Without the penalty the token step takes its usual graph (no seen mask, no penalty arguments).
    plain = ours.generate(ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(plain, hf_generate(hf, ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=PAD))
    assert len(step.graphs) == 2 and sorted(len(k) for k in step.graphs) == [9, 11]


def test_repetition_penalty_with_beam_search_matches_transformers(pair, batch):
    ours, hf = pair
    ids, mask, eos = batch
    kw = dict(max_new_tokens=12, num_beams=2, repetition_penalty=1.3, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(ours.generate(ids, mask, **kw), hf_generate(hf, ids, mask, **kw))


# -- num_return_sequences -------------------------------------------------------------------------------------------


def test_num_return_sequences_shapes(pair, batch):
    ours, _ = pair
    ids, mask, _ = batch
    n = ids.shape[1]
    kw = dict(max_new_tokens=6, ignore_eos=True, do_sample=True, num_return_sequences=3)
    a = ours.generate(ids, mask, generator=torch.Generator().manual_seed(1), **kw)
    assert a.shape == (6, n + 6)
    assert torch.equal(a[:, :n], ids.repeat_interleave(3, 0))  # rows b * 3 + r: each prompt's samples together
    assert len({tuple(r) for r in a[:3, n:].tolist()}) > 1, "the samples of one prompt are all the same"
    assert torch.equal(ours.generate(ids, mask, generator=torch.Generator().manual_seed(1), **kw), a)
    beams = ours.generate(ids, mask, max_new_tokens=6, ignore_eos=True, num_beams=3, num_return_sequences=2)
    assert beams.shape == (4, n + 6) and torch.equal(beams[:, :n], ids.repeat_interleave(2, 0))


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"num_beams": 0}, "num_beams must be an integer >= 1"),
        ({"num_beams": 2.0}, "num_beams must be an integer >= 1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": -1.2}, "repetition_penalty must be > 0"),
        ({"num_beams": 2, "num_return_sequences": 3}, "must be <= num_beams"),
        ({"num_return_sequences": 0}, "num_return_sequences must be an integer >= 1"),
        ({"num_return_sequences": 2}, "needs do_sample=True"),
        ({"num_beams": 2, "do_sample": True}, "beam sampling"),
        ({"num_beams": 2, "early_stopping": "soon"}, "early_stopping"),
        ({"stop_strings": ["x"]}, "stop_strings needs tokenizer="),
        ({"stop_strings": [""], "tokenizer": str}, "non-empty strings"),
        ({"num_beams": 2, "streamer": object()}, "beam search"),
        ({"streamer": object()}, "put(token_ids) and end()"),
    ],
)
def test_bad_values_are_one_line_value_errors(pair, kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
        pair[0].generate(torch.tensor([[11, 12, 13]]), max_new_tokens=3, **kw)
    assert "\n" not in str(e.value)


# -- streaming -----------------------------------------------------------------------------------------------------


class Collect:
    """A BaseStreamer that keeps what it is given."""

    def __init__(self):
        self.prompt, self.tokens, self.ends = None, [], 0

    def put(self, value):
        assert self.ends == 0, "put() after end()"
        if self.prompt is None:
            self.prompt = value.clone()
        else:
            assert value.dim() == 1 and value.device.type == "cpu"
            self.tokens.append(value.clone())

    def end(self):
        self.ends += 1

    def stream(self):
        return torch.stack(self.tokens, 1)


@pytest.mark.parametrize("path", ["in_place", "graphs", "per_token", "no_cache", "sampling"])
def test_streamer_receives_exactly_the_generated_tokens(pair, batch, path, request):
    ours, hf = pair
    ids, mask, eos = batch
    kw = dict(max_new_tokens=20, eos_token_id=eos, pad_token_id=PAD)
    if path == "graphs":
        request.getfixturevalue("graphs")
    if path == "sampling":
        kw.update(do_sample=True, temperature=1.5, generator=torch.Generator().manual_seed(3))
    s = Collect()
    run = per_token_loop if path == "per_token" else (lambda m, *a, **k: m.generate(*a, **k))
    out = run(ours, ids, mask, streamer=s, use_cache=path != "no_cache", **kw)
    n = ids.shape[1]
    assert torch.equal(s.prompt, ids) and s.ends == 1
    assert torch.equal(s.stream(), out[:, n:]), "the streamed tokens are not the result's new tokens, in order"
    if path != "sampling":  # as transformers streams them (finished rows padded)
        theirs = Collect()
        hf_generate(hf, ids, mask, streamer=theirs, **kw)
        assert torch.equal(s.stream(), theirs.stream())
        assert torch.isin(out[:, n:], torch.tensor(eos)).any(1).all() and out.shape[1] < n + 20, "no early stop"


def test_stop_token_ids_end_rows_like_eos(pair, batch):
    ours, hf = pair
    ids, mask, eos = batch
    extra = eos[1]
    got = ours.generate(ids, mask, max_new_tokens=16, ignore_eos=True, stop_token_ids=[extra], pad_token_id=PAD)
    want = hf_generate(hf, ids, mask, max_new_tokens=16, eos_token_id=[extra], pad_token_id=PAD)
    assert torch.equal(got, want)
    both = ours.generate(ids, mask, max_new_tokens=16, eos_token_id=EOS, stop_token_ids=extra, pad_token_id=PAD)
    assert torch.equal(
        both, hf_generate(hf, ids, mask, max_new_tokens=16, eos_token_id=[EOS, extra], pad_token_id=PAD)
    )


# -- stop strings (a real tokenizer: the built-in model's, on a tiny random model over its vocabulary) -------------


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    """A random untied Llama over the built-in tokenizer's vocabulary (varied words, unlike a tied tiny one)."""
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    try:
        tok = load_tokenizer(*builtin_model())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg = tiny_config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, initializer_range=0.05,
    )  # fmt: skip
    ours = LlamaForCausalLM.from_config(cfg, seed=1).eval()
    path = str(tmp_path_factory.mktemp("worded"))
    ours.save_pretrained(path)
    tok.save_pretrained(path)  # a folder the CLI can run
    ours.folder = path
    return ours, hf_from_pretrained(path), tok


def _stop_strings(ours, tok, ids, mask):
    """Row 0: a stop string overhanging into its k0-th new token ("ab" ending token k0-1 + the first char of token
    k0); row 1: one that ends exactly with its k1-th new token. Returns (strings, k0, k1)."""
    n = ids.shape[1]
    free = ours.generate(ids, mask, max_new_tokens=16, ignore_eos=True)[:, n:].tolist()

    def ascii_at(row, k):
        text, before = tok.decode(row[: k + 1]), tok.decode(row[:k])
        ok = text.isascii() and text.isprintable() and len(text) - len(before) >= 2 and len(before) >= 2
        return ok, text, before

    k0 = next((k for k in range(4, 12) if ascii_at(free[0], k)[0]), None)
    k1 = next((k for k in range(6, 13) if ascii_at(free[1], k)[0]), None)
    if k0 is None or k1 is None:
        pytest.skip("no ASCII stretch in the random model's output to build stop strings from")
    _, text, before = ascii_at(free[0], k0)
    overhang = text[len(before) - 2 : len(before) + 1]
    _, text, _ = ascii_at(free[1], k1)
    return [overhang, text[-4:]], k0, k1


def test_stop_strings_stop_where_transformers_stops(worded):
    ours, hf, tok = worded
    enc = tok(["The capital of France is", "Hello"], return_tensors="pt", padding=True)
    ids, mask = enc.input_ids, enc.attention_mask
    n = ids.shape[1]
    strings, k0, k1 = _stop_strings(ours, tok, ids, mask)
    kw = dict(max_new_tokens=16, stop_strings=strings + ["\u00e9t\u00e9!"], eos_token_id=tok.eos_token_id)
    want = hf_generate(hf, ids, mask, tokenizer=tok, pad_token_id=tok.pad_token_id, **kw)
    got = ours.generate(ids, mask, tokenizer=tok, **kw)
    assert torch.equal(got, want), f"\nours   {got}\ntheirs {want}"
    pad = tok.pad_token_id
    # Each row stopped at (or before) the token completing its string; the run ended with the later one.
    assert got.shape[1] < n + 16 and all(got[r, n + k + 1 :].eq(pad).all() for r, k in ((0, k0), (1, k1)))
    # A decode callable instead of the tokenizer: the same rule on the decoded new text.
    s = Collect()
    called = ours.generate(ids, mask, tokenizer=lambda t: tok.decode(t), streamer=s, **kw)
    assert torch.equal(called, want) and torch.equal(s.stream(), want[:, n:])
    # Beam search stops hypotheses on stop strings too.
    beams = dict(kw, num_beams=2, pad_token_id=pad)
    assert torch.equal(
        ours.generate(ids, mask, tokenizer=tok, **beams), hf_generate(hf, ids, mask, tokenizer=tok, **beams)
    )


# -- the built-in model (SmolLM2-135M-Instruct): slow, its two GGUF loads take minutes on two cores --------------


@pytest.mark.slow  # loads the built-in model twice
def test_builtin_beam_search_and_penalty_match_transformers():
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    folder, name = builtin_model()
    ours = LlamaForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    hf = hf_from_pretrained(folder, gguf_file=name)
    tok = load_tokenizer(folder, name)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in ("What is the capital of France?", "Write a haiku about the sea.")
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc.input_ids, enc.attention_mask
    assert not mask.all()
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for kw in (
        dict(max_new_tokens=24, num_beams=2, num_return_sequences=2),
        dict(max_new_tokens=24, num_beams=3),
        dict(max_new_tokens=32, repetition_penalty=1.3),
        dict(max_new_tokens=24, num_beams=2, repetition_penalty=1.3),
    ):
        want = hf_generate(hf, ids, mask, **special, **kw)
        got = ours.generate(ids, mask, **special, **kw)
        assert torch.equal(got, want), f"{kw}\nours   {got[:, ids.shape[1] :]}\ntheirs {want[:, ids.shape[1] :]}"


# -- the CLI's flags (polyfuse-generate) ---------------------------------------------------------------------------


CLI = ("--device", "cpu", "--use_kv_cache", "--warmup", "1", "--n_iterations", "1", "--max_new_tokens", "6")


def run_cli(capsys, folder, *argv):
    from polyfuse.cli.generate import main

    rc = main(["--model_name_or_path", folder, *CLI, *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def test_cli_stream_prints_the_new_text_once_as_it_arrives(worded, capsys, monkeypatch):
    ours, _, tok = worded
    puts = []
    real = __import__("transformers").TextStreamer.put
    monkeypatch.setattr("transformers.TextStreamer.put", lambda self, v: puts.append(v.shape) or real(self, v))
    rc, out, err = run_cli(capsys, ours.folder, "--stream", "--ignore_eos", "--prompt", "The capital of France is")
    assert rc == 0, err
    assert len(puts[0]) == 2 and puts[1:] == [(1,)] * 6  # the prompt, then one put per token: the warm-up only
    streamed = out.split("Warming up iteration 1/1\n", 1)[1].split("\nIteration 1/1", 1)[0].strip()
    final = out.split("output 1.1: ", 1)[1].splitlines()[0]
    assert streamed and streamed in final, (streamed, final)


def test_cli_beams_penalty_stops_run(worded, capsys):
    ours, _, _ = worded
    rc, out, err = run_cli(
        capsys, ours.folder, "--num_beams", 3, "--num_return_sequences", 2, "--repetition_penalty", 1.2,
        "--stop_strings", "zzz", "q!", "--stop_token_ids", 5, 6, "--prompt", "Hello",
    )  # fmt: skip
    assert rc == 0, err
    assert "Stats:" in out and not err.strip()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (("--num_beams", "0"), "--num_beams must be >= 1, got 0"),
        (("--repetition_penalty", "0"), "--repetition_penalty must be > 0, got 0.0"),
        (("--num_beams", "2", "--num_return_sequences", "3"), "must be <= --num_beams (2)"),
        (("--num_beams", "2", "--do_sample"), "beam sampling"),
        (
            (
                "--num_return_sequences",
                "2",
            ),
            "needs --do_sample",
        ),
        (("--stream", "--batch_size", "2"), "--stream prints one sequence"),
    ],
)
def test_cli_bad_values_give_one_error_line(worded, capsys, argv, needle):
    rc, out, err = run_cli(capsys, worded[0].folder, *argv)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc != 0 and len(errors) == 1 and needle in errors[0], err


# -- on an NVIDIA GPU (make test-cuda): real CUDA graphs give the eager tokens ----------------------------------------


@pytest.fixture(scope="module")
def gpu_pair(tmp_path_factory):
    """The same bf16 weights, eager and under CUDA graphs (same kernels: graph replay must not change a token)."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    cfg = tiny_config(
        vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.05,
    )  # fmt: skip
    path = str(tmp_path_factory.mktemp("gpu_pair"))
    LlamaForCausalLM.from_config(cfg, seed=1).save_pretrained(path)
    flags = {"use_flash_attention": True}
    load = dict(dtype=torch.bfloat16, device="cuda")
    eager = LlamaForCausalLM.from_pretrained(path, flags=flags, **load).eval()
    graphed = LlamaForCausalLM.from_pretrained(path, flags=dict(flags, use_cuda_graphs=True), **load).eval()
    ids, mask = left_padded(random_rows((21, 8, 15), 1000, seed=4))
    return eager, graphed, ids.cuda(), mask.cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("bucket", [-1, 16])
def test_cuda_graphs_penalty_beams_streaming_match_eager(gpu_pair, bucket):

    eager, graphed, ids, mask = gpu_pair
    n = ids.shape[1]
    free = eager.generate(ids, mask, max_new_tokens=40, ignore_eos=True)
    eos = [int(free[0, n + 5]), int(free[2, n + 17])]
    base = dict(max_new_tokens=40, eos_token_id=eos, pad_token_id=PAD, bucket_size=bucket)
    for kw in (
        dict(repetition_penalty=1.3),  # in the token graph
        dict(num_beams=3, num_return_sequences=2),  # the decode graph, cache gathered in place between replays
        dict(num_beams=2, repetition_penalty=1.2, length_penalty=0.8),
    ):
        want = eager.generate(ids, mask, **base, **kw)
        assert torch.equal(graphed.generate(ids, mask, **base, **kw), want), kw
        assert torch.equal(graphed.generate(ids, mask, **base, **kw), want), kw  # replays
        decode, token = graphed.steps.decode, graphed.steps.token
        step = decode if "num_beams" in kw else token  # (a new cache size drops the other's graphs)
        assert step.graphs and step.disabled_reason is None, kw
        if step is token:
            assert all(len(k) == 11 for k in token.graphs)  # captured with the seen mask and the penalty
    s = Collect()
    got = graphed.generate(ids, mask, streamer=s, **base)
    assert torch.equal(got, eager.generate(ids, mask, **base)) and torch.equal(s.stream(), got[:, n:].cpu())
