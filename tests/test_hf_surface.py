"""The transformers ``PreTrainedModel`` surface of polyfuse's models, call by call against the transformers model on
the same weights: ``can_generate``, ``base_model`` (whose call gives ``last_hidden_state``), ``add_model_tags``,
``num_parameters``, embeddings and ``resize_token_embeddings``, gradient checkpointing, ``from_pretrained``'s
keywords (``dtype`` / ``torch_dtype`` / "auto", ``device_map``, ``revision`` from a Hub cache, config attributes;
refusals), ``save_pretrained`` (generation_config.json, the tokenizer it was loaded with, ``state_dict=``) and
``push_to_hub``."""

import json
import os
import shutil

import pytest
import torch
import transformers
from helpers import one_thread, perturb_, tiny_config  # noqa: F401
from transformers import GenerationMixin, PreTrainedModel

from polyfuse.compat import TRANSFORMERS_5
from polyfuse.models import AutoModelForCausalLM as PfAuto
from polyfuse.models import LlamaForCausalLM


IDS = torch.tensor([[3, 40, 41, 42, 43, 44], [5, 50, 51, 52, 53, 54]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    perturb_(transformers.LlamaForCausalLM(tiny_config(num_key_value_heads=2)).float()).save_pretrained(path)
    return str(path)


def hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()


def test_the_pretrained_model_surface(folder):
    ours, theirs = PfAuto.from_pretrained(folder).eval(), hf(folder)
    assert isinstance(ours, PreTrainedModel) and isinstance(ours, GenerationMixin) and ours.can_generate()
    assert ours.base_model is ours.model and ours.get_input_embeddings() is ours.model.embed_tokens
    assert ours.num_parameters() == theirs.num_parameters()
    assert ours.num_parameters(exclude_embeddings=True) == theirs.num_parameters(exclude_embeddings=True)
    assert ours.dtype == torch.float32 and ours.device == torch.device("cpu")
    assert ours.generation_config.eos_token_id == theirs.generation_config.eos_token_id
    ours.add_model_tags(["polyfuse", "x"])
    ours.add_model_tags("x")
    assert ours.model_tags == ["polyfuse", "x"]
    with torch.no_grad():
        hidden = ours.base_model(input_ids=IDS, attention_mask=torch.ones_like(IDS)).last_hidden_state
        want = theirs.model(input_ids=IDS).last_hidden_state
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_keeps_the_gradients(folder):
    plain, ckpt = PfAuto.from_pretrained(folder, training=True), PfAuto.from_pretrained(folder, training=True)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert ckpt.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    for m in (plain, ckpt):
        m(input_ids=IDS, labels=IDS).loss.backward()
    g = dict(plain.named_parameters())
    for name, p in ckpt.named_parameters():
        torch.testing.assert_close(p.grad, g[name].grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mean_resizing", [True, False])
def test_resize_token_embeddings(folder, tmp_path, mean_resizing):
    ours = PfAuto.from_pretrained(folder).eval()
    old = ours.config.vocab_size
    with torch.no_grad():
        before = ours(IDS).logits
        short = ours.generate(IDS, max_new_tokens=3)  # a cache and graphs made with the old shapes
    emb = ours.resize_token_embeddings(old + 5, mean_resizing=mean_resizing)
    assert emb.num_embeddings == old + 5 == ours.config.vocab_size and ours.lm_head.out_features == old + 5
    assert type(ours.lm_head).__name__ == "LMHead"  # the fused loss still goes through the head's call
    new_rows = ours.lm_head.weight[old:]
    assert torch.isfinite(new_rows).all() and new_rows.abs().sum() > 0
    with torch.no_grad():
        after = ours(IDS).logits
        torch.testing.assert_close(after[..., :old], before)
        assert ours.generate(IDS, max_new_tokens=3).shape == short.shape
    loss = ours(input_ids=IDS, labels=IDS).loss
    assert torch.isfinite(loss)
    ours.save_pretrained(tmp_path)
    theirs = hf(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(theirs(IDS).logits, after, rtol=1e-5, atol=1e-5)


def test_from_pretrained_takes_transformers_keywords(folder, tmp_path):
    assert PfAuto.from_pretrained(folder, torch_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert PfAuto.from_pretrained(folder, dtype="bfloat16", device_map="cpu").dtype == torch.bfloat16
    assert PfAuto.from_pretrained(folder, device_map={"": "cpu"}).device == torch.device("cpu")
    PfAuto.from_pretrained(folder, torch_dtype=torch.bfloat16).save_pretrained(tmp_path)
    assert PfAuto.from_pretrained(str(tmp_path), dtype="auto").dtype == torch.bfloat16  # the checkpoint's
    assert PfAuto.from_pretrained(folder, dtype="auto").dtype == torch.float32
    assert PfAuto.from_pretrained(folder, rms_norm_eps=1e-3).config.rms_norm_eps == 1e-3  # config attributes
    model = LlamaForCausalLM.from_pretrained(folder, trust_remote_code=False, low_cpu_mem_usage=True, _from_auto=True)
    assert model.name_or_path == folder
    with pytest.raises(ValueError, match="one device"):
        PfAuto.from_pretrained(folder, device_map={"model.embed_tokens": "cpu", "lm_head": "cuda:0"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        PfAuto.from_pretrained(folder, no_such_option=1)
    with pytest.raises(ValueError, match="ignore_mismatched_sizes"):
        PfAuto.from_pretrained(folder, ignore_mismatched_sizes=True)


def test_revision_reads_the_hub_cache(folder, tmp_path):
    """A Hub repo id with revisions, from huggingface_hub's cache (offline: nothing is downloaded)."""
    repo = tmp_path / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    for commit, eps in (("a" * 40, 1e-5), ("b" * 40, 1e-2)):
        shutil.copytree(folder, repo / "snapshots" / commit)
        cfg = repo / "snapshots" / commit / "config.json"
        cfg.write_text(json.dumps(dict(json.loads(cfg.read_text()), rms_norm_eps=eps)))
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "refs" / "v1").write_text("b" * 40)
    main = PfAuto.from_pretrained("org/tiny", cache_dir=str(tmp_path), local_files_only=True)
    v1 = LlamaForCausalLM.from_pretrained("org/tiny", revision="v1", cache_dir=str(tmp_path), local_files_only=True)
    assert main.config.rms_norm_eps == 1e-5 and v1.config.rms_norm_eps == 1e-2 and main.name_or_path == "org/tiny"
    with pytest.raises(ValueError, match="org/tiny@v2"):
        PfAuto.from_pretrained("org/tiny", revision="v2", cache_dir=str(tmp_path), local_files_only=True)


def test_save_writes_the_generation_config_and_the_tokenizer(tmp_path):
    from polyfuse.models.builtin import builtin_model

    try:
        folder, gguf = builtin_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model = PfAuto.from_pretrained(folder, gguf_file=gguf)
    model.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"} <= files
    from polyfuse.checkpoint.tokenizer import original_tokenizer  # the GGUF's, converted once and cached

    text = "The capital of France is Paris."
    want = original_tokenizer(folder, gguf)(text).input_ids
    assert transformers.AutoTokenizer.from_pretrained(tmp_path)(text).input_ids == want and len(want) > 3
    assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id == model.config.eos_token_id


def test_save_pretrained_takes_the_trainers_arguments(folder, tmp_path):
    model = PfAuto.from_pretrained(folder)
    with torch.no_grad():
        changed = {n: t + 1 if n.endswith("norm.weight") else t for n, t in model.state_dict().items()}
    model.save_pretrained(tmp_path, state_dict=changed, safe_serialization=True, max_shard_size="100KB")
    again = PfAuto.from_pretrained(str(tmp_path))
    torch.testing.assert_close(again.model.norm.weight, model.model.norm.weight + 1)
    assert (tmp_path / "model.safetensors.index.json").is_file()  # sharded by max_shard_size
    with pytest.raises(ValueError, match="safetensors"):
        model.save_pretrained(tmp_path, safe_serialization=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        model.save_pretrained(tmp_path, nope=1)


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x's push_to_hub has other internals to stand in for")
def test_push_to_hub_uploads_the_saved_folder(folder, monkeypatch):
    import transformers.utils.hub as hub

    seen = {}

    class Api:
        def create_repo(self, repo_id, **kw):
            return type("Repo", (), {"repo_id": repo_id})()

    class Card:
        def __init__(self, tags):
            self.tags = tags

        def save(self, path):
            with open(path, "w") as f:
                f.write("tags: " + ",".join(self.tags))

    def upload(self, folder, repo_id, **kw):
        seen["repo"], seen["files"] = repo_id, sorted(os.listdir(folder))
        seen["card"] = open(os.path.join(folder, "README.md")).read()
        return "committed"

    monkeypatch.setattr(hub, "hf_api", lambda: Api())
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda repo_id, tags, token=None: Card(tags or []))
    monkeypatch.setattr(hub.PushToHubMixin, "_upload_modified_files", upload)
    model = PfAuto.from_pretrained(folder)
    model.add_model_tags("polyfuse")
    assert model.push_to_hub("me/tiny") == "committed"
    assert seen["repo"] == "me/tiny" and "polyfuse" in seen["card"]
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md"} <= set(seen["files"])
