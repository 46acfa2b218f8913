"""The package layout as a specification: stages in order, no import reaching up, no circles,
and the docs' Layout tree (docs/architecture.md) listing exactly the modules that exist."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxreplay"
ARCHITECTURE = ROOT / "docs" / "architecture.md"  # its "## Layout" tree

# Lowest first. A module may import its own stage and the stages below it, never one above.
# The root modules sit at the ends: config and compat below every subpackage, cli and
# __main__ above them all. Package __init__ files belong to their stage, and their imports count.
STAGES = [
    "jaxreplay",  # the root __init__: imports nothing of the package
    "jaxreplay.storage",
    "jaxreplay.config",
    "jaxreplay.compat",
    "jaxreplay.models",
    "jaxreplay.tasks",
    "jaxreplay.replay",
    "jaxreplay.rollout",
    "jaxreplay.serve",  # the HTTP endpoint over the rollout engine: nothing below imports it
    "jaxreplay.learn",
    "jaxreplay.train",
    "jaxreplay.research",
    "jaxreplay.tools",
    "jaxreplay.cli",
    "jaxreplay.__main__",
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def stage_of(module: str) -> int:
    """The index of the longest STAGES entry that is `module` or a package holding it."""
    best = None
    for i, stage in enumerate(STAGES):
        if module == stage or (stage != "jaxreplay" and module.startswith(stage + ".")):
            if best is None or len(stage) > len(STAGES[best]):
                best = i
    if best is None:
        raise AssertionError(f"{module} is in no stage: add its subpackage to STAGES")
    return best


def imports_of(path: Path) -> set[str]:
    """Every jaxreplay module `path` imports anywhere: top level, in functions, under TYPE_CHECKING."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import sub` imports the submodule when there is one.
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] == "jaxreplay")
    return found


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def test_every_import_names_a_module_that_exists():
    missing = {(m, i) for m, deps in GRAPH.items() for i in deps if i not in MODULES}
    assert not missing


def test_no_module_imports_a_higher_stage():
    upward = sorted(f"{m} ({STAGES[stage_of(m)]}) imports {i} ({STAGES[stage_of(i)]})"
                    for m, deps in GRAPH.items() for i in deps if stage_of(i) > stage_of(m))
    assert not upward, "\n".join(upward)


def test_there_are_no_import_circles():
    """Tarjan's strongly connected components over the whole import graph."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in GRAPH.get(v, ()):
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles


def test_the_root_keeps_few_modules_and_the_stages_are_subpackages():
    root = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    subpackages = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    assert len(root) <= 8, root
    assert len(subpackages) >= 6, subpackages
    assert {s.split(".")[1] for s in STAGES[1:]} >= set(subpackages)


def eager_imports_of(path: Path) -> set[str]:
    """The jaxreplay modules `path` imports when it is imported: outside any function."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        found |= imports_of_node(node)
    return found


def imports_of_node(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "jaxreplay")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "jaxreplay":
            found.add(node.module)
    return found


STAGE_PACKAGES = [stage for stage in STAGES if MODULES[stage].name == "__init__.py" and stage != "jaxreplay"]


def test_stage_package_inits_import_nothing():
    """No eager re-exports: importing a stage's package costs nothing and pulls in no other module.
    The names they exported before the layout by stage come through a `__getattr__`, when used."""
    eager = {stage: sorted(eager_imports_of(MODULES[stage])) for stage in STAGES
             if MODULES[stage].name == "__init__.py" and eager_imports_of(MODULES[stage])}
    assert not eager
    code = (f"import sys, {', '.join(STAGE_PACKAGES)}\n"
            "print(sorted(m for m in sys.modules if m.startswith('jaxreplay')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(sorted(["jaxreplay", *STAGE_PACKAGES]))


def test_names_the_stage_packages_exported_before_still_import_with_a_warning_naming_the_new_path():
    code = ("import warnings\n"
            "warnings.simplefilter('error')\n"
            "for line in ['from jaxreplay.models import forward, init_params',\n"
            "             'from jaxreplay.replay import build_tables, serve',\n"
            "             'from jaxreplay.tasks import make_task', 'from jaxreplay.rl import make_loss']:\n"
            "    try:\n"
            "        exec(line)\n"
            "    except DeprecationWarning as w:\n"
            "        print('warned:', w)\n"
            "warnings.simplefilter('ignore')\n"
            "from jaxreplay.models import forward, init_params, transformer\n"
            "from jaxreplay.replay import build_tables, serve\n"
            "from jaxreplay.rl import make_loss\n"
            "print(forward is transformer.forward, serve.__module__, build_tables.__module__, make_loss.__module__)\n"
            "try:\n"
            "    from jaxreplay.models import not_a_name\n"
            "except ImportError as e:\n"
            "    print('ImportError:', e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for old, new in [("models.forward", "models.transformer.forward"), ("replay.build_tables", "replay.tables.build_tables"),
                     ("tasks.make_task", "tasks.registry.make_task"), ("rl.make_loss", "learn.losses.make_loss")]:
        assert f"warned: jaxreplay.{old} moved to jaxreplay.{new}: import it from there" in out, out
    assert "True jaxreplay.replay.server jaxreplay.replay.tables jaxreplay.learn.losses" in out
    assert "ImportError: cannot import name 'not_a_name' from 'jaxreplay.models'" in out


def test_every_moved_name_is_where_the_table_says_in_its_package_stage_or_below():
    import importlib

    import jaxreplay
    for package, names in jaxreplay._MOVED_NAMES.items():
        for name, module in names.items():
            assert hasattr(importlib.import_module(module), name), f"{package}.{name}: not in {module}"
            if package != "jaxreplay.rl":  # the root's alias package, of two moved modules
                assert stage_of(module) <= stage_of(package), f"{package}.{name} -> {module}: a higher stage"


def test_importing_config_pulls_in_no_other_stage():
    """Only the storage layer below it (which imports nothing of the package), and no bucket client."""
    code = ("import sys, jaxreplay.config\n"
            "print(sorted(m for m in sys.modules if m.startswith(('jaxreplay', 'gcsfs', 'google.cloud'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['jaxreplay', 'jaxreplay.config', 'jaxreplay.storage']"


def test_every_config_owner_is_declared_and_registers_a_check():
    from jaxreplay.config import OWNERS
    registering = {name for name, path in MODULES.items()
                   if "@owner_check" in (text := path.read_text()) or "@machine_check" in text}
    assert registering == set(OWNERS)


def test_old_module_paths_import_the_moved_module_with_a_warning():
    code = ("import warnings\n"
            "warnings.simplefilter('error')\n"
            "import jaxreplay.train.driver as new\n"
            "try:\n"
            "    import jaxreplay.driver\n"
            "except DeprecationWarning as w:\n"
            "    print('warned:', w)\n"
            "warnings.simplefilter('ignore')\n"
            "import jaxreplay.driver as old\n"
            "from jaxreplay.rl.losses import grpo_clip_loss\n"
            "print(old is new, grpo_clip_loss.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "warned: jaxreplay.driver moved to jaxreplay.train.driver" in out
    assert out.strip().endswith("True jaxreplay.learn.losses")


def layout_tree() -> set[str]:
    """The paths the Layout section of docs/architecture.md lists under jaxreplay/: modules, and packages as `dir/`."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    lines = block.splitlines()
    start = lines.index("jaxreplay/")
    listed, parents = set(), []
    for line in lines[start + 1:]:
        match = re.match(r"^( +)(\S+?\.py|\S+/)(?:\s|$)", line)
        if not match:
            if line and not line.startswith(" "):
                break  # the next top-level folder
            continue
        depth = len(match.group(1)) // 2 - 1
        parents = parents[:depth]
        listed.add("/".join(parents + [match.group(2)]))
        if match.group(2).endswith("/"):
            parents.append(match.group(2).rstrip("/"))
    return listed


def test_the_docs_layout_lists_exactly_the_modules_that_exist():
    actual = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py":
            if rel.parent != Path("."):
                actual.add(rel.parent.as_posix() + "/")
        else:
            actual.add(rel.as_posix())
    listed = layout_tree()
    assert not actual - listed, f"modules the Layout section does not list: {sorted(actual - listed)}"
    assert not listed - actual, f"the Layout section lists what does not exist: {sorted(listed - actual)}"


@pytest.mark.parametrize("stage", STAGES[4:12])
def test_the_layout_says_what_each_stage_may_import(stage):
    listed = [line for line in ARCHITECTURE.read_text().splitlines()
              if line.startswith(f"  {stage.split('.')[1]}/")]
    assert listed and "may import" in listed[0], listed
