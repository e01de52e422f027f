"""Rules for the whole package: no code execution from data, imports that point one way."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Modules (and numpy's switch) that load objects or run code from data: flagged wherever they
#: appear as a code token (strings and comments excluded, so docstrings may discuss pickling).
FORBIDDEN_MODULES = {
    "pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve",
    "importlib", "runpy", "subprocess", "yaml", "allow_pickle",
}  # fmt: skip


#: Builtins that run code: flagged as bare names (``re.compile`` is an attribute, not these).
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "execfile", "__import__"}


#: Calls that run commands or unpickle: ``<name>.<attr>(...)``.
FORBIDDEN_CALLS = {
    ("os", "system"), ("os", "popen"), ("torch", "load"), ("np", "load"), ("numpy", "load"),
}  # fmt: skip


#: Documented exceptions: (file, name) -> why it is safe.
ALLOWED = {
    ("__init__.py", "importlib"): (
        "PEP 562 lazy exports: the module names come from the package's fixed _LAZY table"
    ),
    ("packing.py", "subprocess"): (
        "times a cold `import <fixed module name>` in a fresh interpreter; "
        "no file content reaches the command line"
    ),
    ("memory.py", "subprocess"): (
        "runs the benchmark's fixed memory-child code in a fresh interpreter with a JSON config "
        "of paths and counts; no file content reaches the command line"
    ),
}


def package_sources() -> list[Path]:
    return sorted((ROOT / "torch_serialized").rglob("*.py"))


def test_package_source_has_no_code_execution_paths():
    found = []
    for path in package_sources():
        source = path.read_text(encoding="utf-8")
        with io.StringIO(source) as buffer:
            previous = ""
            for tok in tokenize.generate_tokens(buffer.readline):
                name = tok.string if tok.type == tokenize.NAME else ""
                bare = previous != "."
                forbidden = name in FORBIDDEN_MODULES or (bare and name in FORBIDDEN_BUILTINS)
                if forbidden and (path.name, name) not in ALLOWED:
                    found.append(f"{path.name}:{tok.start[0]}: {name}")
                if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
                    previous = tok.string
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and (node.func.value.id, node.func.attr) in FORBIDDEN_CALLS
            ):
                found.append(f"{path.name}:{node.lineno}: {node.func.value.id}.{node.func.attr}")
    assert found == [], "code that could execute file content:\n" + "\n".join(found)
    assert len(package_sources()) > 10  # the scan saw the package


# -- imports point one way --------------------------------------------------------------------
def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """``(absolute module, imported names)`` of every import in ``path``, nested ones too."""
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            found.append((target, names))
            # ``from . import x`` imports the module ``package.x``
            found += [(f"{target}.{name}", []) for name in names if not node.module]
    return found


def test_the_library_never_imports_its_tools() -> None:
    """tools/ is fenced off: only the command line dispatches to it."""
    offenders = [
        f"{module_name(path)} imports {target}"
        for path in package_sources()
        if not {"tools", "cli"} & set(path.relative_to(ROOT).parts)
        for target, _ in imports_of(path)
        if target == "torch_serialized.tools" or target.startswith("torch_serialized.tools.")
    ]
    assert offenders == []


def test_no_module_imports_another_module_s_underscore_names() -> None:
    offenders = [
        f"{module_name(path)}: from {target} import {name}"
        for path in package_sources()
        for target, names in imports_of(path)
        if target.startswith("torch_serialized")
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert offenders == []


def test_the_wheel_holds_no_development_tooling() -> None:
    """The benchmark lives in benchmarks/, the loopback test servers in tests/support/: no
    module of the package imports them, and no copy of them is left inside it."""
    tooling = ("tsbench", "support", "tests", "benchmarks", "moto")
    offenders = [
        f"{module_name(path)} imports {target}"
        for path in package_sources()
        for target, _ in imports_of(path)
        if target.split(".")[0] in tooling
    ]
    assert offenders == []
    names = {p.name for p in (ROOT / "torch_serialized").rglob("*")}
    assert not [n for n in names if n.startswith(("loopback", "benchmark", "tsbench"))]


def test_format_imports_nothing_of_ours_but_errors() -> None:
    ours = {t for t, _ in imports_of(ROOT / "torch_serialized" / "container" / "spec.py")}
    assert {t for t in ours if t.startswith("torch_serialized")} == {"torch_serialized.errors"}


def test_nothing_imports_the_command_line() -> None:
    offenders = [
        module_name(path)
        for path in package_sources()
        if path.name != "__main__.py"
        for target, _ in imports_of(path)
        if target == "torch_serialized.cli" or target.startswith("torch_serialized.cli.")
        if "cli" not in path.relative_to(ROOT).parts
    ]
    assert offenders == []


# -- modules stay small -------------------------------------------------------------------------
#: Lines a module may have; the format specification (its docstring is the spec) a few more.
MAX_LINES, SPEC_MAX_LINES = 500, 700
SPEC = ROOT / "torch_serialized" / "container" / "spec.py"


def test_no_module_is_over_500_lines_but_the_spec() -> None:
    """One concern per module: a newcomer reads one in a sitting (docs/FORMAT.md's code, the
    spec, may take 700)."""
    over = []
    for path in package_sources():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > (SPEC_MAX_LINES if path == SPEC else MAX_LINES):
            over.append(f"{module_name(path)}: {lines} lines")
    assert over == []


def test_examples_import_only_public_names() -> None:
    import torch_serialized
    import torch_serialized.tools

    public = {
        "torch_serialized": set(torch_serialized.__all__),
        "torch_serialized.tools": set(torch_serialized.tools.__all__),
    }
    examples = sorted((ROOT / "examples").glob("*.py"))
    assert examples
    offenders = [
        f"{path.name}: {target} {names}"
        for path in examples
        for target, names in imports_of(path)
        if target.startswith("torch_serialized")
        and (target not in public or not set(names) <= public[target])
    ]
    assert offenders == []
