"""Selection of the NVIDIA implementations (the ``triton`` and ``cuda`` plugins) on a fake CUDA context of an H200
(no GPU needed: probes are plain functions)."""

import subprocess
import sys

import pytest
import torch

from polyfuse.backends.triton import register as triton_register
from polyfuse.core import registry
from polyfuse.core.platform import Platform
from polyfuse.core.registry import SelectionContext as Ctx


CUDA = torch.device("cuda")
H200 = Platform("cuda", "cuda", "NVIDIA H200", (9, 0))


def SelectionContext(device, *args, **kw):  # noqa: N802  (the context of a run on an H200 unless told otherwise)
    if torch.device(device).type == "cuda":
        kw.setdefault("platform", H200)
    return Ctx(device, *args, **kw)


TRITON_OPS = {
    "rms_norm": "triton",
    "add_rms_norm": "triton",
    "rotary": "triton",
    "swiglu": "triton",
    "linear_cross_entropy": "triton_chunked",
}


def _cuda_impls():
    return {
        (i.op, i.name): i
        for op in registry.ops()
        for i in registry.implementations(op)
        if i.backend in ("cuda", "triton")
    }


def test_everything_registered_for_cuda_only():
    impls = _cuda_impls()
    for op, name in TRITON_OPS.items():
        assert (op, name) in impls
    assert ("attention", "sdpa_flash") in impls
    assert ("attention", "triton_decode") in impls
    assert not impls[("attention", "triton_decode")].supports_backward
    for impl in impls.values():
        assert impl.devices == ("cuda",)
        assert impl.probe is not None
        # Portable Triton kernels also serve ROCm; the NVIDIA-only pieces (SDPA choice, the GEMV tuned on NVIDIA
        # products) do not.
        portable = impl.backend == "triton" and impl.name != "triton_gemv"
        assert impl.platforms == (("cuda", "rocm") if portable else ("cuda",)), (impl.op, impl.name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("training", [False, True])
def test_cuda_context_picks_triton(dtype, training):
    assert triton_register.triton_unusable() is None, "triton should import in the dev env"
    kernels = registry.resolve(SelectionContext(CUDA, dtype, flags={"use_flash_attention": True}, training=training))
    for op, name in TRITON_OPS.items():
        choice = kernels.choices[op]
        assert (choice.implementation.backend, choice.implementation.name) == ("triton", name), choice.reason
    # Inference: the split-K decode kernel (it declines Lq > 1, which goes to SDPA); training: SDPA (no backward).
    attention = kernels.choices["attention"]
    assert attention.implementation.name == ("sdpa_flash" if training else "triton_decode")
    if not training:
        assert [i.name for i in attention.then] == ["sdpa_flash"]
    assert "triton:triton" in kernels.report()


@pytest.mark.parametrize("training", [False, True])
def test_projections_take_the_gemv_at_inference_only_and_the_report_says_when(training):
    kernels = registry.resolve(SelectionContext(CUDA, torch.bfloat16, training=training))
    for op in ("linear", "swiglu_linear"):
        impl = kernels.choices[op].implementation
        if training and op == "linear":  # inference-only: training keeps F.linear and its autograd
            assert impl.name == registry.NATIVE
        elif training:  # the composite by default; the recompute form is opt-in (it trades speed for memory)
            assert impl.name == registry.NATIVE and "opt-in" in dict(kernels.choices[op].skipped)["triton_recompute"]
            opted = registry.resolve(
                SelectionContext(CUDA, torch.bfloat16, training=True, overrides="swiglu_linear=triton_recompute")
            )
            assert opted.choices[op].implementation.name == "triton_recompute"
        else:
            assert (impl.backend, impl.name) == ("triton", "triton_gemv")
            assert "triton_recompute" not in [i.name for i in kernels.choices[op].then]
    report = kernels.report()
    assert ("Triton GEMV on the one-row shapes tuned for this GPU" in report) is not training
    # -swiglu is honoured inside the fold: the composite (with the native swiglu) runs instead.
    forced = registry.resolve(SelectionContext(CUDA, torch.bfloat16, training=training, overrides="-swiglu"))
    assert forced.choices["swiglu_linear"].implementation.name != "triton_recompute"


def test_gemv_table_applies_only_to_the_gpu_it_was_tuned_on(tmp_path):
    other = Platform("cuda", "cuda", "NVIDIA A100-SXM4-80GB", (8, 0))
    kernels = registry.resolve(SelectionContext(CUDA, torch.bfloat16, platform=other))
    assert kernels.choices["linear"].implementation.name == registry.NATIVE
    assert "no GEMV table tuned for NVIDIA A100" in kernels.choices["linear"].reason
    # a table of its own in a tile_configs folder (a tuning run on that GPU) turns the GEMV on there
    (tmp_path / "gemv").mkdir()
    (tmp_path / "gemv" / "NVIDIA_A100-SXM4-80GB.json").write_text('{"linear": {"4096,4096": [4, 4096, 8, 2]}}')
    ctx = SelectionContext(CUDA, torch.bfloat16, flags={"tile_configs": str(tmp_path)}, platform=other)
    kernels = registry.resolve(ctx)
    assert kernels.choices["linear"].implementation.name == "triton_gemv"
    assert "kernel options: tile_configs=" in kernels.report()
    rocm = Platform("rocm", "cuda", "AMD Instinct MI300X", (9, 4))
    kernels = registry.resolve(
        SelectionContext(CUDA, torch.bfloat16, flags={"use_flash_attention": True}, platform=rocm)
    )
    assert kernels.choices["linear"].implementation.name == registry.NATIVE
    assert kernels.choices["rms_norm"].implementation.backend == "triton"  # portable
    assert kernels.choices["attention"].implementation.name == "triton_decode"
    assert kernels.choices["attention"].then == []  # no SDPA choice on ROCm: declined calls go to native


def test_attention_needs_the_flag():
    kernels = registry.resolve(SelectionContext(CUDA, torch.bfloat16))
    assert kernels.choices["attention"].implementation.name == registry.NATIVE
    assert "use_flash_attention" in kernels.choices["attention"].reason


def test_float64_falls_back_with_reason():
    kernels = registry.resolve(SelectionContext(CUDA, torch.float64, flags={"use_flash_attention": True}))
    for op in list(TRITON_OPS) + ["attention"]:
        choice = kernels.choices[op]
        assert choice.implementation.name == registry.NATIVE
        assert "dtype float64 unsupported" in choice.reason, choice.reason


def test_probe_values(monkeypatch):
    monkeypatch.setattr(
        torch.version, "cuda", "13.0"
    )  # fp8_block_mm's probe reads torch's build (H200's: 2.11 / 13.0)
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    impls = _cuda_impls()
    for impl in impls.values():
        training = impl.name == "triton_recompute"  # training only, opt-in
        opt_in = "swiglu_linear=triton_recompute" if training else ""
        ok = SelectionContext(CUDA, torch.bfloat16, training=training, overrides=opt_in)
        assert impl.unusable_reason(ok) is None, impl.name
        f64 = SelectionContext(CUDA, torch.float64, training=training, overrides=opt_in)
        assert impl.unusable_reason(f64) == "dtype float64 unsupported"
        cpu = SelectionContext(torch.device("cpu"), torch.float32, training=training)
        assert "needs device cuda" in impl.unusable_reason(cpu)
    assert "training only" in impls["swiglu_linear", "triton_recompute"].unusable_reason(
        SelectionContext(CUDA, torch.bfloat16)
    )


def test_cpu_and_hpu_contexts_never_pick_cuda():
    for device in ("cpu", "hpu"):
        kernels = registry.resolve(
            SelectionContext(torch.device(device), torch.bfloat16, flags={"use_flash_attention": True})
        )
        for choice in kernels.choices.values():
            assert choice.implementation.backend not in ("cuda", "triton")


def test_triton_missing_falls_back(monkeypatch):
    monkeypatch.setattr(triton_register, "triton_unusable", lambda: "triton not importable (ImportError: test)")
    kernels = registry.resolve(SelectionContext(CUDA, torch.bfloat16, flags={"use_flash_attention": True}))
    for op in TRITON_OPS:
        assert kernels.choices[op].implementation.name == registry.NATIVE
        assert "triton not importable" in kernels.choices[op].reason
    # SDPA attention does not need triton.
    assert kernels.choices["attention"].implementation.name == "sdpa_flash"


def test_overrides():
    ctx = SelectionContext(CUDA, torch.bfloat16, overrides="-rms_norm,+attention")
    kernels = registry.resolve(ctx)
    assert kernels.choices["rms_norm"].implementation.name == registry.NATIVE
    assert kernels.choices["attention"].implementation.name == "triton_decode"
    kernels = registry.resolve(SelectionContext(CUDA, torch.bfloat16, overrides="attention=sdpa_flash"))
    assert kernels.choices["attention"].implementation.name == "sdpa_flash"
    kernels = registry.resolve(SelectionContext(CUDA, torch.bfloat16, overrides="swiglu=triton"))
    assert kernels.choices["swiglu"].implementation.name == "triton"


def test_import_does_not_load_triton_and_survives_without_it():
    """``import polyfuse`` plus registry resolution work when triton cannot be imported."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, polyfuse\n"
        "from polyfuse.core import registry\n"
        "registry.ops()\n"
        "assert 'triton' not in sys.modules\n"
        "k = registry.resolve(registry.SelectionContext(torch.device('cuda'), torch.bfloat16))\n"
        "print(k.choices['rms_norm'].implementation.name, '|', k.choices['rms_norm'].reason)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    name, reason = res.stdout.strip().splitlines()[-1].split(" | ")
    assert name != "triton" and "triton not importable" in reason


def test_tensor_parallel_all_reduce_takes_the_one_shot_kernel_for_decode_sizes_only():
    """Issue 11: the CUDA backend offers a one-shot all-reduce over symmetric memory (peer loads, no NVLink
    multicast) for decode-sized tensors; anything larger, strided or not on a GPU is declined to NCCL (native)."""
    from polyfuse.backends.cuda import symm_all_reduce as sar

    kernels = registry.resolve(SelectionContext(CUDA, torch.bfloat16))
    choice = kernels.choices["all_reduce"]
    if sar.unusable():
        assert choice.implementation.name == registry.NATIVE
        pytest.skip(sar.unusable())
    assert (choice.implementation.backend, choice.implementation.name) == ("cuda", "symm_one_shot")
    assert [i.name for i in choice.then] == []  # declined calls go to the native (NCCL) all-reduce

    class Group:
        group_name = "0"

    assert sar.accepts_all_reduce(torch.zeros(4096), None) == "no process group"
    assert "contiguous" in sar.accepts_all_reduce(torch.zeros(4096), Group())  # a CPU tensor
    assert sar.size_refusal(4096 * 2) is None  # batch-1 decode, hidden 4096, bf16
    assert "NCCL" in sar.size_refusal(sar.MAX_BYTES + 16)  # e.g. a prefill's activations
    assert "16 bytes" in sar.size_refusal(4095 * 2)
