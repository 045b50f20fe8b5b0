"""The house rules of ``services``, read from the source (ast), so a change that breaks them fails here.

- Imports run one way: each package may import only the packages below it (``LAYERS``, the same table
  as in ``docs/design.md``). Every import counts: module level, inside functions, and under
  ``if TYPE_CHECKING:`` (a type-only arrow is still a dependency of the concept).
- No import circle among ``services`` modules, type-only imports included.
- No service module over ``MAX_MODULE_LINES`` lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "services"
MAX_MODULE_LINES = 700

_TORCH_FREE = ("services.common", "services.text", "services.contract")
# package -> what it may import besides itself. A key or an entry names a package or one module;
# the longest key that prefixes a module's name is its package. Read bottom to top in design.md.
LAYERS: dict[str, tuple[str, ...]] = {
    "services": (),
    "services.proto_gen": (),
    "services.common": ("services.proto_gen",),
    "services.text": ("services.common",),
    "services.contract": ("services.text", "services.common", "services.proto_gen"),
    "services.kv": (*_TORCH_FREE, "services.proto_gen"),
    # The engine knows of transfers only the layout spec it allocates its cache from.
    "services.engine": ("services.kv.layout", "services.kv.groups", *_TORCH_FREE),
    "services.worker": ("services.engine", "services.kv", *_TORCH_FREE, "services.proto_gen"),
    "services.prefill": ("services.worker", "services.engine", "services.kv", *_TORCH_FREE, "services.proto_gen"),
    "services.decode": ("services.worker", "services.engine", "services.kv", *_TORCH_FREE, "services.proto_gen"),
    # The router knows the workers through the proto; which pairs can work is the KV library's one rule.
    "services.router": (*_TORCH_FREE, "services.proto_gen", "services.kv.pair_support"),
    # The launcher and the command line sit on top of everything.
    "services.launch": ("services",),
    "services.cli": ("services",),
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
