"""What a new user meets first in the Python API (issue 54): a right-padded batch generates what its left-padded twin
does, a .gguf file or a one-GGUF folder loads like the CLI loads it, corrupt weights are one error naming the
tensor, and ``dir(polyfuse)`` lists the public API."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import PAD, builtin_tokenizer, one_thread, tiny_config, write_tiny_cli_model, write_tiny_gguf  # noqa: F401  (autouse)

from polyfuse.core.errors import CheckpointError
from polyfuse.models import AutoModelForCausalLM, LlamaForCausalLM


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    return write_tiny_cli_model(str(tmp_path_factory.mktemp("tiny")), tokenizer, max_position_embeddings=64, seed=3)


# -- a right-padded batch --------------------------------------------------------------------------------------------


def _padded(rows, side: str):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, cols], mask[i, cols] = torch.tensor(r), 1
    return ids, mask


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "recompute"])
def test_right_padded_batch_generates_as_the_left_padded_one(use_cache):
    model = LlamaForCausalLM.from_config(tiny_config(initializer_range=0.3), seed=1)
    rows = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3], [11, 12, 13, 14, 15]]
    kw = dict(max_new_tokens=6, ignore_eos=True, use_cache=use_cache, bucket_size=128)
    left = model.generate(*_padded(rows, "left"), **kw)
    right = model.generate(*_padded(rows, "right"), **kw)
    assert torch.equal(right, left)
    # and each row is what it generates alone (no padding at all)
    for i, r in enumerate(rows):
        alone = model.generate(torch.tensor([r]), **kw)
        assert left[i, -6:].tolist() == alone[0, -6:].tolist(), i


def test_right_padding_tokenizer_default_is_handled(tokenizer, tiny_folder):
    """The user's path: transformers' tokenizer padding on the right (its default for the built-in GGUF), the ids
    and mask passed to generate as they come."""
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    prompts = ["Hi there", "The capital of France is a city that"]
    outs = {}
    for side in ("left", "right"):
        tokenizer.padding_side = side
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        out = model.generate(enc.input_ids, enc.attention_mask, max_new_tokens=5, ignore_eos=True, bucket_size=128)
        outs[side] = tokenizer.batch_decode(out, skip_special_tokens=True)
    tokenizer.padding_side = "left"
    assert outs["right"] == outs["left"]
    assert outs["left"][0].startswith("Hi there") and outs["left"][1].startswith(prompts[1])


# -- GGUF paths in the Python API ------------------------------------------------------------------------------------


def test_gguf_file_path_and_one_gguf_folder_load(tmp_path):
    model = LlamaForCausalLM.from_config(tiny_config(), seed=4)
    folder = tmp_path / "one"
    folder.mkdir()
    write_tiny_gguf(folder / "tiny.gguf", model, {})
    ids = torch.tensor([[3, 5, 7, 9]])
    want = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="tiny.gguf")(ids).logits
    for path in (folder, folder / "tiny.gguf", str(folder / "tiny.gguf")):
        got = AutoModelForCausalLM.from_pretrained(path)
        assert torch.equal(got(ids).logits, want), path
    assert torch.equal(LlamaForCausalLM.from_pretrained(str(folder / "tiny.gguf"))(ids).logits, want)
    write_tiny_gguf(folder / "other.gguf", model, {})
    with pytest.raises(
        CheckpointError, match=r"holds 2 GGUF files \(other.gguf, tiny.gguf\): pick one with gguf_file"
    ):
        AutoModelForCausalLM.from_pretrained(folder)


def test_a_file_that_is_no_gguf_says_so(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="a file, not a checkpoint folder"):
        AutoModelForCausalLM.from_pretrained(f)


# -- NaN / Inf in the weights ------------------------------------------------------------------------------------------


def corrupt_copy(src: str, dst: Path, tensor: str, nbytes: int = 1 << 20) -> Path:
    """A copy of the checkpoint folder ``src`` whose safetensors bytes of ``tensor`` start with 0xFF (NaN in
    float32), up to ``nbytes``, as a damaged download would."""
    import shutil

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + header_len])[tensor]["data_offsets"]
    start = 8 + header_len + begin
    n = min(nbytes, end - begin)
    data[start : start + n] = b"\xff" * n
    path.write_bytes(bytes(data))
    return dst


def test_nan_weights_are_one_error_naming_the_tensor(tmp_path, tiny_folder):
    bad = corrupt_copy(tiny_folder, tmp_path / "bad", "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(CheckpointError) as e:
        AutoModelForCausalLM.from_pretrained(str(bad))
    msg = str(e.value)
    assert "'model.layers.1.mlp.down_proj.weight'" in msg and "NaN or Inf" in msg and str(bad) in msg
    assert "\n" not in msg
    AutoModelForCausalLM.from_pretrained(tiny_folder)  # the intact copy loads


def test_finite_check_names_a_fused_part_by_its_checkpoint_name(tmp_path, tiny_folder):
    bad = corrupt_copy(tiny_folder, tmp_path / "bad_k", "model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(CheckpointError, match=r"weight 'model\.layers\.0\.self_attn\.k_proj\.weight' holds"):
        AutoModelForCausalLM.from_pretrained(str(bad))


# -- the package's public names ----------------------------------------------------------------------------------------


def test_dir_lists_the_public_api_and_import_stays_light():
    code = (
        "import sys, polyfuse; names = dir(polyfuse); light = 'torch' not in sys.modules; "
        "print(','.join(n for n in names if not n.startswith('_'))); print(light)"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    names, light = p.stdout.split()
    names = names.split(",")
    for name in ("AutoModelForCausalLM", "LlamaForCausalLM", "patch", "unpatch", "PolyfuseTrainer", "load_tokenizer"):
        assert name in names, name
    assert light == "True"  # dir() lists the lazy names without importing torch
    import polyfuse

    assert polyfuse.AutoModelForCausalLM is AutoModelForCausalLM
