"""Settings: the environment is read in one module (polyfuse/core/settings.py), polyfuse's own settings are named
options (polyfuse/core/kernel_options.py), and no module copies another module's switch.

* an ``ast`` scan of polyfuse/: no ``os.environ`` / ``os.getenv`` outside settings.py; no module-level name computed
  from the environment at import (but the one constant Triton itself fixes at import); no module-level name that is
  a copy of another polyfuse module's global (``ENABLED = REQUESTED``), nor an import of a switch;
* every variable read or set in polyfuse/ is declared, every declared one is used, ``describe()`` lists them and
  docs/architecture.md carries that list;
* the kernel options reach the registry from flags, from_pretrained keywords and the CLI, and the report names them.
"""

import ast
from pathlib import Path

import pytest
import torch

from polyfuse.core import kernel_options, settings


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "polyfuse"
SETTINGS = PACKAGE / "core" / "settings.py"
# Module-level names computed from the environment at import, with why that is right there.
IMPORT_TIME = {
    ("polyfuse/backends/triton/_rounding.py", "INTERPRET"): "Triton fixes interpreter or compiler at its own import",
}


def _files():
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _environ_uses(tree) -> list:
    """Lines touching the process environment directly: os.environ, os.getenv / putenv, ``from os import environ``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr in ("environ", "getenv", "putenv", "unsetenv", "environb"):
                found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [node.lineno for a in node.names if a.name in ("environ", "getenv", "putenv")]
    return found


def test_no_environment_access_outside_settings():
    bad = {}
    for f in _files():
        if f != SETTINGS:
            lines = _environ_uses(ast.parse(f.read_text(encoding="utf-8")))
            if lines:
                bad[_rel(f)] = lines
    assert not bad, f"read the environment through polyfuse.core.settings: {bad}"


def test_the_environment_scan_sees_every_form():
    source = "import os\nfrom os import environ\na = os.environ.get('X')\nb = os.getenv('Y')\nos.environ['Z'] = '1'\n"
    assert sorted(_environ_uses(ast.parse(source))) == [2, 3, 4, 5]


def _reads_settings(node) -> bool:
    """Whether an expression calls settings.get / settings.is_set (or get / is_set imported from it)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            fn = sub.func
            if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "settings":
                return fn.attr in ("get", "is_set", "cache_dir")
    return False


def _polyfuse_imports(tree, module: str) -> dict:
    """{local name: (polyfuse module, its name or None for a module)} bound by the file's module-level imports."""
    package = module.rpartition(".")[0]
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("polyfuse"):
                for a in node.names:
                    out[a.asname or a.name] = (base, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("polyfuse") and a.asname:
                    out[a.asname] = (a.name, None)
    return out


def _module_assignments(tree):
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        yield name.id, node.value


def _switch_problems(files) -> list:
    """Module-level names read from the environment at import (switches), copies of another module's global, and
    imports of a switch."""
    trees = {f: ast.parse(f.read_text(encoding="utf-8")) for f in files}
    switches, problems = set(), []
    for f, tree in trees.items():
        for name, value in _module_assignments(tree):
            if _reads_settings(value) and (_rel(f), name) not in IMPORT_TIME:
                problems.append(f"{_rel(f)}: {name} is read from the environment at import")
                switches.add((_module(f), name))
    for f, tree in trees.items():
        imported = _polyfuse_imports(tree, _module(f))
        for name, value in _module_assignments(tree):
            src = None
            if isinstance(value, ast.Name) and value.id in imported and imported[value.id][1] is not None:
                src = ".".join(imported[value.id])
            elif isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id in imported:
                src = f"{'.'.join(p for p in imported[value.value.id] if p)}.{value.attr}"
            if src is not None:
                problems.append(f"{_rel(f)}: {name} = {src} copies another module's global")
        for local, (mod, name) in imported.items():
            if (mod, name) in switches:
                problems.append(f"{_rel(f)}: imports the switch {mod}.{name}")
    return problems


def test_no_module_level_switch_copied_between_modules():
    assert not _switch_problems(_files())


def test_the_switch_scan_finds_the_patterns(tmp_path):
    pkg = tmp_path / "polyfuse"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "ops" / "a.py").write_text("from polyfuse.core import settings\nREQUESTED = settings.get('X') == '1'\n")
    (pkg / "ops" / "b.py").write_text("from polyfuse.ops.a import REQUESTED\nENABLED = REQUESTED\n")
    (pkg / "ops" / "c.py").write_text("from polyfuse.ops import a\nON = a.REQUESTED\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        problems = _switch_problems(sorted(pkg.rglob("*.py")))
    finally:
        ROOT = old
    assert problems == [
        "polyfuse/ops/a.py: REQUESTED is read from the environment at import",
        "polyfuse/ops/b.py: ENABLED = polyfuse.ops.a.REQUESTED copies another module's global",
        "polyfuse/ops/b.py: imports the switch polyfuse.ops.a.REQUESTED",
        "polyfuse/ops/c.py: ON = polyfuse.ops.a.REQUESTED copies another module's global",
    ]


def _named_variables(tree) -> set:
    """Names given as the first argument of settings.get / is_set / set_for_child."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            fn = node.func
            if isinstance(fn.value, ast.Name) and fn.value.id == "settings" and fn.attr in ("get", "is_set",
                                                                                           "set_for_child"):  # fmt: skip
                arg = node.args[0]
                out.add(arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg))
    return out


def test_every_variable_is_declared_and_used():
    used = set()
    consts = {}
    for f in _files():
        tree = ast.parse(f.read_text(encoding="utf-8"))
        used |= _named_variables(tree)
        for name, value in _module_assignments(tree):  # ENV_SELECT = "POLYFUSE_PLUGINS" and the like
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                consts[name] = value.value
    names = {consts.get(n, n) for n in used}
    assert names <= set(settings.VARIABLES), names - set(settings.VARIABLES)
    assert set(settings.VARIABLES) - names == {"POLYFUSE_CACHE"}  # read by settings.cache_dir()
    with pytest.raises(KeyError, match="not declared"):
        settings.get("POLYFUSE_NOT_A_SETTING")


def test_values_are_parsed_when_read(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert settings.get("WORLD_SIZE") == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert settings.get("WORLD_SIZE") == 4  # read at the call, not at import
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="WORLD_SIZE='four': expected int"):
        settings.get("WORLD_SIZE")
    for raw, want in (("1", True), ("0", False), ("", False), ("off", False), ("yes", True)):
        monkeypatch.setenv("POLYFUSE_DESTROY_STACKS", raw)
        assert settings.get("POLYFUSE_DESTROY_STACKS") is want, raw
    monkeypatch.delenv("POLYFUSE_PLUGINS", raising=False)
    assert settings.get("POLYFUSE_PLUGINS") is None and not settings.is_set("POLYFUSE_PLUGINS")
    monkeypatch.setenv("POLYFUSE_CACHE", "~/elsewhere")
    assert settings.cache_dir() == str(Path("~/elsewhere").expanduser())


def test_describe_lists_every_variable_and_the_docs_carry_it():
    text = settings.describe()
    for v in settings.VARIABLES.values():
        assert f"| `{v.name}` |" in text, v.name
    assert text in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"), "regenerate docs' Settings table"


# ---- kernel options -------------------------------------------------------------------------------------------


def test_kernel_options_from_flags_and_keywords(tmp_path):
    opts = kernel_options.from_flags({"int4_a8": True, "pdl": False, "use_flash_attention": True})
    assert (opts.int4_a8, opts.pdl, opts.gguf_a8) == (True, False, True)
    assert kernel_options.changed(opts) == {"int4_a8": True, "pdl": False}
    assert kernel_options.from_flags({}) is kernel_options.DEFAULT
    assert kernel_options.merge(None, {}) is None
    assert kernel_options.merge({"torch_compile": True}, {"gguf_a8": False}) == {
        "torch_compile": True,
        "gguf_a8": False,
    }
    with pytest.raises(TypeError, match="unknown keyword argument.*int4_aa8"):
        kernel_options.merge(None, {"int4_aa8": True})
    with pytest.raises(TypeError, match="True or False"):
        kernel_options.from_flags({"pdl": "no"})
    with pytest.raises(ValueError, match="not a folder"):
        kernel_options.from_flags({"tile_configs": str(tmp_path / "missing")})


def test_from_pretrained_keywords_reach_the_report(tmp_path):
    from helpers import tiny_config

    from polyfuse.models import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(), int4_a8=True, pdl=False)
    assert model.kernels.context.options.int4_a8 and not model.kernels.context.options.pdl
    assert model.flags["int4_a8"] is True
    assert "kernel options: int4_a8=True, pdl=False" in model.kernels.report()
    plain = AutoModelForCausalLM.from_config(tiny_config())
    assert "kernel options" not in plain.kernels.report()
    with pytest.raises(TypeError, match="int4_aa8"):
        AutoModelForCausalLM.from_config(tiny_config(), int4_aa8=True)


def test_cli_flags_for_every_option_with_their_defaults():
    from polyfuse.cli.args import build_parser
    from polyfuse.cli.kernel_options import kernel_flags

    p = build_parser()
    text = p.format_help()
    for name, f in kernel_options.FIELDS.items():
        assert f"--{name}" in text, name
    args = p.parse_args([])
    assert kernel_flags(args) == {n: getattr(kernel_options.DEFAULT, n) for n in kernel_options.FIELDS}
    args = p.parse_args(["--int4_a8", "--no-gguf_a8", "--no-pdl"])
    assert kernel_options.changed(kernel_options.from_flags(kernel_flags(args))) == {
        "int4_a8": True, "gguf_a8": False, "pdl": False
    }  # fmt: skip


def test_cli_rejects_a_missing_tile_folder(capsys, tmp_path):
    from polyfuse.cli.args import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--tile_configs", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--tile_configs" in err and "is not a folder" in err and "Traceback" not in err


def test_an_implementation_with_options_gets_the_runs(monkeypatch):
    """The registry calls an implementation registered with options=True (and its accepts) with the run's
    KernelOptions; one registered without, as it was."""
    from polyfuse.core import registry
    from polyfuse.core.context import SelectionContext

    seen = []
    impl = registry.Implementation(
        "rms_norm", "probe_opts", "test", ("cpu",), lambda x, w, eps, options: seen.append(("fn", options)) or x,
        accepts=lambda x, w, eps, options: seen.append(("accepts", options)), options=True,
    )  # fmt: skip
    ctx = SelectionContext(torch.device("cpu"), flags={"pdl": False})
    choice = registry.Choice("rms_norm", impl, "test")
    kernels = registry.Kernels({"rms_norm": choice}, ctx)
    kernels.rms_norm(torch.ones(2), torch.ones(2), 1e-6)
    assert [k for k, _ in seen] == ["accepts", "fn"] and all(o.pdl is False for _, o in seen)
