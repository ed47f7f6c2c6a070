"""optimum-habana 1.21's GaudiTrainingArguments on PolyfuseTrainingArguments: every field of its wheel's class (read
with ast into tests/data, with the source path) exists with its name, type and default, is classified (implemented,
warned, refused) in polyfuse/training/gaudi_arguments.py and in docs/training.md's table, and does what it says:
throughput metrics without the warm-up steps, Hub gaudi configs from the local Hugging Face cache, HPU graphs and
mark_steps on the Habana test double, torch's dynamo settings, the profiler."""

import json
import re
import typing
from pathlib import Path
from typing import Optional, Union  # noqa: F401  (optimum-habana's annotations are evaluated with these names)

import pytest
import torch
from helpers import one_thread, tiny_llama  # noqa: F401  (autouse)
from transformers import HfArgumentParser
from transformers.training_args import OptimizerNames  # noqa: F401

from polyfuse.training import PolyfuseTrainer, PolyfuseTrainingArguments, arguments
from polyfuse.training.gaudi_arguments import GAUDI_FIELDS, OWN_DEFAULTS, GaudiTrainingFields
from polyfuse.training.gaudi_config import GaudiConfig
from polyfuse.training.throughput import eval_counts, warmup_throughput


DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent
FIELDS = json.loads((DATA / "optimum_habana_1.21_training_args.json").read_text())["fields"]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    return PolyfuseTrainingArguments(**{**base, **kw})


def _dataset(n=12, length=16):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (n, length), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


# -- the field table --------------------------------------------------------------------------------------------


def test_the_extracted_list_is_optimum_habanas_43_fields():
    assert len(FIELDS) == 43 and len({f["name"] for f in FIELDS}) == 43


@pytest.mark.parametrize("spec", FIELDS, ids=[f["name"] for f in FIELDS])
def test_every_field_with_its_type_default_and_choices(spec):
    """Each field exists with optimum-habana's default (polyfuse's own defaults are listed with the reason) and, where
    polyfuse defines it, optimum-habana's annotation and choices."""
    fields = PolyfuseTrainingArguments.__dataclass_fields__
    name = spec["name"]
    assert name in fields, name
    f = fields[name]
    if name not in OWN_DEFAULTS:
        assert f.default == spec["default"], (name, f.default, spec["default"])
    if name in GaudiTrainingFields.__dataclass_fields__:
        hints = typing.get_type_hints(PolyfuseTrainingArguments)
        assert hints[name] == eval(spec["type"]), (name, hints[name], spec["type"])
        assert f.metadata.get("choices") == spec.get("choices"), name
    assert name in GAUDI_FIELDS, f"{name} is not classified in gaudi_arguments.GAUDI_FIELDS"


def test_docs_table_names_every_field_with_its_status():
    text = (ROOT / "docs" / "training.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \|[^|]*\| (implemented|warned|refused) \|", text, re.M))
    for spec in FIELDS:
        assert spec["name"] in rows, f"{spec['name']} missing from docs/training.md's GaudiTrainingArguments table"
        assert rows[spec["name"]] == GAUDI_FIELDS[spec["name"]][0], spec["name"]


def test_optional_bools_take_a_bare_flag_and_explicit_values():
    """optimum-habana's Optional[bool] fields parse as its README lines give them: bare, True or False."""
    p = HfArgumentParser(PolyfuseTrainingArguments)
    for name in ("use_hpu_graphs_for_inference", "pipelining_fwd_bwd", "use_regional_compilation", "use_lazy_mode"):
        assert getattr(p.parse_args(["--output_dir", "o", f"--{name}"]), name) is True
        assert getattr(p.parse_args(["--output_dir", "o", f"--{name}", "False"]), name) is False
    ns = p.parse_args(["--output_dir", "o", "--distribution_strategy", "fast_ddp", "--attn_implementation",
                       "gaudi_fused_sdpa", "--throughput_warmup_steps", "3", "--cache_size_limit", "64"])  # fmt: skip
    assert (ns.distribution_strategy, ns.attn_implementation, ns.throughput_warmup_steps, ns.cache_size_limit) == (
        "fast_ddp", "gaudi_fused_sdpa", 3, 64)  # fmt: skip


# -- validation: refused, warned, implemented ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"fp8": True}, "--fp8"),
        ({"flash_attention_fp8": True}, "--flash_attention_fp8"),
        ({"context_parallel_size": 4}, "--context_parallel_size 4"),
        ({"throughput_warmup_steps": -1}, "--throughput_warmup_steps must be >= 0"),
        ({"use_hpu_graphs_for_inference": True}, "can only be used with --use_habana"),
        ({"max_hpu_graphs": 4}, "--max_hpu_graphs needs HPU graphs"),
        ({"disable_tensor_cache_hpu_graphs": True}, "--disable_tensor_cache_hpu_graphs needs HPU graphs"),
        ({"flash_attention_fast_softmax": True}, "need --use_flash_attention"),
        ({"flash_attention_recompute": True, "attn_implementation": "sdpa"}, "--attn_implementation gaudi_fused_sdpa"),
    ],
)
def test_refused_values_are_one_line_naming_the_field(tmp_path, kw, needle):
    with pytest.raises(ValueError) as e:
        _args(tmp_path, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value), e.value


def test_values_that_change_nothing_here_are_one_note_each(tmp_path):
    args = _args(tmp_path, pipelining_fwd_bwd=True, cache_size_limit=8, use_regional_compilation=True,
                 ignore_eos=False, minimize_memory=True, use_hpu_graphs=False, distribution_strategy="fast_ddp",
                 use_zero3_leaf_promotion=True, attn_softmax_bf16=True)  # fmt: skip
    notes = args.gaudi_notes
    for name in (
        "pipelining_fwd_bwd",
        "cache_size_limit",
        "use_regional_compilation",
        "ignore_eos",
        "minimize_memory",
        "distribution_strategy",
        "use_zero3_leaf_promotion",
        "attn_softmax_bf16",
    ):
        assert sum(n.startswith(f"--{name}") for n in notes) == 1, (name, notes)
    assert all("\n" not in n for n in notes)
    assert _args(tmp_path).gaudi_notes == []


def test_gaudi_fused_sdpa_is_fused_attention(tmp_path):
    args = _args(tmp_path, attn_implementation="gaudi_fused_sdpa", flash_attention_causal_mask=True)
    assert args.use_flash_attention and args.polyfuse_flags()["flash_attention_causal_mask"]


@pytest.fixture
def compile_env(monkeypatch):
    """transformers 4.55 hands --torch_compile to accelerate through ACCELERATE_DYNAMO_* variables that outlive the
    arguments: removed again after the test, so later tests do not compile."""
    for name in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_DYNAMIC"):
        monkeypatch.setenv(name, "")  # recorded, so that teardown puts back what was there (or nothing)
        monkeypatch.delenv(name)


def test_torch_settings_as_optimum_habana_sets_them(tmp_path, compile_env):
    import torch._dynamo

    names = ("cache_size_limit", "allow_unspec_int_on_nn_module", "compiled_autograd")
    before = {n: getattr(torch._dynamo.config, n) for n in names}
    sdp = torch._C._get_math_sdp_allow_fp16_bf16_reduction()
    try:
        _args(tmp_path, torch_compile=True, cache_size_limit=17, allow_unspec_int_on_nn_module=False,
              use_compiled_autograd=True, sdp_on_bf16=True)  # fmt: skip
        assert torch._dynamo.config.cache_size_limit == 17
        assert torch._dynamo.config.allow_unspec_int_on_nn_module is False
        assert torch._dynamo.config.compiled_autograd is True
        assert torch._C._get_math_sdp_allow_fp16_bf16_reduction() is True
    finally:
        torch._C._set_math_sdp_allow_fp16_bf16_reduction(sdp)
        for n, v in before.items():
            setattr(torch._dynamo.config, n, v)


def test_compile_dynamic_and_regional_compilation_reach_accelerates_plugin(tmp_path, compile_env):
    trainer = PolyfuseTrainer(tiny_llama(), _args(tmp_path, torch_compile=True, compile_dynamic=False,
                                                  use_regional_compilation=True))  # fmt: skip
    plugin = trainer.accelerator.state.dynamo_plugin
    assert plugin.dynamic is False and plugin.use_regional_compilation is True


def test_compile_from_sec_iteration_runs_each_epochs_first_step_eagerly(tmp_path, monkeypatch, compile_env):
    stances = []
    monkeypatch.setattr(torch.compiler, "set_stance", lambda s, **kw: stances.append(s))
    args = _args(tmp_path, torch_compile=True, compile_from_sec_iteration=True, num_train_epochs=2,
                 per_device_train_batch_size=4, max_steps=-1, torch_compile_backend="eager")  # fmt: skip
    trainer = PolyfuseTrainer(tiny_llama(), args, train_dataset=_dataset(8))
    from accelerate.utils import DynamoBackend

    trainer.accelerator.state.dynamo_plugin.backend = DynamoBackend.NO  # the stances are under test, not dynamo
    trainer.train()
    assert stances == ["force_eager", "default"] * 2


def test_non_blocking_data_copy(tmp_path):
    seen = []

    class Spy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.to:
                seen.append((kwargs or {}).get("non_blocking", False))
            return super().__torch_function__(func, types, args, kwargs)

    for flag in (True, False):
        trainer = PolyfuseTrainer(tiny_llama(), _args(tmp_path, non_blocking_data_copy=flag))
        trainer._prepare_inputs({"input_ids": torch.ones(2, 3, dtype=torch.long).as_subclass(Spy)})
        assert seen.pop() is flag


def test_profiling_steps_write_a_trace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _args(tmp_path / "out", max_steps=3, per_device_train_batch_size=2, profiling_warmup_steps=1,
                 profiling_steps=1)  # fmt: skip
    PolyfuseTrainer(tiny_llama(), args, train_dataset=_dataset()).train()
    traces = list((tmp_path / "hpu_profile" / "train").glob("*.pt.trace.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]


# -- throughput ---------------------------------------------------------------------------------------------------


def test_warmup_throughput_numbers():
    """optimum-habana's speed_metrics: 40 samples in 10 steps of 4 over 10 s, 3 warm-up steps ending at 4 s, 1 s
    logging: (40 - 12) / (10 - 1 - 4) = 5.6 samples/s, (10 - 3) / 5 = 1.4 steps/s."""
    got = warmup_throughput("train", 10.0, 40, 10, 3, 4, after_warmup_s=4.0, excluded_s=1.0)
    assert got == {"train_samples_per_second": 5.6, "train_steps_per_second": 1.4}
    # warm-up never reached: samples and steps still reduced, time not (as optimum-habana's)
    assert warmup_throughput("train", 10.0, 40, 10, 3, 4) == {"train_samples_per_second": 2.8,
                                                               "train_steps_per_second": 0.7}  # fmt: skip
    assert warmup_throughput("eval", 2.0, 8, 2, 0, 4) == {"eval_samples_per_second": 4.0, "eval_steps_per_second": 1.0}
    # evaluation: 10 samples in batches of 4 are 3 steps; 3 warm-up steps are then kept in
    assert eval_counts(10, 4, 2) == (10, 3, 2) and eval_counts(10, 4, 3) == (10, 3, 0)


def test_trainer_speed_metrics_leave_the_warmup_steps_out(tmp_path):
    args = _args(tmp_path, max_steps=5, per_device_train_batch_size=2, logging_steps=1, throughput_warmup_steps=2,
                 adjust_throughput=True, per_device_eval_batch_size=2)  # fmt: skip
    trainer = PolyfuseTrainer(tiny_llama(), args, train_dataset=_dataset(), eval_dataset=_dataset(8))
    m = trainer.train().metrics
    clock = trainer.throughput
    assert clock.after_warmup is not None and clock.excluded_s > 0  # five loss logs were timed
    runtime = m["train_runtime"] - (clock.after_warmup - clock.start) - clock.excluded_s
    assert m["train_samples_per_second"] == pytest.approx((10 - 2 * 2) / runtime, rel=2e-3)
    assert m["train_steps_per_second"] == pytest.approx((5 - 2) / runtime, rel=2e-3)
    assert m["train_tokens_per_second"] == pytest.approx((10 - 4) * 16 / runtime, rel=2e-3)
    # 7 samples in batches of 2 are 4 steps; without the 2 warm-up steps 3 samples in 2 steps (transformers: 7 in 4)
    e = trainer.evaluate(_dataset(7))
    assert e["eval_samples_per_second"] / e["eval_steps_per_second"] == pytest.approx(3 / 2, rel=2e-3)


# -- Hub gaudi configs from the local cache ------------------------------------------------------------------------


def _cache_gaudi_config(cache: Path, repo: str, data: dict) -> None:
    """A Hugging Face cache entry as huggingface_hub lays it out: refs/main -> snapshots/<commit>/<file>."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "gaudi_config.json").write_text(json.dumps(data))


def test_hub_gaudi_config_read_from_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    _cache_gaudi_config(tmp_path, "Habana/llama", {"use_fused_adam": True, "use_fused_clip_norm": True,
                                                   "use_torch_autocast": True, "optimum_version": "1.21"})  # fmt: skip
    cfg = GaudiConfig.from_pretrained("Habana/llama")
    assert (cfg.use_fused_adam, cfg.use_fused_clip_norm, cfg.use_torch_autocast) == (True, True, True)
    with pytest.raises(ValueError) as e:
        GaudiConfig.from_pretrained("Habana/gpt2")
    msg = str(e.value)
    assert "\n" not in msg and "'Habana/gpt2'" in msg and "hf download Habana/gpt2 gaudi_config.json" in msg


# -- on the Habana test double ------------------------------------------------------------------------------------


@pytest.fixture
def gaudi(monkeypatch):
    """The test double in lazy mode; arguments see a Gaudi, the Trainer runs on the CPU with the HPU runtime."""
    from test_hpu_backend import _forget_habana, _import_double

    double = _import_double(monkeypatch, True)
    import habana_frameworks.torch  # noqa: F401

    monkeypatch.setattr(arguments, "hpu_available", lambda: True)
    yield double
    _forget_habana()


def _gaudi_trainer(tmp_path, model=None, **kw):
    from polyfuse.backends.hpu.runtime import HpuRuntime

    args = _args(tmp_path, use_habana=True, **kw)
    trainer = PolyfuseTrainer(model or tiny_llama(), args, train_dataset=_dataset(), eval_dataset=_dataset(4))
    trainer.runtime = HpuRuntime(torch.device("hpu"))
    return trainer


def test_habana_defaults_under_use_habana(gaudi, tmp_path):
    args = _args(tmp_path, use_habana=True)
    assert (
        args.optim,
        args.adam_epsilon,
        args.logging_nan_inf_filter,
        args.ddp_bucket_cap_mb,
        args.ddp_find_unused_parameters,
        args.use_lazy_mode,
    ) == ("adamw_torch", 1e-6, False, 230, False, True)
    explicit = _args(tmp_path, use_habana=True, adam_epsilon=1e-7, optim="sgd")
    assert (explicit.optim, explicit.adam_epsilon) == ("sgd", 1e-7)
    with pytest.raises(ValueError, match="--fp16 is not supported with --use_habana"):
        _args(tmp_path, use_habana=True, fp16=True)


def test_pipelining_fwd_bwd_adds_a_mark_step_between_forward_and_backward(gaudi, tmp_path):
    counts = []
    for pipelining in (False, True):
        gaudi.reset()
        _gaudi_trainer(tmp_path, max_steps=2, per_device_train_batch_size=2, pipelining_fwd_bwd=pipelining).train()
        counts.append(len(gaudi.calls("mark_step")))
    assert counts == [2 * 2, 2 * 3]  # after the backward and the optimizer step; and between forward and backward


def test_hpu_graphs_for_training_go_through_module_cacher(gaudi, tmp_path):
    trainer = _gaudi_trainer(tmp_path, max_steps=1, per_device_train_batch_size=2, use_hpu_graphs_for_training=True)
    trainer.train()
    assert [a[0] for a, _ in gaudi.calls("ModuleCacher")] == [trainer.model]


def test_hpu_graphs_for_inference_wrap_the_model_for_evaluation(gaudi, tmp_path, monkeypatch):
    """Evaluation on the double's HPU: the model wrapped once by wrap_in_hpu_graph with optimum-habana's keywords;
    the second evaluation replays the captured graphs and gives the same loss."""
    args = _args(tmp_path, use_habana=True, use_hpu_graphs_for_inference=True, max_hpu_graphs=3,
                 disable_tensor_cache_hpu_graphs=True, per_device_eval_batch_size=2)  # fmt: skip
    from polyfuse.models.llama import LlamaForCausalLM

    cfg = tiny_llama().config
    with torch.device("cpu"):
        ref = LlamaForCausalLM.from_config(cfg, seed=4)
        want = PolyfuseTrainer(ref, _args(tmp_path / "cpu"), eval_dataset=_dataset(4)).evaluate()
        model = LlamaForCausalLM.from_config(cfg, seed=4)
    # the Trainer places the model and the batches on the double's HPU
    monkeypatch.setattr(PolyfuseTrainingArguments, "device", property(lambda self: torch.device("hpu")))
    trainer = PolyfuseTrainer(model, args, eval_dataset=_dataset(4))
    from polyfuse.backends.hpu.runtime import HpuRuntime

    trainer.runtime = HpuRuntime(torch.device("hpu"))
    first = trainer.evaluate()["eval_loss"]
    wraps = gaudi.calls("wrap_in_hpu_graph")
    assert len(wraps) == 1 and wraps[0][0][0] is trainer.model and wraps[0][1]["max_graphs"] == 3
    # two batches of one shape: one graph captured, replayed for the second batch
    assert (len(gaudi.calls("hpu_graph_capture")), len(gaudi.calls("hpu_graph_replay"))) == (1, 1)
    assert first == pytest.approx(want["eval_loss"], rel=1e-6)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(first, rel=1e-6)
    assert len(gaudi.calls("hpu_graph_replay")) == 3 and len(gaudi.calls("wrap_in_hpu_graph")) == 1


def test_hpu_graphs_in_eager_mode_are_refused(monkeypatch, tmp_path):
    from test_hpu_backend import _forget_habana, _import_double

    _import_double(monkeypatch, False)
    import habana_frameworks.torch  # noqa: F401

    monkeypatch.setattr(arguments, "hpu_available", lambda: True)
    try:
        with pytest.raises(ValueError, match="cannot be used in eager mode"):
            _args(tmp_path, use_habana=True, use_hpu_graphs_for_inference=True)
    finally:
        _forget_habana()


def test_missing_hub_gaudi_config_fails_when_the_arguments_are_read(gaudi, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="hf download Habana/llama"):
        _args(tmp_path, use_habana=True, gaudi_config_name="Habana/llama")
