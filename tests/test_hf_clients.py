"""polyfuse's own model object in clients no one here wrote, offline, against the transformers model on the same
weights: transformers' ``pipeline`` (the object, and a path through transformers' Auto classes once
``register_auto_classes`` is on), TRL's ``SFTTrainer`` (3 steps, the same losses; ``polyfuse.patch`` after the trainer
is built keeps TRL's forward), lm-eval's ``HFLM`` (loglikelihood and generate_until on a task built here),
PEFT adapters through transformers' ``load_adapter``, and ``torch.compile(fullgraph=True)`` with an attention mask."""

import copy

import pytest
import torch
import transformers
from helpers import one_thread, write_tiny_cli_model  # noqa: F401

import polyfuse
from polyfuse.checkpoint.tokenizer import load_tokenizer
from polyfuse.models import AutoModelForCausalLM as PfAuto
from polyfuse.models import register_auto_classes, unregister_auto_classes
from polyfuse.models.builtin import builtin_model


@pytest.fixture(scope="module")
def tok():
    try:
        return load_tokenizer(*builtin_model())
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def folder(tok, tmp_path_factory):
    """A random two-layer Llama with the built-in model's tokenizer."""
    return write_tiny_cli_model(str(tmp_path_factory.mktemp("tiny")), tok, max_position_embeddings=64, seed=3)


def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()


PROMPTS = ["The capital of France is", "One two three"]


def test_pipeline_takes_the_model_object(folder, tok):
    runs = []
    for model in (PfAuto.from_pretrained(folder).eval(), hf_model(folder)):
        pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok)
        greedy = pipe(PROMPTS, max_new_tokens=6, do_sample=False)
        torch.manual_seed(0)
        sampled = pipe(PROMPTS, max_new_tokens=6, do_sample=True, temperature=0.8)
        runs.append((greedy, sampled))
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1], "sampling gave the greedy text: the comparison could not tell them apart"


def test_pipeline_from_a_path_through_the_auto_classes(folder, tok):
    register_auto_classes()
    try:
        pipe = transformers.pipeline("text-generation", model=folder)
    finally:
        unregister_auto_classes()
    assert isinstance(pipe.model, polyfuse.LlamaForCausalLM)
    theirs = transformers.pipeline("text-generation", model=folder)
    assert type(theirs.model) is transformers.LlamaForCausalLM  # unregistered: transformers' own class again
    assert pipe(PROMPTS[0], max_new_tokens=6, do_sample=False) == theirs(PROMPTS[0], max_new_tokens=6, do_sample=False)
    register_auto_classes()
    try:  # from_config through transformers' Auto class: polyfuse's build, weights drawn, kernels resolved
        fresh = transformers.AutoModelForCausalLM.from_config(pipe.model.config)
    finally:
        unregister_auto_classes()
    assert isinstance(fresh, polyfuse.LlamaForCausalLM) and fresh.kernels is not None
    assert torch.isfinite(fresh(torch.tensor([[5, 6, 7]])).logits).all()


def sft_losses(model, tok, tmp_path, after_build=None):
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    texts = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "One two three."] * 2
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, bf16=False, max_length=32, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    tok = copy.deepcopy(tok)
    tok.padding_side = "right"
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}), processing_class=tok
    )
    if after_build is not None:
        after_build(trainer.model)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_sft_trainer_losses_match_transformers(folder, tok, tmp_path):
    ours = sft_losses(PfAuto.from_pretrained(folder, training=True), tok, tmp_path / "pf")
    theirs = sft_losses(hf_model(folder), tok, tmp_path / "hf")
    assert len(ours) == len(theirs) == 3
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    assert ours[0] != ours[2], "the loss did not move: the steps trained nothing"


def test_patch_after_the_sft_trainer_keeps_its_forward(folder, tok, tmp_path):
    handles = []
    patched = sft_losses(hf_model(folder), tok, tmp_path / "patched", lambda m: handles.append(polyfuse.patch(m)))
    plain = sft_losses(hf_model(folder), tok, tmp_path / "plain")
    assert any("kept" in n for n in handles[0].notes), handles[0].report()
    torch.testing.assert_close(torch.tensor(patched), torch.tensor(plain), rtol=1e-4, atol=0)


def tiny_tasks(path):
    """Two lm-eval tasks over a local JSON file: loglikelihood and generate_until."""
    (path / "data.jsonl").write_text(
        '{"question": "The capital of France is", "answer": " Paris"}\n'
        '{"question": "Two plus two equals", "answer": " four"}\n'
        '{"question": "One two three", "answer": " four"}\n'
    )
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path / 'data.jsonl'}\ntest_split: test\n"
    common += 'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
    (path / "ll.yaml").write_text(
        f"task: pf_tiny_ll\n{common}output_type: loglikelihood\nmetric_list:\n  - metric: acc\n"
    )
    gen = 'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 6\n  do_sample: false\n'
    (path / "gen.yaml").write_text(
        f"task: pf_tiny_gen\n{common}output_type: generate_until\n{gen}metric_list:\n  - metric: exact_match\n"
    )


def test_lm_eval_hflm_matches_transformers(folder, tok, tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tiny_tasks(tmp_path)
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    samples = []
    for model in (PfAuto.from_pretrained(folder).eval(), hf_model(folder)):
        lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2)
        out = simple_evaluate(model=lm, tasks=["pf_tiny_ll", "pf_tiny_gen"], task_manager=manager, log_samples=True)
        samples.append({t: [s["resps"] for s in out["samples"][t]] for t in ("pf_tiny_ll", "pf_tiny_gen")})
    ours, theirs = samples
    assert ours["pf_tiny_gen"] == theirs["pf_tiny_gen"]
    for a, b in zip(ours["pf_tiny_ll"], theirs["pf_tiny_ll"]):
        (lp_a, greedy_a), (lp_b, greedy_b) = a[0][0], b[0][0]
        assert greedy_a == greedy_b and abs(lp_a - lp_b) <= 1e-4 * max(1.0, abs(lp_b))


def test_peft_adapter_through_load_adapter_both_ways(folder, tmp_path):
    peft = pytest.importorskip("peft")
    ids = torch.randint(100, 40000, (2, 9), generator=torch.Generator().manual_seed(1))
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
        init_lora_weights=False,
    )  # fmt: skip
    torch.manual_seed(2)
    theirs = peft.get_peft_model(hf_model(folder), config)
    theirs.save_pretrained(tmp_path / "from_hf")
    torch.manual_seed(3)
    ours = peft.get_peft_model(PfAuto.from_pretrained(folder), copy.deepcopy(config))
    ours.save_pretrained(tmp_path / "from_pf")
    with torch.no_grad():
        for adapted, path, reader in ((theirs, "from_hf", PfAuto.from_pretrained), (ours, "from_pf", hf_model)):
            model = reader(folder)
            model.load_adapter(str(tmp_path / path))
            torch.testing.assert_close(model(ids).logits, adapted(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        assert (ours(input_ids=ids).logits - theirs(input_ids=ids).logits).abs().max() > 1e-3  # two adapters


def test_fullgraph_compile_with_an_attention_mask(folder):
    model = PfAuto.from_pretrained(folder).eval()
    ids = torch.randint(100, 40000, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        for m in (mask, torch.ones_like(ids)):
            want = model(ids, attention_mask=m).logits
            torch.testing.assert_close(compiled(ids, attention_mask=m).logits, want, rtol=1e-5, atol=1e-5)
