"""Speculative decoding (polyfuse/generation/speculative, docs/speculative.md) on the CPU.

* greedy: with every proposer (prompt lookup, a draft model, EAGLE-3 heads in the published format) the output is
  token for token the output without speculation, at batch 1 and batch 4 with left padding, for every family, with
  quantized targets and drafts, EOS, stop strings, the repetition penalty, a streamer and KV buckets;
* sampling: the per-position and pairwise token distributions over many samples of a tiny model match the target's
  exact distribution (chi-square on a fixed seed), and a rule that accepts every draft fails the same test;
* the proposers' own caches: under a forced acceptance (holes in a batch, compactions) each round's drafts equal the
  drafts recomputed from scratch on the sequence so far;
* the verify step through (faked) CUDA graphs: one capture per (KV length, k), none per accepted length.
"""

import importlib

import pytest
import torch
from helpers import FakeGraph, fake_cuda_graphs, left_padded, one_thread, random_rows  # noqa: F401
from speculative_cases import VOCAB, SpecStats, tiny, write_eagle3

import polyfuse.generation.speculative.loop as loop
from polyfuse.backends.cuda.graphs import GraphedStep
from polyfuse.core.runtime import DeviceRuntime, Step
from polyfuse.generation.cached_step import CachedStep
from polyfuse.generation.speculative.accept import ForcedAcceptance
from polyfuse.models import load_eagle3


generation = importlib.import_module("polyfuse.generation.generate")  # the module (the package exports the function)
NEW = 24


def similar(model_fn, noise: float, seed: int = 0):
    """A draft that mostly agrees with its target: the same random weights, perturbed."""
    draft = model_fn()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    return draft


def repeating_rows(lengths, seed: int):
    """Prompts that repeat spans of themselves (prompt lookup finds matches in them)."""
    return [r + r[: len(r) // 2] + r for r in random_rows(lengths, VOCAB, seed=seed)]


def batch1():
    return torch.tensor(repeating_rows((7,), 3)), None


def batch4():
    return left_padded(repeating_rows((6, 3, 5, 4), 4))


def assert_same(target, ids, mask, spec: dict, **kw):
    want = target.generate(ids, mask, max_new_tokens=NEW, **kw)
    got = target.generate(ids, mask, max_new_tokens=NEW, **kw, **spec)
    assert torch.equal(got, want), f"\nwant {want[:, ids.shape[1] :]}\ngot  {got[:, ids.shape[1] :]}"
    return got


@pytest.fixture(scope="module")
def llama():
    return tiny("llama", seed=1)


@pytest.fixture(scope="module")
def heads(llama, tmp_path_factory):
    path = write_eagle3(tmp_path_factory.mktemp("eagle3"), llama, seed=2, layer_ids=[0, 2, 4])
    return load_eagle3(path, llama)


def proposers(llama, heads):
    return {
        "prompt_lookup": dict(prompt_lookup_num_tokens=4),
        "draft_same": dict(assistant_model=tiny("llama", seed=1), num_assistant_tokens=4),  # accepts every draft
        "draft_similar": dict(assistant_model=similar(lambda: tiny("llama", seed=1), 0.004), num_assistant_tokens=3),
        "eagle3": dict(speculative_model=heads, num_speculative_tokens=4),
    }


@pytest.mark.parametrize("name", ["prompt_lookup", "draft_same", "draft_similar", "eagle3"])
@pytest.mark.parametrize("batch", [batch1, batch4], ids=["batch1", "batch4_left_padded"])
def test_greedy_output_is_the_output_without_speculation(llama, heads, name, batch):
    ids, mask = batch()
    spec = proposers(llama, heads)[name]
    hooks = SpecStats()
    assert_same(llama, ids, mask, dict(spec, hooks=hooks), ignore_eos=True)
    s = hooks.stats
    assert s.method == ("prompt_lookup" if name == "prompt_lookup" else name.split("_")[0])
    assert s.emitted == ids.shape[0] * (NEW - 1)  # every token after the first came from verify steps
    if name == "draft_same":
        assert s.acceptance_rate == 1.0 and s.steps < NEW / 3
    if name == "draft_similar":
        assert 0 < s.acceptance_rate < 1  # some rows accept fewer: holes in the batch


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_every_family(family, tmp_path):
    """Each family's tiny model with each proposer, batch 4 left-padded (Mistral: a sliding window of 12 slots,
    shorter than the run, so holes are compacted before they could shorten it)."""
    target = tiny(family, seed=1)
    heads = load_eagle3(write_eagle3(tmp_path, target, seed=3, layer_ids=[0, 2, 4]), target)
    ids, mask = batch4()
    hooks = SpecStats()
    for spec in (
        dict(prompt_lookup_num_tokens=3),
        dict(assistant_model=similar(lambda: tiny(family, seed=1), 0.004), num_assistant_tokens=3),
        dict(speculative_model=heads, num_speculative_tokens=3),
    ):
        assert_same(target, ids, mask, dict(spec, hooks=hooks), ignore_eos=True)
    if family == "mistral":
        assert_same(target, ids, mask, dict(assistant_model=similar(lambda: tiny(family, seed=1), 0.004),
                                            hooks=hooks))  # fmt: skip
        assert hooks.stats.compactions > 0


def test_compaction_when_holes_fill_the_cache(llama, monkeypatch):
    """No slack for holes: the batch's cache runs full and is compacted in place, the output unchanged."""
    monkeypatch.setattr(loop, "HOLE_SLACK", 0)
    ids, mask = left_padded(repeating_rows((6, 3, 5, 4, 6, 2), 9))
    hooks = SpecStats()
    draft = similar(lambda: tiny("llama", seed=1), 0.006)
    assert_same(llama, ids, mask, dict(assistant_model=draft, num_assistant_tokens=5, hooks=hooks), ignore_eos=True)
    assert hooks.stats.compactions > 0


def test_quantized_target_and_draft():
    import transformers
    from speculative_cases import COMMON

    from polyfuse.models import LlamaForCausalLM

    cfg = transformers.LlamaConfig(**COMMON)
    target = LlamaForCausalLM.from_config(cfg, seed=1, quant="int8").eval()
    draft = LlamaForCausalLM.from_config(cfg, seed=1, quant="int4").eval()
    ids, mask = batch4()
    hooks = SpecStats()
    assert_same(target, ids, mask, dict(assistant_model=draft, num_assistant_tokens=3, hooks=hooks), ignore_eos=True)
    assert hooks.stats.accepted > 0
    assert_same(target, ids, mask, dict(prompt_lookup_num_tokens=3))


def test_eos_stop_strings_penalty_streamer_buckets(llama, heads):
    """EOS ids end a row at the first one even among accepted drafts, a stop string at the token completing it;
    the repetition penalty sees the drafts before each verified position; a streamer gets one position of every
    row at a time; KV buckets."""
    ids, mask = batch4()
    draft = similar(lambda: tiny("llama", seed=1), 0.004)
    spec = dict(assistant_model=draft, num_assistant_tokens=3)
    eos_row = llama.generate(ids, mask, max_new_tokens=NEW, ignore_eos=True)[0, ids.shape[1] + 5].item()
    assert_same(llama, ids, mask, spec, eos_token_id=eos_row)  # row 0 ends at its 6th token
    assert_same(llama, ids, mask, dict(speculative_model=heads), repetition_penalty=1.3)
    assert_same(llama, ids, mask, spec, repetition_penalty=0.7, bucket_size=8)
    decode = lambda row: "".join(chr(97 + t % 26) for t in row)  # noqa: E731
    text = decode(llama.generate(ids, mask, max_new_tokens=NEW, ignore_eos=True)[1, ids.shape[1] :].tolist())
    assert_same(llama, ids, mask, spec, stop_strings=[text[6:9]], tokenizer=decode, ignore_eos=True)

    class Streamer:
        def __init__(self):
            self.puts = []

        def put(self, v):
            self.puts.append(v.clone())

        def end(self):
            pass

    want, got = Streamer(), Streamer()
    a = llama.generate(ids, mask, max_new_tokens=NEW, streamer=want)
    b = llama.generate(ids, mask, max_new_tokens=NEW, streamer=got, **spec)
    assert torch.equal(a, b)
    assert len(want.puts) == len(got.puts) and all(torch.equal(x, y) for x, y in zip(want.puts, got.puts))


def test_model_generate_loads_a_heads_folder(llama, tmp_path):
    path = write_eagle3(tmp_path, llama, seed=5, layer_ids=[0, 2, 4])
    ids, mask = batch1()
    assert_same(llama, ids, mask, dict(speculative_model=path), ignore_eos=True)
    assert llama._speculative_models[(path, False)] is not None  # loaded once, kept
    draft = str(tmp_path / "draft")
    similar(lambda: tiny("llama", seed=1), 0.004).save_pretrained(draft)
    hooks = SpecStats()
    assert_same(llama, ids, mask, dict(speculative_model=draft, speculative_method="draft", hooks=hooks))
    assert hooks.stats.method == "draft" and hooks.stats.accepted > 0


def test_heads_in_pytorch_bin_load_the_same(llama, tmp_path):
    from safetensors.torch import load_file

    path = write_eagle3(tmp_path / "st", llama, seed=6, layer_ids=[0, 2, 4])
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(load_file(str(tmp_path / "st" / "model.safetensors")), binary / "pytorch_model.bin")
    a, b = load_eagle3(path, llama), load_eagle3(str(binary), llama)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert torch.equal(a.hot_ids(), torch.tensor(sorted(a.hot_ids().tolist())))  # d2t: offsets to the target ids


# -- the proposers' caches against drafts recomputed from scratch ---------------------------------------------------


def recorded_rounds(proposer):
    """Wrap ``proposer.propose``: every round's (row, sequence so far, drafts) for the running rows."""
    rounds, propose = [], proposer.propose

    def record(run):
        out = propose(run)
        for r in range(run.prompts.rows):
            if not run.outputs.done(r):
                rounds.append((r, run.outputs.history(r), out.tokens[r].tolist()))
        return out

    proposer.propose = record
    return rounds


def scratch_drafts(kind, target, drafter, seq: list, k: int) -> list:
    """Greedy drafts for ``seq`` (the pending token last) with fresh caches: the draft model over all of it, or
    the target's features over ``seq[:-1]`` and the heads over (features j, token j + 1)."""
    ids = torch.tensor([seq])
    n = len(seq)
    pos = torch.arange(n)[None]
    if kind == "draft":
        step = CachedStep(drafter, "prefill")
        step.reserve(1, n + k)
        logits = step(ids, pos, torch.arange(n), None, n)
        out = []
        for i in range(k):
            out.append(int(logits.argmax(-1)))
            if i < k - 1:
                logits = CachedStep(drafter)(torch.tensor([[out[-1]]]), pos[:, -1:] + i + 1,
                                             torch.tensor([n + i]), None, n + k)  # fmt: skip
        return out
    layers = drafter.capture_layers(target.config.num_hidden_layers)
    step = CachedStep(target, "prefill")
    step.reserve(1, n + k)
    _, hidden = step(ids[:, :-1], pos[:, :-1], torch.arange(n - 1), None, n - 1, None, layers)
    from polyfuse.generation.kv_cache import ensure_cache

    drafter.cache = None
    ensure_cache(drafter, 1, n + k)
    key_mask = torch.ones(1, n + k, dtype=torch.bool)
    logits, h = drafter.draft_step(ids[:, 1:], pos[:, :-1], torch.arange(n - 1), key_mask, n + k, hidden)
    hot, out = drafter.hot_ids(), []
    for i in range(k):
        out.append(int(hot[logits.argmax(-1)]))
        if i < k - 1:
            logits, h = drafter.draft_step(torch.tensor([[out[-1]]]), pos[:, -1:] + i, torch.tensor([n - 1 + i]),
                                           key_mask, n + k, h[:, None])  # fmt: skip
    return out


@pytest.mark.parametrize("kind", ["draft", "eagle3"])
def test_proposer_caches_under_forced_acceptance(llama, kind, tmp_path, monkeypatch):
    """Rows accept (round + row) % (k + 1) drafts whatever they are: holes of every size in the batch, and
    compactions (no hole slack); every round's drafts are those of fresh caches over the sequence so far."""
    monkeypatch.setattr(loop, "HOLE_SLACK", 0)
    k = 3
    made = []
    real = generation.make_proposer

    def make(*a):
        made.append(real(*a))
        made.append(recorded_rounds(made[0]))
        return made[0]

    run = loop.speculative_decode
    monkeypatch.setattr(generation, "make_proposer", make)
    monkeypatch.setattr(generation, "speculative_decode",
                        lambda d, p: run(d, p, ForcedAcceptance(lambda step, r: (step + r) % (k + 1))))  # fmt: skip
    if kind == "draft":
        drafter, spec = tiny("llama", seed=7, num_hidden_layers=2), {}
        spec = dict(assistant_model=drafter, num_assistant_tokens=k)
        reference = tiny("llama", seed=7, num_hidden_layers=2)
    else:
        path = write_eagle3(tmp_path, llama, seed=8, layer_ids=[0, 2, 4])
        spec = dict(speculative_model=load_eagle3(path, llama), num_speculative_tokens=k)
        reference = load_eagle3(path, llama)
    ids, mask = left_padded(random_rows((6, 3, 5), VOCAB, seed=11))
    llama.generate(ids, mask, max_new_tokens=30, ignore_eos=True, **spec)
    rounds = made[1]
    assert len(rounds) > 20
    target = tiny("llama", seed=1)
    for r, seq, drafts in rounds:
        assert drafts == scratch_drafts(kind, target, reference, seq, k), (r, len(seq))


# -- sampling: the target's distribution --------------------------------------------------------------------------


SMALL = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=4, initializer_range=0.35)
PROMPT = [3, 4, 5, 3, 4]  # prompt lookup proposes [5, 3, 4] at first
SAMPLES, TEMPERATURE = 6000, 2.5


def exact_distributions(model):
    """p(x1), p(x2), p(x1, x2), p(x3) of the target after PROMPT at TEMPERATURE, by enumeration."""
    v = model.config.vocab_size

    def probs(prefixes):
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        with torch.no_grad():
            logits = model(ids).logits[:, -1].double()
        return (logits / TEMPERATURE).softmax(-1)

    p1 = probs([()])[0]
    p2 = probs([(a,) for a in range(v)])  # [x1, x2]
    joint = p1[:, None] * p2
    p3 = probs([(a, b) for a in range(v) for b in range(v)]).view(v, v, v)
    return p1, joint.sum(0), joint, (joint[..., None] * p3).sum((0, 1))


def chi_square_p(observed, expected) -> float:
    """The chi-square test's p-value, bins with an expected count under 5 merged into one."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(exp) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def sample_tokens(target, spec: dict, seed: int = 0, accept=None, monkeypatch=None):
    if accept is not None:
        run = loop.speculative_decode
        monkeypatch.setattr(generation, "speculative_decode", lambda d, p: run(d, p, accept))
    ids = torch.tensor([PROMPT] * SAMPLES)
    gen = torch.Generator().manual_seed(seed)
    out = target.generate(ids, max_new_tokens=3, do_sample=True, temperature=TEMPERATURE, ignore_eos=True,
                          generator=gen, **spec)  # fmt: skip
    return out[:, len(PROMPT) :]


def p_values(target, tokens) -> list:
    v = target.config.vocab_size
    p1, p2, joint, p3 = exact_distributions(target)
    counts = [torch.bincount(tokens[:, j], minlength=v) for j in range(3)]
    pairs = torch.bincount(tokens[:, 0] * v + tokens[:, 1], minlength=v * v)
    return [chi_square_p(c, SAMPLES * p) for c, p in zip((*counts, pairs), (p1, p2, p3, joint))]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    target = tiny("llama", seed=21, **SMALL)
    other = tiny("llama", seed=22, **SMALL)  # another model: q far from p
    draft = similar(lambda: tiny("llama", seed=21, **SMALL), 0.05)  # q near p: acceptances and rejections
    path = write_eagle3(tmp_path_factory.mktemp("eagle3_small"), target, seed=23, draft_vocab=12,
                        layer_ids=[0, 1, 2], std=0.3)  # fmt: skip
    return target, draft, other, load_eagle3(path, target)


@pytest.mark.parametrize("name", ["prompt_lookup", "draft", "eagle3"])
def test_sampling_keeps_the_target_distribution(small, name):
    """Per position and for the first two tokens jointly, 6000 samples with speculation against the target's
    exact distribution: the rejection rule (deterministic drafts, a draft model's q, heads over a draft vocabulary
    that lacks some of the target's tokens) keeps it."""
    target, draft, _, heads = small
    spec = {"prompt_lookup": dict(prompt_lookup_num_tokens=3), "draft": dict(assistant_model=draft, num_assistant_tokens=2),
            "eagle3": dict(speculative_model=heads, num_speculative_tokens=2)}[name]  # fmt: skip
    hooks = SpecStats()
    tokens = sample_tokens(target, dict(spec, hooks=hooks))
    s = hooks.stats
    assert s.accepted > 500 and s.drafted - s.accepted > 500, s  # both acceptances and rejections, many
    ps = p_values(target, tokens)
    assert min(ps) > 1e-3, ps


def accept_all(scores, proposal, rule):
    """Wrong: every draft accepted (the draft's distribution leaks in)."""
    k = proposal.tokens.shape[1]
    last = rule.draw(rule.probs(scores[:, -1]))
    accepted = torch.full((scores.shape[0],), k, dtype=torch.int64)
    return accepted, torch.cat([proposal.tokens, last[:, None]], dim=1)


def correct_from_p(scores, proposal, rule):
    """Wrong: the right acceptance test, but the token after a rejection drawn from p, not max(0, p - q)."""
    p, drafts = rule.probs(scores), proposal.tokens
    rows, k = drafts.shape
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0]
    q_d = proposal.probs.gather(2, drafts[..., None])[..., 0]
    accepted = (rule.uniform((rows, k), p.device) * q_d < p_d).long().cumprod(1).sum(1)
    nxt = rule.draw(p[torch.arange(rows), accepted])
    return accepted, torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, accepted[:, None], nxt[:, None])


@pytest.mark.parametrize("wrong", [accept_all, correct_from_p])
def test_the_chi_square_test_catches_a_wrong_rule(small, monkeypatch, wrong):
    """The same test on a wrong rule fails (with another model as the draft: q far from p)."""
    target, _, draft, _ = small
    tokens = sample_tokens(target, dict(assistant_model=draft, num_assistant_tokens=2), accept=wrong,
                           monkeypatch=monkeypatch)  # fmt: skip
    assert min(p_values(target, tokens)) < 1e-6


# -- graphs ----------------------------------------------------------------------------------------------------------


class Outputs:
    """A captured step's static outputs (a tensor or a tuple of them), refreshed by a faked replay."""

    def __init__(self, out):
        self.out = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

    def copy_(self, res):
        if isinstance(res, tuple):
            for a, b in zip(self.out, res):
                a.copy_(b)
        else:
            self.out.copy_(res)


class Recording:
    """A step as a faked CUDA graph sees it (helpers.Recorded, for steps returning tuples too)."""

    def __init__(self, fn):
        self.fn, self.runs = fn, 0

    def __call__(self, *args):
        if FakeGraph.capturing is not None:
            out = Outputs(self.fn(*args))
            FakeGraph.capturing.calls.append((self.fn, args, out))
            return out.out
        self.runs += 1
        return self.fn(*args)


def test_verify_and_draft_steps_through_cuda_graphs(llama, heads, monkeypatch):
    """Every decode-phase step (the target's verify, the heads', the draft's) through GraphedStep: the greedy
    output is the eager one, and the captures are one per shape and KV length, never one per accepted length."""
    fake_cuda_graphs(monkeypatch)
    made = {}

    def graph_module(self, module, phase, flags):
        if phase != "decode":
            return Step(module)
        made.setdefault(type(module).__name__, []).append(GraphedStep(Recording(module)))
        return made[type(module).__name__][-1]

    monkeypatch.setattr(DeviceRuntime, "graph_module", graph_module)
    ids, mask = batch4()
    want = llama.generate(ids, mask, max_new_tokens=NEW, ignore_eos=True)
    draft = similar(lambda: tiny("llama", seed=1), 0.004)
    fresh_heads = load_eagle3(heads.name_or_path, llama)
    for model in (llama, draft):
        model.steps = None
    for spec in (dict(speculative_model=fresh_heads, num_speculative_tokens=4),
                 dict(assistant_model=draft, num_assistant_tokens=3)):  # fmt: skip
        hooks = SpecStats()
        for prompt_ids, prompt_mask in ((ids, mask), (ids.flip(0), mask.flip(0))):
            got = llama.generate(prompt_ids, prompt_mask, max_new_tokens=NEW, ignore_eos=True, hooks=hooks, **spec)
            assert torch.equal(got, want if prompt_ids is ids else want.flip(0))
        assert 0 < hooks.stats.tokens_per_step
    # one KV length (no buckets): the target's steps are k + 1 = 5 (heads) and 4 (draft) wide; the heads' the prompt,
    # 5 and 1 positions; the draft's 2 (the catch-up) and 1
    steps = {name: [sorted((key[1][0][1], key[0]) for key in g.graphs) for g in gs] for name, gs in made.items()}
    kv = llama.cache.max_len
    assert steps["StepModule"][0] == [(4, kv), (5, kv)]  # the target: one graph per k
    assert steps["HeadStep"] == [sorted([(1, kv), (5, kv), (ids.shape[1], kv)])]
    assert steps["StepModule"][1] == [(1, kv), (2, kv)]  # the draft model


# -- the built-in model (SmolLM2-135M-Instruct, real weights) ------------------------------------------------------


PASSAGE = ("The committee met on Tuesday to review the budget. It approved the new library wing, postponed the road "
           "repairs until spring, and asked the treasurer to publish the figures before the next meeting.")  # fmt: skip
TASKS = [
    f"Rewrite this passage in the past perfect tense, keeping every detail: {PASSAGE}",
    f"Summarise this passage in one sentence: {PASSAGE}",
    "Rename the variable total to subtotal in this code:\ndef add(xs):\n    total = 0\n    for x in xs:\n"
    "        total += x\n    return total",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models import LlamaForCausalLM
    from polyfuse.models.builtin import builtin_model

    try:
        folder, name = builtin_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model = LlamaForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    draft = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, quant="int8").eval()  # a quantized draft
    path = write_eagle3(tmp_path_factory.mktemp("eagle3_builtin"), model, seed=1, draft_vocab=4096, std=0.02)
    return model, draft, load_eagle3(path, model), load_tokenizer(folder, name)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 4])
def test_builtin_model_greedy_output_with_each_proposer(builtin, rows):
    """Input-grounded chat prompts (a rewrite, a summary, a code edit; and a question), batch 1 and batch 4 left
    padded, EOS on: each proposer gives the tokens of plain greedy decoding."""
    model, draft, heads, tok = builtin
    texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in TASKS[:rows]]  # fmt: skip
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert rows == 1 or not enc.attention_mask.all()
    kw = dict(max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    want = model.generate(enc.input_ids, enc.attention_mask, **kw)
    for spec in (dict(prompt_lookup_num_tokens=8), dict(assistant_model=draft, num_assistant_tokens=4),
                 dict(speculative_model=heads, num_speculative_tokens=3)):  # fmt: skip
        hooks = SpecStats()
        got = model.generate(enc.input_ids, enc.attention_mask, hooks=hooks, **kw, **spec)
        assert torch.equal(got, want), (spec, tok.batch_decode(got[:, enc.input_ids.shape[1] :]))
        if "assistant_model" in spec:
            assert hooks.stats.acceptance_rate > 0.8  # int8 weights of the same model
