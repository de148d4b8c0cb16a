"""The layering of docs/architecture.md, enforced: what each package may import of the project.

Static (AST) scan of every import statement, including imports inside functions; fast.
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def source_files(under: str = "", root: Path = REPO) -> list[Path]:
    """The repository's Python files as git knows them (tracked, or new and not ignored).

    Why: run outputs (``runs/``, ``enhanced_tensor_logs/``, ``draw/``, the patched megatron-core
    copies the main job leaves) live in the working tree too; a check of *our* source must not
    read them (issue 40: the README's main job made this module fail). Outside a git checkout
    (an unpacked sdist) every ``.py`` file under the packages' folders is read instead.
    """
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                              "--", f"{under or '.'}"], cwd=root, capture_output=True, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n.endswith(".py")]
        return sorted(root / n for n in names if (root / n).is_file())
    except (OSError, subprocess.CalledProcessError):
        roots = [root / under] if under else [root / p.split("/")[0] for p in MAY_IMPORT]
        return sorted(f for r in roots if r.is_dir() for f in r.rglob("*.py"))

#: package -> project packages it may import ("megatron" = megatron-core and the in-tree facade).
#: The table of docs/architecture.md; change both together.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "lowp_common": frozenset(),
    "quant": frozenset(),
    "tensor_capture": frozenset({"lowp_common", "quant"}),
    "tensor_viz": frozenset({"lowp_common", "quant", "tensor_capture"}),
    "quant_tools": frozenset({"lowp_common", "quant", "tensor_capture", "tensor_viz"}),
    "te_integration": frozenset({"lowp_common", "quant", "tensor_capture"}),
    "training_driver": frozenset({"lowp_common", "quant", "tensor_capture", "te_integration",
                                  "megatron"}),
    "training_profiler": frozenset({"lowp_common", "quant", "tensor_capture", "training_driver",
                                    "megatron"}),
    "attribution": frozenset({"lowp_common", "quant", "tensor_capture", "training_driver",
                              "megatron"}),
    "megatron/core": frozenset({"tensor_capture"}),       # the facade a patched tree imports
}
#: Third-party packages a layer must not import (quant is numerics only; capture never draws).
MUST_NOT_IMPORT: dict[str, frozenset[str]] = {
    "lowp_common": frozenset({"torch", "numpy", "matplotlib", "jinja2", "megatron"}),
    "quant": frozenset({"matplotlib", "jinja2", "megatron", "transformer_engine"}),
    "tensor_capture": frozenset({"matplotlib", "jinja2"}),
    "te_integration": frozenset({"matplotlib", "jinja2", "megatron"}),
}
#: file -> why it may break its package's row (each says when it goes away).
EXCEPTIONS: dict[str, str] = {
    # the command-line tools live in quant_tools/; the original script path stays a shim
    # that runs quant_tools' command, so it keeps importing it.
    "quant/mxfp_scaling_test.py": "the original script path: a shim that runs the sweep command",
}
PROJECT = {p.split("/")[0] for p in MAY_IMPORT} | {"quant_tools"}
#: te_integration modules that may import Transformer Engine at module level (the rest import it
#: lazily or never: the factory and the debug features load on machines without TE)
TE_AT_IMPORT = {"te_integration/te_quantizer.py"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def _files(package: str) -> list[Path]:
    return source_files(package) if (REPO / package).is_dir() else []


def test_every_package_imports_only_the_layers_below() -> None:
    bad = []
    for package, allowed in MAY_IMPORT.items():
        own = package.split("/")[0]
        for path in _files(package):
            rel = path.relative_to(REPO).as_posix()
            if rel in EXCEPTIONS:
                continue
            imported = _imports(path) & PROJECT - {own}
            bad += [f"{rel} imports {name}" for name in sorted(imported - allowed)]
            bad += [f"{rel} imports {name}" for name in sorted(_imports(path) & MUST_NOT_IMPORT.get(package, set()))]
    assert bad == [], "layering broken (docs/architecture.md):\n" + "\n".join(bad)


def test_the_table_knows_every_package() -> None:
    """A new top-level package needs a row (and a line in docs/architecture.md)."""
    found = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert found <= set(MAY_IMPORT), f"add {sorted(found - set(MAY_IMPORT))} to MAY_IMPORT"
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert all(f"`{p}" in doc for p in MAY_IMPORT), "docs/architecture.md must name every package"


def _module_level_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_transformer_engine_is_imported_at_module_level_only_where_it_must_be() -> None:
    """The factory, the features and their folder load without TE installed."""
    bad = [p.relative_to(REPO).as_posix() for p in _files("te_integration")
           if "transformer_engine" in _module_level_imports(p)
           and p.relative_to(REPO).as_posix() not in TE_AT_IMPORT]
    assert bad == [], f"import transformer_engine lazily in {bad}"


#: the size a newcomer can read in one sitting: past these, split by step or by family
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 600


def _library_files() -> list[Path]:
    skip = {"tests", "bench", "build"}
    return [p for p in source_files()
            if not ({*p.relative_to(REPO).parts[:-1]} & skip or p.relative_to(REPO).parts[0].startswith("."))
            and "egg-info" not in str(p)]


def test_no_module_or_function_too_long_to_read() -> None:
    too_long = []
    for path in _library_files():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(REPO).as_posix()
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{rel}: {text.count(chr(10))} lines (module)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, "split these into named steps or families:\n" + "\n".join(too_long)


def test_source_checks_read_what_git_knows_never_run_outputs(tmp_path: Path) -> None:
    """A patched megatron copy under an ignored runs/ is not our source; a new file is."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/runs/\n")
    (tmp_path / "quant").mkdir()
    (tmp_path / "quant" / "tracked.py").write_text("x = 1\n")
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    (tmp_path / "quant" / "new.py").write_text("y = 2\n")
    (tmp_path / "runs" / "patched" / "megatron").mkdir(parents=True)
    (tmp_path / "runs" / "patched" / "megatron" / "long.py").write_text("z = 3\n" * 900)
    found = [p.relative_to(tmp_path).as_posix() for p in source_files(root=tmp_path)]
    assert found == ["quant/new.py", "quant/tracked.py"]
    assert [p.name for p in source_files("quant", root=tmp_path)] == ["new.py", "tracked.py"]
