"""Functions stay small: none in polyfuse/ over 80 lines or 8 parameters without a one-line reason.

The reason is a ``# size: ...`` comment on the ``def`` line (or its signature's last line, or the line above the
decorators). Triton kernels are exempt: their parameters are their pointers, strides and compile-time tile sizes,
and a kernel is one launch, not something to split."""

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
MAX_LINES, MAX_PARAMS = 80, 8


def _params(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    if names and names[0].arg in ("self", "cls"):
        names = names[1:]
    return len(names)


def _triton_kernel(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr in ("jit", "autotune", "heuristics"):
            if isinstance(target.value, ast.Name) and target.value.id in ("triton", "tl"):
                return True
    return False


def _has_reason(fn: ast.FunctionDef, lines: list) -> bool:
    first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    signature_end = fn.body[0].lineno - 1  # the lines of the def up to the body (a docstring starts the body)
    candidates = [first - 1, *range(fn.lineno, max(signature_end, fn.lineno) + 1)]
    return any(0 < n <= len(lines) and "# size:" in lines[n - 1] for n in candidates)


def oversized(root: Path = ROOT / "polyfuse") -> list:
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _triton_kernel(node):
                continue
            length, params = node.end_lineno - node.lineno + 1, _params(node)
            if (length > MAX_LINES or params > MAX_PARAMS) and not _has_reason(node, lines):
                found.append(
                    f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {length} lines, {params} params"
                )
    return found


def test_no_function_over_the_limits_without_a_reason():
    assert not oversized(), "\n".join(oversized())


def test_the_check_sees_long_functions_many_parameters_and_reasons(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(
        f"def long():\n{body}\n\n"
        "def wide(a, b, c, d, e, f, g, h, i):\n    pass\n\n"
        "def wide_ok(a, b, c, d, e, f, g, h, i):  # size: mirrors transformers' signature\n    pass\n\n"
        "class C:\n    def method(self, a, b, c, d, e, f, g, h):\n        pass\n\n"
        "@triton.jit\ndef kernel(a, b, c, d, e, f, g, h, i, j):\n    pass\n"
    )
    names = [hit.split(" ")[1].rstrip(":") for hit in oversized(tmp_path)]
    assert names == ["long", "wide"], names
