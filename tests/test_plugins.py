"""Backends as plugins, platform identity and the import layering.

* the out-of-tree example (examples/out_of_tree_backend), pip-installed into a temporary directory, is found
  through the entry-point group ``polyfuse.backends``, named by ``--print_backends`` for ``rms_norm``, and leaves the
  generated text unchanged;
* a broken plugin is skipped with exactly one ``warning:`` line naming it, and the built-in backends still load;
  ``POLYFUSE_PLUGINS`` selects; pyproject's entry points equal ``plugins.BUILTIN`` (the source-tree fallback);
* a ROCm GPU (``device.type == "cuda"``) is platform ``rocm``: NVIDIA-only implementations refuse it, and the
  GEMV's tuned tables apply only to the GPU they were measured on;
* every package imports only the layers below it (tests/test_plugins.py ALLOWED, a default rule for a new package),
  a backend only core, ops and itself, nothing outside the backends names one; the package has no import cycle
  (searched here, on the source).
"""

import ast
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import one_thread  # noqa: F401  (one_thread: autouse fixture)

from polyfuse.core import plugins, registry
from polyfuse.core.context import SelectionContext
from polyfuse.core.registry import Implementation


ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "out_of_tree_backend"


@pytest.fixture
def fresh_plugins(monkeypatch):
    """Plugins loaded anew by the test, and again (lazily, from the restored sys.path) after it."""
    monkeypatch.delenv(plugins.ENV_SELECT, raising=False)
    plugins.reset_for_tests()
    yield
    plugins.reset_for_tests()


# -- (a) the out-of-tree example, installed ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    """examples/out_of_tree_backend pip-installed (no deps, no index, no build isolation) into a temporary
    directory; built from a copy, so the build leaves nothing in the source tree."""
    src = tmp_path_factory.mktemp("example_src") / "out_of_tree_backend"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path_factory.mktemp("example_site")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet"]
    p = subprocess.run([*cmd, "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return target


@pytest.mark.slow
def test_example_is_an_installable_entry_point(installed_example):
    (dist,) = installed_example.glob("polyfuse_example_backend-*.dist-info")
    text = (dist / "entry_points.txt").read_text()
    assert "[polyfuse.backends]" in text and "example = polyfuse_example_backend:register" in text


def test_example_implementation_equals_the_reference(installed_example, monkeypatch):
    """The plugin's rms_norm is a real implementation: the reference's value, bit for bit, on the CPU."""
    from polyfuse.ops.rms_norm import rms_norm_native

    # Plugins loaded (and the registry copied) before the example is importable: this process never registers it.
    native = next(i for i in registry.implementations("rms_norm") if i.name == "native")
    monkeypatch.setattr(registry, "_IMPLS", {op: list(impls) for op, impls in registry._IMPLS.items()})
    monkeypatch.syspath_prepend(str(installed_example))
    monkeypatch.delitem(sys.modules, "polyfuse_example_backend", raising=False)
    import polyfuse_example_backend as example

    impl = example.IMPLEMENTATION
    assert (impl.op, impl.devices, impl.supports_backward) == ("rms_norm", ("cpu",), True)
    assert impl.priority > native.priority
    assert impl.unusable_reason(SelectionContext(torch.device("cpu"))) is None
    assert "needs device cpu" in impl.unusable_reason(SelectionContext(torch.device("cuda")))
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for shape in ((1, 7, 576), (3, 1, 64), (5, 100)):
            x = (torch.randn(shape, generator=gen) * 3).to(dtype)
            w = torch.randn(shape[-1], generator=gen).to(dtype)
            assert torch.equal(example.rms_norm(x, w, 1e-5), rms_norm_native(x, w, 1e-5)), (dtype, shape)


def _generate(out_dir: Path, pythonpath=None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for name in ("PYTHONPATH", plugins.ENV_SELECT, registry.ENV_OVERRIDES):
        env.pop(name, None)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    cmd = [
        sys.executable, str(ROOT / "examples" / "run_generation.py"), "--device", "cpu", "--print_backends",
        "--prompt", "What is the capital of France?", "--use_chat_template",
        "--max_new_tokens", "8", "--n_iterations", "1", "--warmup", "0", "--output_dir", str(out_dir),
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=out_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_example_plugin_runs_in_generation(installed_example, tmp_path):
    """Both runs at once (one thread each): the plugin's run names it for rms_norm; the text is the same."""
    runs = {}
    for key, pythonpath in (("without", None), ("with", installed_example)):
        (tmp_path / key).mkdir()
        runs[key] = _generate(tmp_path / key, pythonpath)
    outs = {}
    for key, p in runs.items():
        out, err = p.communicate(timeout=500)
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in out + err and "warning:" not in err, err[-3000:]
        outs[key] = (out, json.loads((tmp_path / key / "results.json").read_text()))
    (out_without, res_without), (out_with, res_with) = outs["without"], outs["with"]
    rms_line = [line for line in out_with.splitlines() if line.startswith("  rms_norm ")]
    assert len(rms_line) == 1 and rms_line[0].split()[1] == "example:torch_rms_norm", out_with
    assert "best usable for cpu" in rms_line[0]
    assert [line for line in out_without.splitlines() if line.startswith("  rms_norm ")][0].split()[1] == (
        "native:native"
    )
    assert res_with["backends"]["rms_norm"]["backend"] == "example"
    assert res_without["backends"]["rms_norm"]["backend"] == "native"
    # Every other op resolves as before: the plugin adds one choice and takes nothing away.
    assert {k: v for k, v in res_with["backends"].items() if k != "rms_norm"} == {
        k: v for k, v in res_without["backends"].items() if k != "rms_norm"
    }
    assert res_with["output"] == res_without["output"] and "Paris" in res_with["output"][0]


# -- (b) broken plugins, selection -----------------------------------------------------------------------------


def _fake_dist(where: Path, name: str, entry: str) -> None:
    """An installed distribution with only metadata and one ``polyfuse.backends`` entry point, found on sys.path."""
    dist = where / f"{name}-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[polyfuse.backends]\n{name} = {entry}\n")


@pytest.mark.parametrize(
    "entry, why",
    [
        ("pf_test_no_such_module.register:register", "ModuleNotFoundError: No module named 'pf_test_no_such_module'"),
        ("pf_test_raising_plugin:register", "RuntimeError: cannot register on this machine"),
    ],
    ids=["import_fails", "register_raises"],
)
def test_broken_plugin_is_skipped_with_one_warning(tmp_path, monkeypatch, caplog, fresh_plugins, entry, why):
    (tmp_path / "pf_test_raising_plugin.py").write_text(
        "def register():\n    raise RuntimeError('cannot register on this machine')\n"
    )
    _fake_dist(tmp_path, "broken_backend", entry)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pf_test_raising_plugin", raising=False)
    assert "broken_backend" in plugins.discovered()
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        loaded = plugins.load_plugins()
        plugins.load_plugins()  # once per process: no second attempt, no second warning
        kernels = registry.resolve(SelectionContext(torch.device("cpu")))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warning:")]
    assert len(lines) == 1, lines
    assert "'broken_backend'" in lines[0] and entry in lines[0] and why in lines[0], lines[0]
    assert "\n" not in lines[0]
    assert set(plugins.BUILTIN) <= set(loaded) and "broken_backend" not in loaded
    assert set(plugins.failed_plugins()) == {"broken_backend"}
    assert set(kernels.choices) == set(registry.ops())
    names = {i.name for i in registry.implementations("attention")}
    assert {"sdpa_flash", "triton_decode", "fused_sdpa"} <= names  # cuda, triton and hpu registered


def test_polyfuse_plugins_selects(monkeypatch, fresh_plugins):
    assert set(plugins.BUILTIN) <= set(plugins.discovered())
    monkeypatch.setenv(plugins.ENV_SELECT, "cuda, hpu")
    assert set(plugins.discovered()) == {"cuda", "hpu"}
    monkeypatch.setenv(plugins.ENV_SELECT, "")
    assert plugins.discovered() == {}


# -- (c) pyproject and the source-tree fallback agree ----------------------------------------------------------------


def test_pyproject_entry_points_equal_builtin():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][plugins.GROUP] == plugins.BUILTIN
    example = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    assert example["entry-points"][plugins.GROUP] == {"example": "polyfuse_example_backend:register"}


# -- (d) platform identity -----------------------------------------------------------------------------------------


@pytest.fixture
def rocm(monkeypatch):
    """torch reports a HIP build: every "cuda" device is a ROCm GPU."""
    from polyfuse.core import platform

    platform._detect.cache_clear()
    monkeypatch.setattr(torch.version, "hip", "6.3.42131", raising=False)
    yield
    platform._detect.cache_clear()


def test_rocm_is_its_own_platform(rocm):
    from polyfuse.core.platform import detect_platform

    p = detect_platform("cuda")
    assert (p.name, p.device_type) == ("rocm", "cuda")
    assert detect_platform("cpu").name == "cpu"
    ctx = SelectionContext(torch.device("cuda"), torch.bfloat16, flags={"use_flash_attention": True})
    assert ctx.platform.name == "rocm"
    nvidia_only = Implementation("rms_norm", "nvidia_only", "test", ("cuda",), lambda *a: None, platforms=("cuda",))
    assert nvidia_only.unusable_reason(ctx) == "needs platform cuda, run is on rocm"
    both = Implementation("rms_norm", "both", "test", ("cuda",), lambda *a: None, platforms=("cuda", "rocm"))
    assert both.unusable_reason(ctx) is None
    # The built-in NVIDIA-only implementations (SDPA choice, the tuned GEMV) refuse ROCm with that reason and are
    # neither chosen nor in the chain a declined call walks; the portable Triton kernels stay eligible.
    for op, name in (("attention", "sdpa_flash"), ("linear", "triton_gemv"), ("swiglu_linear", "triton_gemv")):
        (impl,) = [i for i in registry.implementations(op) if i.name == name]
        assert impl.unusable_reason(ctx) == "needs platform cuda, run is on rocm", op
        choice = registry.select(op, ctx, {})
        assert name not in [choice.implementation.name, *(i.name for i in choice.then)], op
    (triton_rms,) = [i for i in registry.implementations("rms_norm") if i.backend == "triton"]
    assert "rocm" in triton_rms.platforms


def test_cuda_platform_without_hip(monkeypatch):
    from polyfuse.core import platform

    platform._detect.cache_clear()
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    try:
        assert platform.detect_platform("cuda").name == "cuda"
    finally:
        platform._detect.cache_clear()


def test_gemv_table_is_per_gpu():
    from polyfuse.backends.triton.gemv import table_for

    assert table_for("Some Unknown GPU") == {}
    assert table_for("") == {}
    h200 = table_for("NVIDIA H200")
    assert h200 and (4096, 14336, True) in h200


# -- (e) import layering ------------------------------------------------------------------------------------------


def _imports(source: str, package: str) -> set:
    """Absolute names of every module ``source`` (a file of ``package``) imports, also inside functions, relative
    imports resolved."""
    parts = package.split(".")
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.update(base if node.module else f"{base}.{a.name}" for a in node.names)
    return out


def _file_imports(path: Path) -> set:
    return _imports(path.read_text(encoding="utf-8"), ".".join(path.relative_to(ROOT).parts[:-1]))


def _layer_of(path: Path) -> str:
    """The package a file of polyfuse/ belongs to (``compat`` for polyfuse/compat.py, ``polyfuse`` for the root)."""
    rel = path.relative_to(ROOT / "polyfuse").parts
    return rel[0] if len(rel) > 1 else ("polyfuse" if rel[0] == "__init__.py" else rel[0][:-3])


def _layers() -> dict:
    """{layer: {file: polyfuse modules it imports}} for every file of polyfuse/."""
    out: dict = {}
    for f in sorted((ROOT / "polyfuse").rglob("*.py")):
        names = {m for m in _file_imports(f) if m == "polyfuse" or m.startswith("polyfuse.")}
        out.setdefault(_layer_of(f), {})[str(f.relative_to(ROOT))] = names
    return out


def _target(name: str) -> str:
    """The layer an imported polyfuse module is in."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "polyfuse"


# Bottom to top: core < ops < backends (plugins); distributed; checkpoint; quant; generation; loader; models; then
# patch, training, cli (and serving) on top. Each layer with the layers it may import (itself always): a package
# not named here gets DEFAULT, so a new one is checked from its first file on.
LOWER = ("core", "ops", "distributed", "compat")
ALLOWED = {
    # The root's names load on first use; it registers polyfuse's quantized format with transformers, if imported.
    "polyfuse": ("quant",),
    "core": (),
    "compat": (),
    "ops": ("core",),
    "backends": ("core", "ops"),
    "distributed": ("core",),
    "checkpoint": LOWER,
    "quant": (*LOWER, "checkpoint"),
    "generation": (*LOWER, "checkpoint"),
    "loader": (*LOWER, "checkpoint", "quant"),
    "models": (*LOWER, "checkpoint", "quant", "generation", "loader"),
}
UPPER = ("checkpoint", "quant", "generation", "loader", "models")
TOP = {  # the integrations on top: anything but a backend by name, and not the layers above them
    "patch": (*LOWER, *UPPER),
    "training": (*LOWER, *UPPER, "patch"),
    "cli": (*LOWER, *UPPER, "patch", "training"),
    "serving": (*LOWER, *UPPER, "cli"),
    "__main__": ("cli", "serving"),  # `python -m polyfuse`: dispatches to the entry points
}
DEFAULT = ("polyfuse", *LOWER, *UPPER, "patch", "training", "cli")  # a new package: all but backends


def allowed_for(layer: str) -> set:
    return {layer, *ALLOWED.get(layer, TOP.get(layer, DEFAULT))}


def test_layering():
    """Every import of every file (also inside functions) points to a layer its own may import."""
    layers = _layers()
    assert {"core", "ops", "backends", "models", "cli"} <= set(layers)
    bad = {}
    for layer, files in layers.items():
        ok = allowed_for(layer)
        for f, names in files.items():
            wrong = sorted(n for n in names if _target(n) not in ok)
            if wrong:
                bad[f] = wrong
    assert not bad, f"imports their layer must not make: {bad}"


def test_a_new_package_is_checked_by_the_default_rule():
    assert allowed_for("newpackage") == {"newpackage", *DEFAULT} and "backends" not in allowed_for("newpackage")
    assert "backends" not in set().union(*(allowed_for(p) for p in (*ALLOWED, *TOP) if p != "backends"))


def test_backends_import_only_core_ops_and_themselves():
    """A backend plugin imports core, ops and its own modules: never another backend (not even by a module-name
    string for a lazy import)."""
    bad = {}
    for backend in sorted(
        p.name for p in (ROOT / "polyfuse" / "backends").iterdir() if p.is_dir() and p.name[0] != "_"
    ):
        own = f"polyfuse.backends.{backend}"
        for f in sorted((ROOT / "polyfuse" / "backends" / backend).rglob("*.py")):
            names = {n for n in _file_imports(f) if n.startswith("polyfuse.backends")}
            names |= {s for _, s in _module_strings(f, "polyfuse.backends.")}
            wrong = sorted(n for n in names if n != own and not n.startswith(own + "."))
            if wrong:
                bad[str(f.relative_to(ROOT))] = wrong
    assert not bad, f"a backend reaches another backend: {bad}"


def _module_strings(path: Path, prefix: str) -> list:
    """String constants of a file naming a module under ``prefix`` (what a lazy import by name would take)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(prefix):
            found.append((str(path.relative_to(ROOT)), node.value.split(":")[0]))
    return found


def test_nothing_outside_the_backends_names_one():
    """Outside polyfuse/backends no string names a backend module (a lazy import by name), but for the plugin
    loader's source-tree copy of pyproject's entry points (core/plugins.py BUILTIN)."""
    found = [
        hit
        for f in sorted((ROOT / "polyfuse").rglob("*.py"))
        if "backends" not in f.relative_to(ROOT / "polyfuse").parts[:1]
        for hit in _module_strings(f, "polyfuse.backends.")
    ]
    assert found and all(f == "polyfuse/core/plugins.py" for f, _ in found), found
    assert sorted(m for _, m in found) == sorted(v.split(":")[0] for v in plugins.BUILTIN.values())


def test_layering_check_sees_relative_and_local_imports():
    source = "import os\nfrom . import sibling\nfrom ..models import x\ndef f():\n    from polyfuse.backends.cuda import y\n"
    assert _imports(source, "polyfuse.engine") == {
        "os", "polyfuse.engine.sibling", "polyfuse.models", "polyfuse.backends.cuda"
    }  # fmt: skip


# -- (f) no import cycle ------------------------------------------------------------------------------------------


def _module_graph() -> dict:
    """{module: modules of polyfuse it imports} (every import, also inside functions; ``from m import name`` counts
    as m.name where that is a module, else m)."""
    known = {}
    for f in (ROOT / "polyfuse").rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        known[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f

    def resolve(name):
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, f in known.items():
        package = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                edges.update(resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in known else resolve(base)
                             for a in node.names)  # fmt: skip
        graph[mod] = {e for e in edges if e and e != mod}
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_search_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = _module_graph()
    assert len(graph) > 100 and "polyfuse.core.registry" in graph["polyfuse.core"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
