"""The package layering, read from the source (an AST walk over every import statement, including
the lazy ones inside functions): no import cycle between megappo's packages, and the PPO algorithm
(`megappo.ppo`) is imported by nothing below it. docs/ARCHITECTURE.md draws the same layers."""

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "megappo"
# the packages (and top-level modules) that must never import the PPO algorithm
BELOW_PPO = ("controller", "workers", "gateway", "agent", "parallel", "models", "config", "data", "rewards", "utils",
             "protocol", "sandbox")
# the single controller is generic: it knows Ray and Megatron coordinates, not what the workers do
BELOW_CONTROLLER = ("gateway", "agent", "parallel", "models", "config", "data", "rewards", "utils", "protocol",
                    "sandbox")
# the multi-turn loop, its tools and the sandbox know nothing of the HTTP gateway or of the workers that run them
AGENT_BELOW = [("agent", "gateway"), ("agent", "workers")]
# the sandbox runs code a model wrote: it knows nothing of who calls it (the python tool, the code reward)
SANDBOX_BELOW = [("sandbox", u) for u in ("agent", "rewards", "gateway", "workers", "config")]


def _unit(module: str) -> str:
    """megappo.workers.rollout.x -> "workers"; megappo.protocol -> "protocol"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every megappo module this file imports (absolute and relative imports alike)."""
    out = set()
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from megappo import ppo`
    return {m for m in out if m == "megappo" or m.startswith("megappo.")}


@functools.cache
def import_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {imported unit: [the files that import it]} for units other than itself. Walked once per session
    (~0.45 s): every layering case reads the same graph."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(PKG.rglob("*.py")):
        src = _unit(_module_name(f))
        for mod in _imports(f):
            dst = _unit(mod)
            if dst != src and ((PKG / dst).is_dir() or (PKG / f"{dst}.py").is_file()):
                graph[src][dst].append(str(f.relative_to(PKG.parent)))
    return graph


def find_cycle(graph) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, {})):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_walk_sees_lazy_and_relative_imports(tmp_path):
    assert "megappo.ppo" in _imports(PKG / "train.py") or "megappo.ppo.ray_trainer" in _imports(PKG / "train.py")
    assert find_cycle({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": []}, "b": {}}) is None


def test_no_import_cycle_between_packages():
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle:
        where = "; ".join(f"{a} -> {b} ({', '.join(sorted(set(graph[a][b]))[:3])})" for a, b in zip(cycle, cycle[1:]))
        pytest.fail(f"import cycle between megappo packages: {where}")


@pytest.mark.parametrize("unit,forbidden", [(u, "ppo") for u in BELOW_PPO] +
                         [(u, "controller") for u in BELOW_CONTROLLER] + [("controller", "workers")] + AGENT_BELOW
                         + SANDBOX_BELOW)
def test_layers_do_not_import_upwards(unit, forbidden):
    users = import_graph().get(unit, {}).get(forbidden, [])
    assert not users, f"{', '.join(sorted(set(users)))} import megappo.{forbidden} from below it ({unit}/)"
