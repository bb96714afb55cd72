"""The module import graph: one way (flows -> tasks -> storage/models), no cycles, Prefect only in flows/.

Every import counts, including those inside functions (a lazy import is still a dependency).
``python tests/test_imports.py`` prints the graph, one module and what it imports per line.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "storage", "models")
# What each layer may import (besides itself): flows -> tasks -> storage/models.
ALLOWED = {
    "flows": {"tasks", "storage", "models"},
    "tasks": {"storage", "models"},
    "storage": set(),
    "models": set(),
}


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the four packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``path`` imports: ``from a.b import c`` counts as a.b.c when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(path, name, set(found)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    assert "tasks.verifiers.pool" in graph and "flows.cli" in graph  # the walk found the packages
    assert cycles(graph) == []


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_go_one_way():
    def layer(module: str) -> str:
        return module.split(".")[0]

    wrong = [
        f"{source} -> {target}"
        for source, targets in import_graph().items()
        for target in sorted(targets)
        if layer(target) != layer(source) and layer(target) not in ALLOWED[layer(source)]
    ]
    assert wrong == []


def test_tasks_storage_and_models_do_not_import_prefect():
    """Validating a config or running the pure tests never pays Prefect's import."""
    names = [name for name in modules() if name.split(".")[0] != "flows"]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
    source = "\n".join(path.read_text() for name, path in modules().items() if name.split(".")[0] != "flows")
    assert "prefect import" not in source and "import prefect" not in source  # not even lazily


def main() -> None:
    graph = import_graph()
    for name in sorted(graph):
        print(f"{name} -> {', '.join(sorted(graph[name])) or '(nothing of the project)'}")
    found = cycles(graph)
    edges = sum(len(targets) for targets in graph.values())
    print(f"\n{len(graph)} modules, {edges} imports, {len(found)} cycles" + "".join(f"\n  cycle: {c}" for c in found))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()


# -- where imports sit -------------------------------------------------------------------------------

MOST_LAZY_OWN_IMPORTS = 20
"""Function-level imports of the project's own modules: the CLI's per-command imports of the modules that
load torch, pyarrow, MLflow or Prefect, so `rlrounds --help` and `rlrounds config` answer at once."""
LAZY_THIRD_PARTY = {"vllm", "ray", "s3fs", "boto3", "math_verify"}
"""Packages a path may never need, imported where that path starts (each with a comment saying why):
vLLM and Ray for their engines and verifiers, an S3 client for s3:// roots, math-verify (SymPy) in the
math verifier's worker."""
SELF_CONTAINED = {"tasks.verifiers.sandbox_child", "tasks.environments.tool_child"}
"""Modules whose functions' source runs in another interpreter (the sandbox), so each imports its own."""


def function_level_imports() -> list[tuple[str, int, str, str]]:
    """(module, line, imported module, its lines with the line above its group) for every import in a function."""
    found = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    targets = [name if node.level else node.module or ""]
                else:
                    continue
                first = node.lineno - 1
                while first > 0 and lines[first - 1].lstrip().startswith(("import ", "from ")):
                    first -= 1  # one comment may explain a group of imports
                context = "\n".join(lines[max(0, first - 1) : node.end_lineno])
                found += [(name, node.lineno, target, context) for target in targets]
    return sorted(set(found))


def test_imports_sit_at_module_tops():
    lazy = [item for item in function_level_imports() if item[0] not in SELF_CONTAINED]
    own = [f"{m}:{line} {target}" for m, line, target, _ in lazy if target.split(".")[0] in PACKAGES]
    assert len(own) <= MOST_LAZY_OWN_IMPORTS, "\n".join(own)
    third_party = [item for item in lazy if item[2].split(".")[0] not in PACKAGES]
    not_allowed = [f"{m}:{line} {t}" for m, line, t, _ in third_party if t.split(".")[0] not in LAZY_THIRD_PARTY]
    assert not_allowed == [], "import these at the module's top:\n" + "\n".join(not_allowed)
    unexplained = [f"{m}:{line} {t}" for m, line, t, context in third_party if "#" not in context]
    assert unexplained == [], "say on the import's line (or the one above) why it waits:\n" + "\n".join(unexplained)


def test_the_import_count_sees_function_level_imports():
    found = function_level_imports()
    assert any(m == "flows.cli" and t == "flows.campaign" for m, _, t, _ in found)
    assert any(m == "models.engines.vllm_engine" and t == "vllm" for m, _, t, _ in found)


LIGHT_CHECK = """
import json, sys
from flows.config import CampaignConfig, commented_yaml, load_campaign_config
from flows.cli import main

for preset in (None, "long-tail"):
    config = load_campaign_config(None, preset)
    assert CampaignConfig.model_validate(config.model_dump(mode="json")) == config
    commented_yaml(config)
json.dumps(CampaignConfig.model_json_schema())
assert main(["config"]) == 0
print(json.dumps(sorted(sys.modules)))
"""


def test_a_campaign_config_needs_no_stage_and_no_heavy_library():
    """Validating, printing (`rlrounds config`) and rendering a config's schema import only the configs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", LIGHT_CHECK], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    heavy = {"torch", "pyarrow", "transformers", "mlflow", "prefect", "duckdb", "vllm", "ray", "math_verify"}
    assert sorted(m for m in loaded if m.split(".")[0] in heavy) == []
    stages = [m for m in loaded if m.split(".")[0] == "tasks" and m not in ("tasks", "tasks.config")]
    assert [m for m in stages if not m.startswith("tasks.config.")] == []
    assert "tasks.config.rollout" in stages  # the check saw the configs being imported


WINGS = (
    "config",
    "round",
    "verifiers",
    "environments",
    "prompts",
    "serving",
    "filter",
    "rollout",
    "train",
    "publish",
    "evaluate",
    "campaign",
)
"""tasks/'s wings from the bottom floor up. A wing groups a stage with what only it uses; it imports only wings
below it, so the stack reads from any wing downwards without meeting an arrow that comes back up."""


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "tasks" and len(parts) > 2 else None


def test_tasks_holds_wings_and_no_loose_modules():
    loose = sorted(p.name for p in (ROOT / "tasks").glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"tasks/ modules {loose} belong in a wing (tasks/<wing>/)"
    wings = {p.name for p in (ROOT / "tasks").iterdir() if (p / "__init__.py").exists()}
    assert wings == set(WINGS), "a new wing takes its place in WINGS, above every wing it imports"


def upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports in ``graph`` from one wing of tasks/ to a wing above it."""
    return sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if wing_of(source) and wing_of(target) and WINGS.index(wing_of(target)) > WINGS.index(wing_of(source))
    )


def test_each_wing_imports_only_wings_below_it():
    assert upward(import_graph()) == []


def test_an_arrow_up_the_stack_is_found():
    # rollout asks filter whether a group trains (down); filter asking rollout would be an arrow up
    graph = {"tasks.rollout.stage": {"tasks.filter.stage"}, "tasks.filter.stage": {"tasks.rollout.stage", "models.x"}}
    assert upward(graph) == ["tasks.filter.stage -> tasks.rollout.stage"]
    assert wing_of("tasks") is None and wing_of("flows.round") is None
