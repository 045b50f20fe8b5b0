"""The house rules of ``services``, read from the source (ast), so a change that breaks them fails here.

- Imports run one way: each package may import only the packages below it (``LAYERS``, the same table
  as in ``docs/design.md``). Every import counts: module level, inside functions, and under
  ``if TYPE_CHECKING:`` (a type-only arrow is still a dependency of the concept).
- No import circle among ``services`` modules, type-only imports included.
- No import circle between the folders (and root modules) of ``services.engine`` or ``services.kv``: a folder is a
  floor, and nothing on a lower floor imports a higher one.
- The KV library's owner and reader sides never import each other (``LAYERS``); its shared spec, and the torch-free
  packages, import no torch.
- No service module over ``MAX_MODULE_LINES`` lines, no function over ``MAX_FUNCTION_LINES`` outside kernels and the
  declarative tables of ``LONG_FUNCTIONS``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "services"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60

_TORCH_FREE = ("services.common", "services.text", "services.contract")
# The KV library's rooms, bottom to top: what both sides agree on, plans, the digest and the NIXL wrapper, one
# rank's registered KV; then the two sides, which never import each other.
_KV_BELOW_SIDES = ("services.kv.ranks", "services.kv.digest", "services.kv.nixl", "services.kv.plan",
                   "services.kv.spec")
# package -> what it may import besides itself. A key or an entry names a package or one module;
# the longest key that prefixes a module's name is its package. Read bottom to top in design.md.
LAYERS: dict[str, tuple[str, ...]] = {
    "services": (),
    "services.proto_gen": (),
    "services.common": ("services.proto_gen",),
    "services.text": ("services.common",),
    "services.contract": ("services.text", "services.common", "services.proto_gen"),
    "services.kv": (),
    "services.kv.spec": (*_TORCH_FREE, "services.proto_gen"),
    "services.kv.plan": ("services.kv.spec",),
    "services.kv.nixl": ("services.kv.spec",),
    "services.kv.digest": ("services.kv.plan", "services.kv.spec"),
    "services.kv.ranks": ("services.kv.digest", "services.kv.nixl", "services.kv.plan", "services.kv.spec"),
    "services.kv.owner": (*_KV_BELOW_SIDES, *_TORCH_FREE, "services.proto_gen"),
    "services.kv.reader": (*_KV_BELOW_SIDES, *_TORCH_FREE, "services.proto_gen"),
    # The engine knows of transfers only what both sides agree on (the layout spec it allocates its cache from).
    "services.engine": ("services.kv.spec", *_TORCH_FREE),
    "services.worker": ("services.engine", "services.kv", *_TORCH_FREE, "services.proto_gen"),
    "services.prefill": ("services.worker", "services.engine", "services.kv", *_TORCH_FREE, "services.proto_gen"),
    "services.decode": ("services.worker", "services.engine", "services.kv", *_TORCH_FREE, "services.proto_gen"),
    # The router knows the workers through the proto; which pairs can work is the KV library's shared spec.
    "services.router": (*_TORCH_FREE, "services.proto_gen", "services.kv.spec"),
    # The launcher and the command line sit on top of everything.
    "services.launch": ("services",),
    "services.cli": ("services",),
}
#: Packages that must start without torch (the router's and the KV spec's users import them bare).
TORCH_FREE_PACKAGES = (*_TORCH_FREE, "services.kv.spec")
#: Packages whose sub-folders (and root modules) must form no import circle between each other.
FOLDERED_PACKAGES = ("services.engine", "services.kv")
#: Functions allowed past ``MAX_FUNCTION_LINES``: declarative tables (one statement per metric or field) and kernels
#: (``@triton.jit``, which the compiler wants in one body), by (module, function) -> why.
LONG_FUNCTIONS: dict[tuple[str, str], str] = {
    ("services.common.metrics", "__init__"): "declarative: one statement per metric",
    ("services.router.metrics", "__init__"): "declarative: one statement per metric",
    ("services.engine.model_config.gemma", "gemma_fields"): "declarative: the Gemma config fields, one per line",
    ("services.engine.model_config.deepseek", "deepseek_fields"): "declarative: the DeepSeek config fields",
    ("services.engine.model_config.granite", "granite_hybrid_fields"): "declarative: the Granite config fields",
    ("services.engine.loading.gguf", "_gemma_config"): "declarative: GGUF keys to Gemma config fields",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _service_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SERVICES.rglob("*.py")) if "proto_gen" not in p.parts}


MODULES = _service_modules()


def _imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported services module, line) for every import in the file, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "services":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "services":
                continue
            for alias in node.names:  # ``from pkg import module`` names the module itself
                submodule = f"{target}.{alias.name}"
                yield (submodule if submodule in MODULES else target), node.lineno


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _package_of(name: str) -> str:
    return max((key for key in LAYERS if _within(name, key)), key=len)


def _edges() -> dict[str, set[str]]:
    return {name: {target for target, _ in _imports(name, path)} for name, path in MODULES.items()}


def test_every_service_package_has_a_layer() -> None:
    unplaced = sorted({name for name in MODULES if _package_of(name) == "services" and name != "services"})
    assert not unplaced, f"modules outside every layer of LAYERS (add them to the table and design.md): {unplaced}"


def test_imports_follow_the_layers() -> None:
    wrong = []
    for name, path in MODULES.items():
        package = _package_of(name)
        for target, line in _imports(name, path):
            if target == "services" or _within(target, package) and _package_of(target) == package:
                continue
            if not any(_within(target, allowed) for allowed in LAYERS[package]):
                wrong.append(f"{path.relative_to(REPO)}:{line}: {package} -> {target}")
    assert not wrong, "imports against the direction docs/design.md gives:\n" + "\n".join(sorted(set(wrong)))


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circles() -> None:
    circles = _circles(_edges())
    assert not circles, "import circles (TYPE_CHECKING imports included):\n" + "\n".join(map(str, circles))


def test_no_module_is_too_long() -> None:
    lines = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in MODULES.values()}
    long = {path: n for path, n in lines.items() if n > MAX_MODULE_LINES}
    assert not long, f"service modules over {MAX_MODULE_LINES} lines (split them along their seams): {long}"


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert _circles(graph) == expected


def test_the_layer_check_sees_a_forbidden_arrow(tmp_path: Path) -> None:
    """The walker would notice the router importing the engine, even inside a function or TYPE_CHECKING."""
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from services.engine.llm_engine import LLMEngine\n"
              "def f():\n    import services.kv.nixl\n")
    path = tmp_path / "fake.py"
    path.write_text(source)
    targets = [t for t, _ in _imports("services.router.fake", path)]
    assert targets == ["services.engine.llm_engine", "services.kv.nixl"]
    assert not any(_within(t, a) for t in targets for a in LAYERS[_package_of("services.router.fake")])


def _floor(name: str, package: str) -> str:
    """A module's floor inside ``package``: its sub-folder, or the root module itself."""
    rest = name[len(package) + 1:].split(".")
    return rest[0] if len(rest) > 1 or MODULES[name].name == "__init__.py" else f"{rest[0]}.py"


@pytest.mark.parametrize("package", FOLDERED_PACKAGES)
def test_no_import_circles_between_folders(package: str) -> None:
    floors: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for name, path in MODULES.items():
        if not name.startswith(package + "."):
            continue
        a = _floor(name, package)
        floors.setdefault(a, set())
        for target, line in _imports(name, path):
            if target.startswith(package + ".") and target in MODULES and (b := _floor(target, package)) != a:
                floors[a].add(b)
                why.setdefault((a, b), f"{path.relative_to(REPO)}:{line} -> {target}")
    circles = _circles(floors)
    arrows = [why[a, b] for c in circles for a in c for b in floors[a] if b in c]
    assert not circles, f"import circles between folders of {package}: {circles}\n" + "\n".join(sorted(arrows))


def test_torch_free_packages_import_no_torch() -> None:
    heavy = ("torch", "triton", "nixl")
    wrong = []
    for name, path in MODULES.items():
        if not any(_within(name, p) for p in TORCH_FREE_PACKAGES):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            wrong += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in heavy]
    assert not wrong, "torch-free packages importing torch, triton or nixl:\n" + "\n".join(wrong)


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Triton kernel: jitted where it is defined, or written in ``triton.language`` (``tl.``) and jitted later."""
    return any("jit" in ast.unparse(d) for d in node.decorator_list) or any(
        isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "tl" for n in ast.walk(node))


def test_no_function_is_too_long() -> None:
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _is_kernel(node):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and (name, node.name) not in LONG_FUNCTIONS:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into steps):\n" + "\n".join(long)


def test_the_long_function_exceptions_still_exist() -> None:
    """An exception for a function that was split or renamed is removed with it, so the list cannot grow stale."""
    present = set()
    for name, path in MODULES.items():
        present |= {(name, n.name) for n in ast.walk(ast.parse(path.read_text(), str(path)))
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    assert set(LONG_FUNCTIONS) <= present, sorted(set(LONG_FUNCTIONS) - present)


def test_the_folder_check_sees_a_circle() -> None:
    """Two floors importing each other are a circle, whichever modules the arrows come from."""
    assert _circles({"sched": {"kv_cache"}, "kv_cache": {"request.py", "sched"}, "request.py": set()}) == [
        ["kv_cache", "sched"]]


def test_the_sides_of_the_kv_library_may_not_import_each_other(tmp_path: Path) -> None:
    """The walker and the table together refuse the owner importing the reader (and back), under TYPE_CHECKING too."""
    for side, other in (("owner", "services.kv.reader.puller"), ("reader", "services.kv.owner.exporter")):
        path = tmp_path / f"{side}.py"
        path.write_text(f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import {other}\n")
        name = f"services.kv.{side}.fake"
        targets = [t for t, _ in _imports(name, path)]
        assert targets == [other]
        assert not any(_within(other, allowed) for allowed in LAYERS[_package_of(name)])


def _design_layers() -> dict[str, set[str]]:
    """The Layers table of docs/design.md as package -> what it may import (``nothing``: none; ``anything``: all)."""
    text = (REPO / "docs" / "design.md").read_text()
    table = text[text.index("### Layers"):text.index("## One request")]
    rows: dict[str, set[str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`services"):
            continue
        allowed = {"services"} if cells[1] == "anything" else set() if cells[1] == "nothing" else {
            f"services.{name}" for name in re.findall(r"`([\w.]+)`", cells[1])}
        rows |= {package: allowed for package in re.findall(r"`([\w.]+)`", cells[0])}
    return rows


def test_the_design_doc_shows_this_table() -> None:
    """One contract written once: docs/design.md's Layers table says what LAYERS enforces, row for row."""
    documented = _design_layers()
    assert set(documented) == set(LAYERS) - {"services"}, set(documented) ^ (set(LAYERS) - {"services"})
    wrong = {package: (sorted(documented[package]), sorted(LAYERS[package]))
             for package in documented if documented[package] != set(LAYERS[package])}
    assert not wrong, f"docs/design.md's Layers table (documented, enforced) differs: {wrong}"
