"""The package's layout against docs/layout.md: every module listed there and nothing else, imports that flow
down the layers the page states and never in a circle, toma 1.1.0's module paths still the modules they moved to
(so that patching a name through the old path patches the code that uses it), and a namespace of the public API."""

import ast
import importlib
import os
import re
import subprocess
import sys
from typing import Dict, Iterator, List, Set, Tuple

import pytest

import toma
from toma import old_paths
from toma.core.caches import Batchsize
from toma.core.policy import LearningPolicy
from toma.core.steps import Step

from helpers import REPO

PACKAGE = os.path.join(REPO, "toma")
LAYOUT = os.path.join(REPO, "docs", "layout.md")
TOMA_1_1_0_PATHS = {"toma.batchsize_cache", "toma.cpu_memory", "toma.stacktrace", "toma.torch_cuda_memory"}


def _layout() -> str:
    with open(LAYOUT, encoding="utf-8") as file:
        return file.read()


def _documented_layers() -> List[Set[str]]:
    """The numbered list under "## Layers" in docs/layout.md, bottom first: each item's names before its colon."""
    section = _layout().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^\d+\. (.*(?:\n {3}.*)*)", section, flags=re.MULTILINE)
    return [set(re.findall(r"`([a-z_]+)`", item.split(": ", 1)[0])) for item in items]


def _documented_modules() -> Set[str]:
    """The module files the tree in docs/layout.md names (a subpackage's line stands for its `__init__.py`)."""
    tree = _layout().split("```text\n", 1)[1].split("```", 1)[0]
    found, folder = set(), ""
    for line in tree.splitlines():
        match = re.match(r"^(  |    )(\S+(?:\.py|/))(?:\s|$)", line)
        if match is None:
            continue  # the root, or a description carried on to the next line
        name = match.group(2)
        if len(match.group(1)) == 2:
            folder = name if name.endswith("/") else ""
            found.add(f"{name}__init__.py" if name.endswith("/") else name)
        else:
            found.add(folder + name)
    return found


def _modules() -> Dict[str, str]:
    """Every module of toma/, dotted name -> file."""
    modules = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _module_level(tree: ast.Module) -> Iterator[ast.AST]:
    """The statements that run when the module is imported: not the bodies of its functions."""
    pending: List[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        pending.extend(ast.iter_child_nodes(node))


def _imported(module: str, node: ast.AST, known: Dict[str, str]) -> Iterator[str]:
    """The toma modules an import statement names: `from toma.x import y` names `toma.x.y` where that is a module
    and `toma.x` otherwise (the parent packages it also runs are not counted: every module would reach the top)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name in known)
    elif isinstance(node, ast.ImportFrom):
        assert node.level == 0, f"{module}: a relative import (toma's imports are absolute)"
        base = node.module or ""
        for alias in node.names:
            if f"{base}.{alias.name}" in known:
                yield f"{base}.{alias.name}"
            elif base in known:
                yield base


def _import_graph(everywhere: bool) -> Dict[str, Set[Tuple[str, int]]]:
    """module -> the toma modules it imports, with the line: at module level, or `everywhere` (functions too)."""
    known = _modules()
    graph: Dict[str, Set[Tuple[str, int]]] = {}
    for module, path in known.items():
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read())
        nodes = ast.walk(tree) if everywhere else _module_level(tree)
        graph[module] = {
            (target, node.lineno)
            for node in nodes
            for target in _imported(module, node, known)
            if target != module and isinstance(node, (ast.Import, ast.ImportFrom))
        }
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _layer_of(module: str, layers: List[Set[str]]) -> int:
    """The layer of `toma.x...`: the one that names `x` (a subpackage, or a module of the package folder)."""
    part = module.split(".")[1] if "." in module else "__init__"
    return next(number for number, names in enumerate(layers) if part in names)


def test_cycles_are_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_toma_imports_itself_back_through_others():
    graph = {module: {target for target, _ in targets} for module, targets in _import_graph(False).items()}
    assert _cycles(graph) == []


def test_the_layers_docs_layout_states_cover_every_part_of_the_package_once():
    layers = _documented_layers()
    parts = {module.split(".")[1] for module in _modules() if "." in module} | {"__init__"}
    named = [name for layer in layers for name in layer]
    assert len(layers) >= 5 and len(named) == len(set(named)), layers
    assert set(named) == parts, set(named) ^ parts


def test_imports_flow_down_the_layers_docs_layout_states():
    layers = _documented_layers()
    upward = [
        f"{module} (layer {_layer_of(module, layers) + 1}) imports {target} (layer {_layer_of(target, layers) + 1}), "
        f"line {line}"
        for module, targets in _import_graph(True).items()
        for target, line in targets
        if _layer_of(target, layers) > _layer_of(module, layers)
    ]
    assert upward == []


def test_docs_layout_lists_every_module_and_no_other():
    on_disk = {os.path.relpath(path, PACKAGE).replace(os.sep, "/") for path in _modules().values()}
    documented = _documented_modules()
    assert sorted(on_disk - documented) == [], "modules docs/layout.md does not list"
    assert sorted(documented - on_disk) == [], "modules docs/layout.md lists that do not exist"


def test_the_package_folder_holds_subpackages_and_only_the_public_surface():
    modules = {name for name in os.listdir(PACKAGE) if name.endswith(".py")}
    assert modules == {
        "__init__.py",
        "__main__.py",
        "old_paths.py",
        "surface.py",
        "version.py",
        "batchsize_cache.py",
        "cpu_memory.py",
        "stacktrace.py",
        "torch_cuda_memory.py",  # toma 1.1.0's, for type checkers
    }, modules


def test_the_old_paths_are_toma_1_1_0s_and_no_other():
    assert set(old_paths.MOVED) == TOMA_1_1_0_PATHS


@pytest.mark.parametrize("old, new", sorted(old_paths.MOVED.items()))
def test_every_earlier_module_path_is_the_module_it_moved_to(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    assert getattr(toma, old.split(".", 1)[1]) is importlib.import_module(new)


def test_patching_through_toma_1_1_0s_path_reaches_the_code_that_uses_it(monkeypatch):
    """`toma.torch_cuda_memory` is `toma.memory.cuda` itself: a name patched there is what the OOM test reads."""
    import toma.torch_cuda_memory

    monkeypatch.setattr(toma.torch_cuda_memory, "is_cuda_out_of_memory", lambda exception: True)
    assert toma.memory.cuda.is_cuda_out_of_memory(ValueError("anything")) is True


def test_old_paths_import_in_a_fresh_interpreter_before_anything_else():
    code = (
        "from toma.batchsize_cache import GlobalBatchsizeCache\n"
        "from toma.cpu_memory import set_cpu_memory_limit\n"
        "from toma.stacktrace import watermark\n"
        "from toma.torch_cuda_memory import gc_cuda\n"
        "from toma.memory import snapshot\n"
        "import toma.core.engine\n"
        "assert toma.stacktrace is toma.core.call_sites and toma.cpu_memory.set_cpu_memory_limit is not None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr


class _Steady(LearningPolicy):
    """A learning policy that overrides one hook: the others are the base class's defaults."""

    def __init__(self):
        self.failures = []

    def shrink(self, size):
        return size // 2 or None

    def after_oom(self, call):
        self.failures.append(call.failed)
        return super().after_oom(call)


def test_a_learning_policy_needs_only_the_hooks_it_changes():
    from toma.core import engine

    from helpers import raise_fake_oom

    class Rows(Step):
        func = staticmethod(lambda size: None)

        def __call__(self, size):
            if size > 5:
                raise_fake_oom()
            return True

    policy, entry = _Steady(), Batchsize(None)
    engine.run(Rows(), entry, 40, policy)
    assert policy.failures == [40, 20, 10] and entry.value == 5


def _module_files() -> List[str]:
    return sorted(
        os.path.join(folder, name)
        for folder, _, names in os.walk(PACKAGE)
        for name in names
        if name.endswith(".py") and "__pycache__" not in folder
    )


def test_module_names_are_unique_across_subpackages():
    """A module's name says what it holds, so no two modules share one (`__init__.py` aside)."""
    seen: Dict[str, List[str]] = {}
    for path in _module_files():
        name = os.path.basename(path)
        if name != "__init__.py":
            seen.setdefault(name, []).append(os.path.relpath(path, REPO))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
