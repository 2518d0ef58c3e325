"""The package's shape: layers import downward only, no import circles, modules and functions of a
size one can read in a sitting.

Imports are read from the source (``ast``), every ``import`` statement included (also those under
``if TYPE_CHECKING:`` and inside functions): a type-only dependency is still a dependency.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tensorrt_llm"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
# Folders from the bottom up: a module imports nothing from a layer above its own. A folder belongs
# to the layer of its longest prefix here; the package's root modules (logger, sampling_params,
# bundled, ...) are everyone's and in no layer.
FOLDER_ORDER = [
    # storage, pinned staging, collectives and ``Mapping``
    ("tensorrt_llm.runtime", "tensorrt_llm._torch.distributed"),
    # one rank's engine: models, kernels, the step, KV, speculation, disaggregation
    ("tensorrt_llm._torch",),
    ("tensorrt_llm.inputs",),  # prompts and images as the engine takes them
    ("tensorrt_llm._torch.executors",),  # several ranks kept in step
    ("tensorrt_llm.llmapi",),
    ("tensorrt_llm.serve",),
    ("tensorrt_llm.commands",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """Package modules ``path`` imports: ``from a.b import c`` names ``a.b.c`` when that is a module,
    else ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
    return {name for name in found if name in known}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported_modules(path, known) - {name} for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_circle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circles_among_package_modules():
    assert find_cycle(import_graph()) is None


def layer(module: str) -> int | None:
    """``module``'s layer in ``FOLDER_ORDER`` (its longest prefix there), or None."""
    best, found = -1, None
    for i, prefixes in enumerate(FOLDER_ORDER):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    return found


def test_the_layer_of_a_module_is_its_longest_prefix():
    assert layer("tensorrt_llm._torch.distributed.mapping") == 0
    assert layer("tensorrt_llm._torch.pyexecutor.py_executor") == 1
    assert layer("tensorrt_llm._torch.executors.ranks") == 3
    assert layer("tensorrt_llm.sampling_params") is None


def test_folders_import_downward_only():
    upward = [
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        for dep in deps
        if layer(name) is not None and layer(dep) is not None and layer(dep) > layer(name)
    ]
    assert upward == []


def test_the_runtime_never_imports_the_user_layer():
    offenders = [
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        if name.startswith(("tensorrt_llm._torch", "tensorrt_llm.runtime"))
        for dep in deps
        if dep.startswith("tensorrt_llm.llmapi")
    ]
    assert offenders == []


def test_the_runtime_does_not_even_mention_the_user_layer():
    mentions = [
        f"{path.relative_to(PACKAGE.parent)}:{i}"
        for top in ("_torch", "runtime")
        for path in sorted((PACKAGE / top).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "llmapi" in line
    ]
    assert mentions == []


def test_modules_and_functions_stay_readable():
    too_long = []
    for name, path in modules().items():
        source = path.read_text()
        if (n := len(source.splitlines())) > MAX_MODULE_LINES:
            too_long.append(f"module {name}: {n} lines")
        for node in ast.walk(ast.parse(source)):
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                too_long.append(f"function {name}.{node.name}: {n} lines")
    assert too_long == []


# The engine's parts are built whole by their constructors: nothing else sets what they hold.
BUILT_WHOLE = {
    "PyExecutor",
    "StepDispatch",
    "PyTorchModelEngine",
    "CUDAGraphRunner",
    "DisaggCoordinator",
    "EngineLoop",
    "EngineCore",
    "ExchangeSync",
    "Eagle3OneModelWorker",
    "AttentionDpExecutor",
    "KvCacheTransceiver",
}


def class_attributes() -> dict[str, set[str]]:
    """Class name -> the attributes it declares (annotated in its body: dataclass fields) or
    sets on ``self`` in ``__init__``, for every class of the package."""
    found: dict[str, set[str]] = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = found.setdefault(node.name, set())
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    for target in assigned_attributes(item):
                        if isinstance(target.value, ast.Name) and target.value.id == "self":
                            names.add(target.attr)
    return found


def constructor_attributes(classes: set[str]) -> dict[str, str]:
    """Attribute name -> class, for what ``classes`` hold that no other class of the package
    declares (a name shared with, say, a dataclass field cannot be told apart by name)."""
    attributes = class_attributes()
    elsewhere = set().union(*(v for k, v in attributes.items() if k not in classes))
    return {
        name: cls
        for cls in sorted(classes)
        for name in attributes.get(cls, ())
        if name not in elsewhere
    }


def assigned_attributes(tree: ast.AST) -> list[ast.Attribute]:
    """Every ``x.attr`` that ``tree`` assigns (plain, annotated, augmented or tuple targets)."""
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            elements = target.elts if isinstance(target, ast.Tuple) else [target]
            out += [e for e in elements if isinstance(e, ast.Attribute)]
    return out


def test_the_constructor_finder_sees_self_attributes():
    found = constructor_attributes({"PyExecutor"})
    assert found["dispatch"] == "PyExecutor" and found["lockstep"] == "PyExecutor"
    assert "model" not in constructor_attributes({"EngineCore"})  # TorchLlmArgs.model too


def test_the_engine_parts_are_not_set_after_construction():
    held = constructor_attributes(BUILT_WHOLE)
    outside = []
    for name, path in modules().items():
        for target in assigned_attributes(ast.parse(path.read_text())):
            owner = target.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if target.attr in held:
                outside.append(
                    f"{name}:{target.lineno} sets .{target.attr} ({held[target.attr]}'s)"
                )
    assert outside == []


# How a step runs is decided in one place: the plan (step_plan.py) asks the graph runner for the
# bucket, and runs the ranks' collective on the MoE exchanges (``exchange.agree``).
PLANNER = "tensorrt_llm._torch.pyexecutor.step_plan"


def test_a_step_is_planned_in_one_place():
    callers: dict[str, set[str]] = {"shape_of": set(), "exchange.agree": set()}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            if node.func.attr == "shape_of":
                callers["shape_of"].add(name)
            elif node.func.attr == "agree" and getattr(receiver, "id", "") == "exchange":
                callers["exchange.agree"].add(name)
    assert callers == {"shape_of": {PLANNER}, "exchange.agree": {PLANNER}}
