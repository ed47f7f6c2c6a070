"""The op registry: selection by priority and probes, fallbacks and their log line, training mode, enable flags,
overrides (argument and POLYFUSE_OPS), the report, and resolution happening once per model build.

Tests use the real ops and register extra fake implementations with unique names on a test-only device type
("fakedev"); ``_IMPLS`` is replaced by a copy for each test, so nothing registered here outlives the test."""

import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import one_thread, tiny_config  # noqa: F401  (one_thread: autouse fixture)

from polyfuse.core import registry
from polyfuse.core.registry import Implementation, SelectionContext
from polyfuse.models.llama import LlamaForCausalLM
from polyfuse.ops.attention import attention_native


FAKEDEV = SimpleNamespace(type="fakedev")  # selection only reads ctx.device.type


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    registry.ops()
    monkeypatch.setattr(registry, "_IMPLS", {op: list(impls) for op, impls in registry._IMPLS.items()})
    monkeypatch.delenv(registry.ENV_OVERRIDES, raising=False)


def fake(op="rms_norm", name="fake_a", priority=200, probe=None, backward=False, devices=("fakedev",), fn=None):
    impl = Implementation(
        op,
        name,
        "fakebackend",
        devices,
        fn or (lambda *a: None),
        priority=priority,
        probe=probe,
        supports_backward=backward,
    )
    return registry.register(impl)


def ctx(**kw):
    return SelectionContext(device=kw.pop("device", FAKEDEV), **kw)


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == "polyfuse" and r.levelno >= logging.WARNING]


def test_every_declared_op_has_a_native_reference():
    ops = registry.ops()
    assert {"rms_norm", "add_rms_norm", "attention", "rotary", "swiglu", "linear_cross_entropy"} <= set(ops)
    for op in ops:
        impls = registry.implementations(op)
        assert impls[-1].name == registry.NATIVE and impls[-1].devices == ("*",)
    with pytest.raises(KeyError, match="unknown op"):
        registry.implementations("no_such_op")


def test_highest_priority_usable_implementation_wins():
    fake(name="fake_low", priority=200)
    fake(name="fake_high", priority=300)
    fake(name="fake_other_device", priority=999, devices=("otherdev",))
    choice = registry.select("rms_norm", ctx())
    assert choice.implementation.name == "fake_high"
    assert choice.reason.startswith("best usable for fakedev")  # exact text: test_reason_names_only_skips_...
    # Registration order does not matter, only priority.
    assert [i.name for i in registry.implementations("rms_norm")][:3] == ["fake_other_device", "fake_high", "fake_low"]


def test_reason_names_only_skips_meant_for_this_device():
    """The cuda/hpu implementations (priority 100-110) outrank this low-priority fake but were never candidates on
    fakedev; like the native-fallback reason and the log lines, the chosen reason should not list them."""
    fake(name="fake_low_priority", priority=10)
    choice = registry.select("rms_norm", ctx())
    assert choice.implementation.name == "fake_low_priority"
    assert choice.reason == "best usable for fakedev"


def test_duplicate_and_undeclared_registrations_are_refused():
    fake(name="fake_dup")
    with pytest.raises(ValueError, match="registered twice"):
        fake(name="fake_dup")
    with pytest.raises(ValueError, match="not declared"):
        fake(op="no_such_op", name="fake_x")


def test_probe_rejection_falls_back_to_next_without_warning(caplog):
    fake(name="fake_low", priority=200)
    fake(name="fake_high", priority=300, probe=lambda c: "fakelib not importable")
    with caplog.at_level(logging.INFO, logger="polyfuse"):
        choice = registry.select("rms_norm", ctx())
    assert choice.implementation.name == "fake_low"
    assert ("fake_high", "fakelib not importable") in choice.skipped
    assert "skipped fake_high" in choice.reason
    assert not warnings_of(caplog)
    assert any("fake_high unusable (fakelib not importable)" in r.getMessage() for r in caplog.records)


def test_all_rejected_falls_back_to_native_with_one_warning(caplog):
    fake(name="fake_low", priority=200, probe=lambda c: "dtype float64 unsupported")
    fake(name="fake_high", priority=300, probe=lambda c: "fakelib not importable")
    with caplog.at_level(logging.INFO, logger="polyfuse"):
        choice = registry.select("rms_norm", ctx(dtype=torch.float64))
    assert choice.implementation.name == registry.NATIVE
    assert choice.reason == "fallback: fake_high: fakelib not importable; fake_low: dtype float64 unsupported"
    warns = warnings_of(caplog)
    assert len(warns) == 1
    msg = warns[0].getMessage()
    assert "rms_norm falls back to native" in msg and "fakelib not importable" in msg and "\n" not in msg


def test_other_devices_implementations_are_neither_logged_nor_reasons(caplog):
    # On a plain CPU run the cuda/hpu implementations do not apply: native is "reference", silently.
    with caplog.at_level(logging.INFO, logger="polyfuse"):
        kernels = registry.resolve(ctx(device=torch.device("cpu")))
    assert not [r for r in caplog.records if r.name == "polyfuse"]
    assert {c.implementation.name for c in kernels.choices.values()} == {registry.NATIVE}
    assert kernels.choices["rms_norm"].reason == "reference"


def test_training_skips_implementations_without_backward():
    fake(name="fake_fwd_only", priority=300, backward=False)
    fake(name="fake_with_bwd", priority=200, backward=True)
    assert registry.select("rms_norm", ctx()).implementation.name == "fake_fwd_only"
    choice = registry.select("rms_norm", ctx(training=True))
    assert choice.implementation.name == "fake_with_bwd"
    assert ("fake_fwd_only", "has no backward (training run)") in choice.skipped


def test_training_without_any_backward_falls_back_to_native(caplog):
    fake(name="fake_fwd_only", backward=False)
    choice = registry.select("rms_norm", ctx(training=True))
    assert choice.implementation.name == registry.NATIVE
    assert "has no backward" in choice.reason
    assert len(warnings_of(caplog)) == 1


def test_enable_flag_gates_attention():
    fake(op="attention", name="fake_flash")
    off = registry.select("attention", ctx())
    assert off.implementation.name == registry.NATIVE
    assert off.reason == "--use_flash_attention not set"
    on = registry.select("attention", ctx(flags={"use_flash_attention": True}))
    assert on.implementation.name == "fake_flash"
    forced = registry.resolve(ctx(overrides="+attention"))
    assert forced.choices["attention"].implementation.name == "fake_flash"
    # Ops without an enable flag are on by default.
    fake(op="swiglu", name="fake_swiglu")
    assert registry.select("swiglu", ctx()).implementation.name == "fake_swiglu"


def test_minus_override_forces_native():
    fake(name="fake_a")
    choice = registry.resolve(ctx(overrides="-rms_norm")).choices["rms_norm"]
    assert choice.implementation.name == registry.NATIVE
    assert choice.reason == "forced native by override -rms_norm"
    # Only the named op: the others keep their fused implementation.
    fake(op="swiglu", name="fake_swiglu")
    assert registry.resolve(ctx(overrides="-rms_norm")).choices["swiglu"].implementation.name == "fake_swiglu"


def test_named_override_picks_by_name(caplog):
    fake(name="fake_low", priority=200)
    fake(name="fake_high", priority=300)
    choice = registry.resolve(ctx(overrides="rms_norm=fake_low")).choices["rms_norm"]
    assert choice.implementation.name == "fake_low"
    assert choice.reason == "requested by override rms_norm=fake_low"
    native = registry.resolve(ctx(overrides="rms_norm=native")).choices["rms_norm"]
    assert native.implementation.name == registry.NATIVE
    # A named implementation that cannot run here: one warning, then the normal order without it.
    fake(name="fake_broken", priority=150, probe=lambda c: "fakelib too old")
    choice = registry.resolve(ctx(overrides="rms_norm=fake_broken")).choices["rms_norm"]
    assert choice.implementation.name == "fake_high"
    assert ("fake_broken", "fakelib too old") in choice.skipped
    warns = warnings_of(caplog)
    assert len(warns) == 1 and "requested fake_broken is unusable (fakelib too old)" in warns[0].getMessage()


def test_later_override_entries_win():
    assert registry.parse_overrides(" +rms_norm , -rms_norm,attention = native,, ") == {
        "rms_norm": "-",
        "attention": "native",
    }
    assert registry.parse_overrides("") == {}


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "+no_such_op",
            r"unknown op 'no_such_op' \(known: add_rms_norm, add_rms_norm_linear_q, all_reduce, attention,",
        ),
        ("no_such_op=native", "unknown op 'no_such_op'"),
        ("rms_norm", r"bad op override 'rms_norm': use \+op, -op or op=implementation"),
        ("rms_norm=no_such_impl", "op 'rms_norm' has no implementation 'no_such_impl' \\(registered: .*native"),
    ],
)
def test_bad_overrides_raise_clear_value_errors(text, match):
    with pytest.raises(ValueError, match=match):
        registry.resolve(ctx(device=torch.device("cpu"), overrides=text))


def test_env_overrides(monkeypatch):
    fake(name="fake_a")
    fake(op="swiglu", name="fake_swiglu")
    monkeypatch.setenv(registry.ENV_OVERRIDES, "-rms_norm,-swiglu")
    k = registry.resolve(ctx())
    assert k.choices["rms_norm"].implementation.name == registry.NATIVE
    assert k.choices["swiglu"].implementation.name == registry.NATIVE
    # The run's own overrides win over the environment, op by op.
    k = registry.resolve(ctx(overrides="rms_norm=fake_a"))
    assert k.choices["rms_norm"].implementation.name == "fake_a"
    assert k.choices["swiglu"].implementation.name == registry.NATIVE
    monkeypatch.setenv(registry.ENV_OVERRIDES, "garbage")
    with pytest.raises(ValueError, match="bad op override 'garbage'"):
        registry.resolve(ctx())


def test_report_lists_every_op_with_backend_name_and_reason():
    fake(name="fake_a")
    fake(op="swiglu", name="fake_swiglu", probe=lambda c: "fakelib missing")
    k = registry.resolve(ctx(dtype=torch.bfloat16))
    text = k.report()
    lines = text.splitlines()
    assert lines[0] == "polyfuse backends (device=fakedev, platform=fakedev, dtype=bfloat16):"
    assert len(lines) == 1 + len(registry.ops())
    for op in registry.ops():
        line = next(line for line in lines[1:] if line.split()[0] == op)
        c = k.choices[op]
        assert f"{c.implementation.backend}:{c.implementation.name}" in line
        assert line.split(" [")[0].rstrip().endswith(c.reason)
    assert "fakebackend:fake_a" in text
    assert "native:native" in text and "fallback: fake_swiglu: fakelib missing" in text
    d = k.as_dict()
    assert set(d) == set(registry.ops())
    assert d["rms_norm"] == {"backend": "fakebackend", "implementation": "fake_a", "reason": "best usable for fakedev"}
    assert d["attention"]["reason"] == "--use_flash_attention not set"


# -- resolution once per model build ----------------------------------------------------------------------------


def test_model_build_uses_flags_and_overrides():
    """A fake CPU attention: native without --use_flash_attention, chosen (and called) with the flag or +attention."""
    calls = []

    def counting_attention(q, k, v, meta):
        calls.append(q.shape)
        return attention_native(q, k, v, meta)

    fake(op="attention", name="fake_cpu_flash", devices=("cpu",), fn=counting_attention)
    cfg = tiny_config(hidden_size=32, intermediate_size=64, vocab_size=64)
    ids = torch.tensor([[11, 12, 13]])

    plain = LlamaForCausalLM.from_config(cfg)
    assert plain.kernels.choices["attention"].implementation.name == registry.NATIVE
    plain(ids)
    assert calls == []

    for kw in ({"flags": {"use_flash_attention": True}}, {"overrides": "+attention"}):
        model = LlamaForCausalLM.from_config(cfg, **kw)
        assert model.kernels.choices["attention"].implementation.name == "fake_cpu_flash"
        model(ids)
        assert len(calls) == cfg.num_hidden_layers
        calls.clear()
    model = LlamaForCausalLM.from_config(cfg, flags={"use_flash_attention": True}, overrides="-attention")
    assert model.kernels.choices["attention"].implementation.name == registry.NATIVE


def test_resolution_happens_once_per_build(monkeypatch):
    count = []
    real_select = registry.select

    def counting_select(*a, **kw):
        count.append(a[0])
        return real_select(*a, **kw)

    monkeypatch.setattr(registry, "select", counting_select)
    cfg = tiny_config(hidden_size=32, intermediate_size=64, vocab_size=64)
    model = LlamaForCausalLM.from_config(cfg).eval()
    assert sorted(count) == sorted(registry.ops())
    count.clear()
    kernels = model.kernels
    ids = torch.tensor([[11, 12, 13, 14]])
    with torch.no_grad():
        model(ids)
        model(ids, attention_mask=torch.tensor([[0, 1, 1, 1]]))
    model.generate(ids, max_new_tokens=5, ignore_eos=True)
    model.generate(ids, max_new_tokens=5, ignore_eos=True, use_cache=False)
    model.generate(torch.cat([ids, ids]), max_new_tokens=3, ignore_eos=True, bucket_size=4)
    assert count == []
    assert model.kernels is kernels


def test_flag_asking_for_a_fused_op_the_device_lacks_warns(caplog):
    """--use_flash_attention on a device with no fused attention: the native one runs, with one warning and a reason."""
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        kernels = registry.resolve(SelectionContext(torch.device("cpu"), flags={"use_flash_attention": True}))
    choice = kernels.choices["attention"]
    assert choice.implementation.name == "native"
    assert "--use_flash_attention has no implementation on cpu" in choice.reason
    lines = [r.getMessage() for r in caplog.records if "use_flash_attention" in r.getMessage()]
    assert len(lines) == 1 and "native one runs" in lines[0]


# -- declined calls and composite ops ----------------------------------------------------------------------------------


def _guarded(name, priority, taken, calls, quiet=False, op="rms_norm"):
    """A fake implementation that takes only inputs whose last dim is in ``taken``, recording its calls."""
    impl = Implementation(
        op, name, "fakebackend", ("fakedev",), lambda x, w, eps: calls.append(name) or x * 0 + priority,
        priority=priority, accepts=lambda x, w, eps: None if x.shape[-1] in taken else f"dim {x.shape[-1]}",
        quiet_decline=quiet,
    )  # fmt: skip
    return registry.register(impl)


def test_declined_call_walks_the_choice_chain_then_native(caplog):
    calls = []
    _guarded("big", 300, {8}, calls)
    _guarded("small", 200, {4}, calls, quiet=True)
    k = registry.resolve(ctx())
    choice = k.choices["rms_norm"]
    assert choice.implementation.name == "big" and [i.name for i in choice.then] == ["small"]
    w = torch.ones(1)
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        assert float(k.rms_norm(torch.ones(2, 8), w, 1e-6)[0, 0]) == 300
        assert float(k.rms_norm(torch.ones(2, 4), w, 1e-6)[0, 0]) == 200
        for _ in range(3):
            out = k.rms_norm(torch.full((2, 3), 2.0), w, 1e-6)  # nobody takes dim 3: the native reference
    torch.testing.assert_close(out, torch.ones(2, 3))
    assert calls == ["big", "small"]
    msgs = [r.getMessage() for r in warnings_of(caplog)]
    # "big" declines loudly once per cause (dim 4, dim 3); "small" is quiet.
    assert len(msgs) == 2 and all("big cannot take this input" in m for m in msgs)
    assert "declined inputs go to small, native" in k.report()


def test_composite_op_runs_the_runs_own_choices_of_its_parts():
    """rotary_kv_write without a fused kernel is rotary (the run's choice, here a fake) + the cache write; -swiglu
    is honoured inside swiglu_linear's composite definition."""
    seen = []

    def fake_rotary(q, k, cos, sin):
        seen.append("rotary")
        return q + 1, k + 1

    fake(op="rotary", name="fake_rotary", fn=fake_rotary)
    fake(op="swiglu", name="fake_swiglu", fn=lambda g, u: seen.append("swiglu") or g * u)
    k = registry.resolve(ctx(overrides="-rotary_kv_write"))
    assert k.choices["rotary_kv_write"].implementation.name == registry.NATIVE
    assert "composite: rotary + cache write" in k.report()
    q, key, v = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4), torch.full((1, 1, 1, 4), 3.0)
    kc, vc = torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 4)
    qo = k.rotary_kv_write(q, key, v, None, None, kc, vc, torch.tensor([2]))
    assert seen == ["rotary"] and torch.equal(qo, q + 1)
    assert torch.equal(kc[:, :, 2], torch.ones(1, 1, 4)) and torch.equal(vc[:, :, 2], torch.full((1, 1, 4), 3.0))
    g, u, w = torch.randn(1, 3), torch.randn(1, 3), torch.randn(2, 3)
    torch.testing.assert_close(k.swiglu_linear(g, u, w), (g * u) @ w.T)
    assert seen == ["rotary", "swiglu"]
    k = registry.resolve(ctx(overrides="-swiglu"))
    torch.testing.assert_close(k.swiglu_linear(g, u, w), (torch.nn.functional.silu(g) * u) @ w.T)
    assert seen == ["rotary", "swiglu"]


def test_python_api_warns_once_per_flag_the_device_cannot_honour(caplog):
    """flags={"use_cuda_graphs": True} on the CPU through the Python API: one warning naming what runs instead, and
    the flag is off in the model (issue 14)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        model = LlamaForCausalLM.from_config(cfg, flags={"use_cuda_graphs": True, "use_hpu_graphs": True})
    msgs = [r.getMessage() for r in warnings_of(caplog)]
    assert len(msgs) == 2 and any("--use_cuda_graphs needs device cuda" in m for m in msgs), msgs
    assert not model.flags["use_cuda_graphs"] and not model.flags["use_hpu_graphs"]


def test_cuda_graph_prefill_flag_needs_cuda_graphs_and_wraps_only_the_prompt_step():
    """--cuda_graph_prefill: honoured by the CUDA runtime with --use_cuda_graphs (the prompt step becomes a
    GraphedStep beside the decode steps); alone it is turned off with one warning; the default leaves the prompt
    step eager."""
    from polyfuse.backends.cuda.graphs import GraphedStep
    from polyfuse.backends.cuda.runtime import CudaRuntime
    from polyfuse.core.flags import check_flags

    flags, warnings = check_flags("cuda", {"cuda_graph_prefill": True})
    assert warnings == ["--cuda_graph_prefill without --use_cuda_graphs: ignored"] and not flags["cuda_graph_prefill"]
    runtime = CudaRuntime(torch.device("cpu"))  # no capture happens here: only the wrapping is checked
    module = torch.nn.Identity()
    both = {"use_cuda_graphs": True, "cuda_graph_prefill": True}
    for flags, graphed in (({"use_cuda_graphs": True}, {"decode", "token"}), (both, {"decode", "token", "prefill"}),
                           ({"cuda_graph_prefill": True}, set())):  # fmt: skip
        assert check_flags("cuda", flags)[0].get("cuda_graph_prefill", False) == (flags == both)
        for phase in ("prefill", "decode", "token"):
            step = runtime.graph_module(module, phase, flags)
            assert isinstance(step, GraphedStep) == (phase in graphed), (flags, phase)
