"""The package's walls, read from its source with `ast`: who may import whom, and no name that shadows another.

Layers (each sub-package's `__init__` docstring says the same in prose):

    ground      canonical_chat, tito_errors: imported by everyone, import no layer
    engine      ground
    sessions    ground
    records     ground, sessions
    backends    ground, engine
    protocols   ground
    turns       every core layer above
    proxy       turns and everything below it; with tools, the only users of mitmproxy
    tools       everything; of the replicas only the demo and the reference-backend subcommand
    replicas    only each other, so they stay independent of the code they stand in for
    trainers    only each other: verl's and slime's loaders run on the trainer's Python; the only users of torch

Inside `replicas`, each module has a role: a server's (named for it: `sglang_*`, `vllm_*`), a concept both servers
share, or the harness. A server's modules import their own and the shared ones, never another server's; the shared
concepts import only each other; the harness imports only itself.

`test_a_planted_violation_is_caught` plants one violation of each kind in a copy of the tree and shows the
checker names it, so the rules are known to bite.

The benchmarks (`bench/`, modules imported by bare name) keep their command line apart from their harness: no
module imports `run_all`, and their imports have no cycle.

The tests (`tests/`) show their tiers: a test file lives in the folder of its tests' tier markers (`fast/` none,
`full/` `full` or `serial`, `e2e/` `e2e`, `trainer_checks/` `trainers`), and no module there imports a test module or
conftest.py: what tests share is in `support/`.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from graphlib import CycleError, TopologicalSorter
from importlib.machinery import PathFinder
from pathlib import Path

import pytest
from support.basics import REPO

PACKAGE = REPO / "tito_addon"

GROUND = "ground"
ENTRY = "entry"  # the package's own __init__ (mitmproxy's script) and __main__
CORE = {GROUND, "engine", "sessions", "records", "backends", "protocols"}
ALLOWED: dict[str, set[str]] = {
    GROUND: {GROUND},
    "engine": {GROUND, "engine"},
    "sessions": {GROUND, "sessions"},
    "records": {GROUND, "sessions", "records"},
    "backends": {GROUND, "engine", "backends"},
    "protocols": {GROUND, "protocols"},
    "turns": CORE | {"turns"},
    "proxy": CORE | {"turns", "proxy"},
    "tools": CORE | {"turns", "proxy", "tools", "trainers"},
    "replicas": {"replicas"},
    "trainers": {"trainers"},
    ENTRY: {"proxy", "tools"},
}
#: The only modules outside `replicas` that may import a replica (the demo runs one; `reference-backend` serves one).
REPLICA_USERS = {"tito_addon.tools.demo_run", "tito_addon.tools.cli"}
MITMPROXY_USERS = {"proxy", "tools"}
#: The replicas' modules by role: each server's wire, in modules named for the server (`sglang_replica` is sglang's);
#: the concepts both servers share (the scripted model, its tokenizer, the faults, an engine's pause for weight
#: updates, how a replica is served); the harness that runs real processes (mitmdump, redis, haproxy). A module in
#: none of them is unplaced.
REPLICA_SERVERS = ("sglang", "vllm")
REPLICA_SHARED = {
    "scripted_model",
    "replica_tokenizer",
    "faults",
    "engine_pause",
    "replica_runner",
    "expert_routing",
    "vision_processing",
}
REPLICA_HARNESS = {"proxy_process", "mitmdump_forks", "fleet", "engine_routers"}
#: Which roles' modules a replica module may import: a server its own and the shared concepts, never another server's.
REPLICA_ALLOWED: dict[str, set[str]] = {
    **{server: {server, "shared"} for server in REPLICA_SERVERS},
    "shared": {"shared"},
    "harness": {"harness"},
    "package": set(),
}
#: Never imported by the package outside `trainers` (which runs in a trainer's environment, never in the addon):
#: the addon loads tokenizers and templates, never a model.
FORBIDDEN_EVERYWHERE = {"torch"}
TORCH_USERS = {"trainers"}
MAX_LINES = 500
LONG_REASON = "Why this module is long:"
#: What the turn layer may import of `sessions`: the interface and the shapes it speaks in, never an implementation
#: (`memory_sessions`, `redis_sessions`, `redis_tree`, ...), which only the proxy's wiring chooses.
SESSIONS_INTERFACE = {
    "tito_addon.sessions.session_space",
    "tito_addon.sessions.session_tree",
    "tito_addon.sessions.message_keys",
    "tito_addon.sessions.session_ids",
    "tito_addon.sessions.turn_entity",
}
ORCHESTRATOR = "tito_addon.turns.turn_service"
#: A call or a signature with more arguments than this is formatted by the formatter, never packed under `fmt: skip`.
PACKED_ARGUMENTS = 3
BENCH = REPO / "bench"
#: The benchmarks' command line: it imports the harness (`measurements`, `local_servers`, ...), never the reverse.
BENCH_COMMAND_LINE = "run_all"


@dataclass(frozen=True)
class Violation:
    module: str
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.module} imports {self.imported}: {self.rule}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def replica_role(module: str) -> str | None:
    """A module's role inside `replicas` (see REPLICA_ALLOWED); `package` for `replicas` itself, None if unplaced."""
    parts = module.split(".")
    if len(parts) == 2:
        return "package"
    name = parts[2]
    if name.split("_")[0] in REPLICA_SERVERS:
        return name.split("_")[0]
    if name in REPLICA_SHARED:
        return "shared"
    return "harness" if name in REPLICA_HARNESS else None


def is_module(name: str, root: Path) -> bool:
    """Whether the dotted `name` is a module or a sub-package of the tree at `root`."""
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer_of(module: str, root: Path) -> str:
    """A module's layer: its sub-package, `ground` for a module at the package root, `entry` for the package."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return ENTRY
    return parts[1] if (root / parts[1]).is_dir() else GROUND


@functools.cache
def parsed(text: str) -> ast.Module:
    """A module's tree, read once per text: the planted-problem tests scan copies of a tree that differ in one file,
    and parsing every file again for each of them was most of this module's time. (The trees are only read.)"""
    return ast.parse(text)


def parsed_file(path: Path) -> ast.Module:
    text = path.read_text("utf-8")
    try:
        return parsed(text)
    except SyntaxError:
        return ast.parse(text, str(path))  # raised again, naming the file


@functools.cache
def import_statements(text: str) -> tuple[tuple[int, str | None, tuple[str, ...]], ...]:
    """Each import in a module's source, anywhere in it: (level, module, names), level -1 for `import x`."""
    out = []
    for node in ast.walk(parsed(text)):
        if isinstance(node, ast.Import):
            out.append((-1, None, tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module, tuple(alias.name for alias in node.names)))
    return tuple(out)


def imports_of(path: Path, module: str, root: Path) -> list[str]:
    """Every module this file imports, anywhere in it (functions and TYPE_CHECKING blocks too), made absolute."""
    parsed_file(path)  # a file that does not parse fails here, by its name
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[str] = []
    for level, name, names in import_statements(path.read_text("utf-8")):
        if level == -1:
            found += names
            continue
        if level:
            base = package.split(".")
            base = base[: len(base) - (level - 1)]
            target = ".".join(base + ([name] if name else []))
        else:
            target = name or ""
        # `from tito_addon import engine` imports the sub-package `engine`, `from tito_addon.replicas import
        # faults` the module `faults`.
        for alias in names:
            named = f"{target}.{alias}"
            found.append(named if target == "tito_addon" or is_module(named, root) else target)
    return found


def violations(root: Path) -> list[Violation]:
    out: list[Violation] = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        layer = layer_of(module, root)
        if layer not in ALLOWED:
            out.append(Violation(module, "-", f"{layer!r} is not a known layer; add it to the table in this test"))
            continue
        role = replica_role(module) if layer == "replicas" else None
        if layer == "replicas" and role is None:
            rule = "is not placed among the replicas' roles: name it for its server or add it to this test's table"
            out.append(Violation(module, "-", rule))
            continue
        for imported in imports_of(path, module, root):
            top = imported.split(".")[0]
            if top in FORBIDDEN_EVERYWHERE and layer not in TORCH_USERS:
                out.append(Violation(module, imported, f"{top} is never imported by the package"))
            elif top == "mitmproxy" and layer not in MITMPROXY_USERS:
                out.append(Violation(module, imported, "only proxy/ and tools/ import mitmproxy"))
            elif top == "tito_addon":
                target = layer_of(imported, root)
                if layer == "turns" and target == "sessions" and imported not in SESSIONS_INTERFACE:
                    rule = f"the turn layer reaches sessions only through {sorted(SESSIONS_INTERFACE)}"
                    out.append(Violation(module, imported, rule))
                if layer == "turns" and module != ORCHESTRATOR and imported == ORCHESTRATOR:
                    out.append(Violation(module, imported, "no module the orchestrator calls imports it back"))
                if target == "replicas" and layer != "replicas" and module not in REPLICA_USERS:
                    out.append(Violation(module, imported, "replicas are imported only by the demo and tests"))
                elif target != "replicas" and target not in ALLOWED[layer]:
                    out.append(Violation(module, imported, f"{layer} may import only {sorted(ALLOWED[layer])}"))
                elif role is not None and target == "replicas" and replica_role(imported) not in REPLICA_ALLOWED[role]:
                    allowed = sorted(REPLICA_ALLOWED[role])
                    out.append(Violation(module, imported, f"{role} replica modules may import only {allowed} of them"))
    return out


def test_the_package_keeps_its_walls() -> None:
    found = violations(PACKAGE)
    assert not found, "\n".join(str(v) for v in found)


def test_every_layer_is_a_sub_package_with_its_own_docstring() -> None:
    for layer in ALLOWED:
        if layer in (GROUND, ENTRY):
            continue
        init = PACKAGE / layer / "__init__.py"
        assert init.is_file(), f"{layer}/ has no __init__.py"
        docstring = ast.get_docstring(parsed_file(init))
        assert docstring and "import" in docstring, f"{layer}/__init__.py must say what it owns and may import"
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(ALLOWED) - {GROUND, ENTRY}


PLANTED = [
    ("turns/planted.py", "from tito_addon.sessions.redis_sessions import RedisSessions\n", "only through"),
    ("turns/planted.py", "from tito_addon.sessions import memory_sessions\n", "only through"),
    ("turns/planted.py", "def lazy():\n    from tito_addon.turns.turn_service import TurnService\n", "imports it back"),
    ("engine/planted.py", "from tito_addon.proxy.capture_addon import TitoAddon\n", "engine may import only"),
    ("engine/planted.py", "from tito_addon.sessions.session_tree import TurnNode\n", "engine may import only"),
    ("sessions/planted.py", "from ..records import record_reader\n", "sessions may import only"),
    ("records/planted.py", "def lazy():\n    from tito_addon.backends import upstream_client\n", "records may"),
    ("backends/planted.py", "import mitmproxy.http\n", "only proxy/ and tools/ import mitmproxy"),
    ("backends/planted.py", "from tito_addon.records.record_models import TurnRecord\n", "backends may import only"),
    ("protocols/planted.py", "from tito_addon.turns import turn_service\n", "protocols may import only"),
    ("canonical_planted.py", "from tito_addon.engine import token_engine\n", "ground may import only"),
    ("turns/planted.py", "from tito_addon.replicas.sglang_replica import ReplicaThread\n", "replicas are imported"),
    ("replicas/vllm_planted.py", "from tito_addon.engine.token_engine import TokenEngine\n", "replicas may import"),
    ("tools/planted.py", "from tito_addon.replicas import vllm_replica\n", "replicas are imported only"),
    ("turns/planted.py", "import torch\n", "never imported by the package"),
    ("records/planted.py", "def lazy():\n    from tito_addon.trainers import verl_batch\n", "records may import"),
    ("trainers/planted.py", "from tito_addon.records.trainer_rows import rows_of\n", "trainers may import only"),
    ("newlayer/__init__.py", '"""A layer nobody has placed."""\n', "is not a known layer"),
    ("replicas/planted.py", "import json\n", "is not placed among the replicas' roles"),
    ("replicas/vllm_planted.py", "from tito_addon.replicas.sglang_replica import ReplicaThread\n", "vllm replica"),
    ("replicas/sglang_planted.py", "from tito_addon.replicas import vllm_derender\n", "sglang replica modules may"),
    ("replicas/scripted_model.py", "def lazy():\n    from tito_addon.replicas import sglang_cli\n", "shared replica"),
    ("replicas/faults.py", "from tito_addon.replicas.vllm_replica import VLLM_FAULTS\n", "shared replica modules may"),
    ("replicas/replica_runner.py", "from tito_addon.replicas.fleet import ProxyFleet\n", "shared replica modules may"),
    ("replicas/fleet.py", "from tito_addon.replicas.replica_runner import ServedApp\n", "harness replica modules"),
]


@pytest.mark.parametrize(("where", "source", "rule"), PLANTED, ids=[f"{w}:{r}" for w, _, r in PLANTED])
def test_a_planted_violation_is_caught(tmp_path: Path, where: str, source: str, rule: str) -> None:
    copy = tmp_path / "tito_addon"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.jinja"))
    assert violations(copy) == []
    (copy / where).parent.mkdir(exist_ok=True)
    with (copy / where).open("a", encoding="utf-8") as planted:  # a new module, or appended to an existing one
        planted.write(source)
    found = violations(copy)
    assert len(found) == 1 and rule in found[0].rule, found
    assert found[0].module == module_name(copy / where, copy)


def long_without_a_reason(root: Path) -> list[str]:
    """The modules (the replicas' too) longer than MAX_LINES whose docstring does not say why."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text("utf-8")
        lines = text.count("\n")
        if lines > MAX_LINES and LONG_REASON not in (ast.get_docstring(parsed(text)) or ""):
            found.append(f"{path.relative_to(root.parent)} has {lines} lines and no '{LONG_REASON}'")
    return found


def test_no_module_is_long_without_a_reason() -> None:
    found = long_without_a_reason(PACKAGE)
    assert not found, "\n".join(found)


def test_a_long_replica_without_a_reason_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "tito_addon"
    (root / "replicas").mkdir(parents=True)
    long_body = "x = 1\n" * MAX_LINES
    (root / "replicas" / "sglang_planted.py").write_text('"""A replica."""\n' + long_body)
    assert long_without_a_reason(root) == [
        f"tito_addon/replicas/sglang_planted.py has {MAX_LINES + 1} lines and no '{LONG_REASON}'"
    ]
    (root / "replicas" / "sglang_planted.py").write_text(f'"""A replica.\n\n{LONG_REASON} a reason."""\n' + long_body)
    assert long_without_a_reason(root) == []


def packed_under_fmt_skip(path: Path) -> list[int]:
    """Lines of statements that `# fmt: skip` keeps from the formatter although they hold a call or a signature of
    more than PACKED_ARGUMENTS arguments: the way a module was once squeezed under its line cap."""
    text = path.read_text("utf-8")
    lines = text.splitlines()
    found = []
    for node in ast.walk(parsed(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
            header_end = node.body[0].lineno - 1
            if count > PACKED_ARGUMENTS and any("fmt: skip" in line for line in lines[node.lineno - 1 : header_end]):
                found.append(node.lineno)
        elif isinstance(node, ast.stmt) and not hasattr(node, "body") and "fmt: skip" in lines[node.end_lineno - 1]:
            calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
            if any(len(call.args) + len(call.keywords) > PACKED_ARGUMENTS for call in calls):
                found.append(node.lineno)
    return sorted(found)


def test_no_call_or_signature_is_packed_under_fmt_skip() -> None:
    packed = {str(p.relative_to(REPO)): packed_under_fmt_skip(p) for p in sorted(PACKAGE.rglob("*.py"))}
    packed = {path: lines for path, lines in packed.items() if lines}
    assert not packed, f"let the formatter lay these out (or cut the module where its concept ends): {packed}"


def test_packing_under_fmt_skip_is_caught(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def f(a, b, c, d,\n      e):  # fmt: skip\n    return g(a, b, c, d)  # fmt: skip\n"
        "KEYS = frozenset({1, 2})  # fmt: skip\n"
    )
    assert packed_under_fmt_skip(planted) == [1, 3]


def top_level_names() -> set[str]:
    """What the process could import by a top-level name: the standard library and every installed distribution."""
    names = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
    for dist in importlib.metadata.distributions():
        top_level = dist.read_text("top_level.txt")
        if top_level:
            names.update(top_level.split())
        for file in dist.files or ():
            first = file.parts[0]
            if first.endswith(".py"):
                names.add(first[:-3])
            elif len(file.parts) > 1 and not first.endswith((".dist-info", ".egg-info", ".data")):
                names.add(first)
    return names


def test_no_name_in_the_package_folder_shadows_an_importable_one() -> None:
    """mitmproxy puts the script's folder on sys.path; every entry in it is then a top-level name."""
    entries = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    entries -= {"__init__", "__main__"}
    installed = top_level_names()
    assert len(installed) > 100  # the check really sees the venv (mitmproxy, transformers, pydantic, ...)
    assert {"mitmproxy", "pydantic", "json", "http"} <= installed
    clashes = sorted(entries & installed)
    assert not clashes, f"these would shadow an importable module under mitmdump: {clashes}"
    elsewhere = [p for p in sys.path if isinstance(p, str) and os.path.abspath(p or ".") != str(PACKAGE)]
    found = [name for name in sorted(entries) if PathFinder.find_spec(name, elsewhere) is not None]
    assert not found, f"importable from elsewhere on sys.path: {found}"


def test_loading_the_script_leaves_its_folder_off_sys_path() -> None:
    """Loaded the way mitmproxy loads `-s tito_addon/__init__.py` (relative path, from the repository root),
    the package folder is not left on sys.path, so `import engine` finds nothing."""
    probe = (
        "import os, sys\n"
        "from mitmproxy.addons.script import load_script\n"
        "module = load_script('tito_addon/__init__.py')\n"
        "names = [type(a).__name__ for a in module.addons]\n"
        "expected = ['ControlAddon', 'EpisodeNaming', 'TitoReplay', 'TitoAddon', 'SessionSweeper', 'SessionListing',"
        " 'FlowFileRecords', 'TurnViewRegistration']\n"
        "assert module is not None and names == expected, names\n"
        "package = os.path.abspath('tito_addon')\n"
        "left = [p for p in sys.path if isinstance(p, str) and os.path.abspath(p or '.') == package]\n"
        "assert not left, left\n"
        "for name in ('engine', 'proxy', 'tools', 'canonical_chat'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise AssertionError(name + ' is importable as a top-level name')\n"
        "print('clean')\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "clean", result.stderr[-2000:]


def bench_imports(bench: Path) -> dict[str, set[str]]:
    """Which of bench/'s modules each of them imports (its scripts put bench/ on sys.path and import by bare name)."""
    names = {path.stem for path in bench.glob("*.py")}
    return {
        path.stem: {imported.split(".")[0] for imported in imports_of(path, path.stem, bench)} & names
        for path in sorted(bench.glob("*.py"))
    }


def bench_problems(bench: Path) -> list[str]:
    """The bench modules that import the command line, and an import cycle among bench modules."""
    graph = bench_imports(bench)
    found = [
        f"{module} imports {BENCH_COMMAND_LINE}: the command line imports the harness, never the other way"
        for module, imported in graph.items()
        if BENCH_COMMAND_LINE in imported
    ]
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        found.append(f"import cycle: {' -> '.join(error.args[1])}")
    return found


def test_the_benchmarks_command_line_stays_apart_from_their_harness() -> None:
    found = bench_problems(BENCH)
    assert not found, "\n".join(found)


BENCH_PLANTED = [
    ("planted.py", "from run_all import main\n", "planted imports run_all"),
    ("concurrency.py", "def lazy():\n    from measurements import p3\n", "import cycle"),
]


@pytest.mark.parametrize(("where", "source", "problem"), BENCH_PLANTED, ids=[w for w, _, _ in BENCH_PLANTED])
def test_a_planted_bench_problem_is_caught(tmp_path: Path, where: str, source: str, problem: str) -> None:
    copy = tmp_path / "bench"
    shutil.copytree(BENCH, copy, ignore=lambda _, names: [n for n in names if not n.endswith(".py")])
    assert bench_problems(copy) == []
    with (copy / where).open("a", encoding="utf-8") as planted:
        planted.write(source)
    found = bench_problems(copy)
    assert len(found) == 1 and problem in found[0], found


# -- options: each addon reads only the options it declares --------------------------------------------------------

#: The module that declares the capture addon's options (its settings model) and the modules that declare them
#: through it (`TitoSettings.declare_options`).
SETTINGS_MODULE = "tito_addon/proxy/tito_settings.py"
OPTION_HOLDERS = {"ctx", "opts", "options"}  # `ctx.options.tito_x`, and the names an addon binds `ctx.options` to


def settings_options(root: Path) -> set[str]:
    """The `tito_*` options the settings model declares: its fields, with the prefix."""
    tree = ast.parse((root.parent / SETTINGS_MODULE).read_text("utf-8"))
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TitoSettings")
    return {
        "tito_" + n.target.id for n in model.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def options_of(path: Path, root: Path) -> tuple[set[str], set[str], list[int]]:
    """What a module declares (`add_option("tito_…")`, or the settings' options through `declare_options`), the
    `tito_*` options it reads off mitmproxy's options, and the lines where it reads one by a computed name."""
    tree = parsed_file(path)
    declared: set[str] = set()
    read: set[str] = set()
    computed: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            first = node.args[0] if node.args else None
            if node.func.attr == "add_option" and isinstance(first, ast.Constant) and isinstance(first.value, str):
                declared.add(first.value)
            if node.func.attr == "declare_options":
                declared |= settings_options(root)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            holder, name = (node.args + [None, None])[:2]
            on_options = isinstance(holder, ast.Attribute) and holder.attr == "options"
            on_options |= isinstance(holder, ast.Name) and holder.id in OPTION_HOLDERS
            if on_options and isinstance(name, ast.Constant) and isinstance(name.value, str):
                read.add(name.value) if name.value.startswith("tito_") else None
            elif on_options:
                computed.append(node.lineno)
        if isinstance(node, ast.Attribute) and node.attr.startswith("tito_"):
            holder = node.value
            if (isinstance(holder, ast.Attribute) and holder.attr == "options") or (
                isinstance(holder, ast.Name) and holder.id in OPTION_HOLDERS
            ):
                read.add(node.attr)
    return declared, read, computed


def foreign_option_reads(root: Path) -> list[str]:
    """Every read of an option the reading addon does not declare (it reads what the owner publishes instead:
    `proxy/proxy_facts.py`), and every read by a computed name, which nothing could check."""
    found = []
    for path in sorted((root / "proxy").glob("*.py")):
        if path.relative_to(root.parent).as_posix() == SETTINGS_MODULE:
            continue  # the settings model reads its own options, by name, into settings
        declared, read, computed = options_of(path, root)
        name = path.relative_to(root.parent)
        found += [f"{name} reads {option}, another addon's option" for option in sorted(read - declared)]
        found += [f"{name}:{line} reads an option by a computed name" for line in computed]
    return found


def test_no_addon_reads_another_addons_options() -> None:
    found = foreign_option_reads(PACKAGE)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("where", "source", "said"),
    [
        ("proxy/replay_addon.py", "def f():\n    return ctx.options.tito_tokenizer\n", "reads tito_tokenizer"),
        ("proxy/control_addon.py", "def f(o):\n    return getattr(o.options, 'tito_' + o)\n", "a computed name"),
        (
            "proxy/flow_file_records.py",
            "def f(opts):\n    return getattr(opts, 'tito_record_dir')\n",
            "tito_record_dir",
        ),
    ],
)
def test_a_foreign_option_read_is_caught(tmp_path: Path, where: str, source: str, said: str) -> None:
    copy = tmp_path / "tito_addon"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.jinja"))
    assert foreign_option_reads(copy) == []
    with (copy / where).open("a", encoding="utf-8") as planted:
        planted.write(source)
    found = foreign_option_reads(copy)
    assert len(found) == 1 and said in found[0], found


# -- the tests: each file in its tier's folder, helpers only from support/ ----------------------------------------

TESTS = REPO / "tests"
#: The markers that choose a tier (pyproject.toml) and the folder a test carrying them lives in; a test with none of
#: them is `make test`'s, in `fast/`. The first that applies wins: an `e2e` test is e2e's even if also `full`.
TIER_FOLDERS = (("e2e", {"e2e"}), ("trainer_checks", {"trainers"}), ("full", {"full", "serial"}))
FAST = "fast"
TIER_MARKERS = {marker for _, markers in TIER_FOLDERS for marker in markers}
SKIPPED_DIRS = {"node_modules", "__pycache__"}


def tier_marks(node: ast.AST) -> set[str]:
    """The tier markers written anywhere in `node` as `pytest.mark.NAME`: a decorator, a pytestmark, a param's marks."""
    return {
        sub.attr
        for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute)
        and sub.attr in TIER_MARKERS
        and isinstance(sub.value, ast.Attribute)
        and sub.value.attr == "mark"
        and isinstance(sub.value.value, ast.Name)
        and sub.value.value.id == "pytest"
    }


def pytestmark_of(body: list[ast.stmt]) -> set[str]:
    targets = [
        n for n in body if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
    ]
    return set().union(*(tier_marks(n.value) for n in targets))


def marked_tests(tree: ast.Module) -> list[tuple[str, int, set[str]]]:
    """Each test pytest collects from the module (`test*` functions, `test*` methods of `Test*` classes), with the tier
    markers it carries: the module's pytestmark, its class's, its own decorators."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    module = pytestmark_of(tree.body)
    found = []
    for node in tree.body:
        if isinstance(node, functions) and node.name.startswith("test"):
            marks = module.union(*map(tier_marks, node.decorator_list))
            found.append((node.name, node.lineno, marks))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            cls = module | pytestmark_of(node.body) | set().union(*map(tier_marks, node.decorator_list))
            for item in node.body:
                if isinstance(item, functions) and item.name.startswith("test"):
                    marks = cls.union(*map(tier_marks, item.decorator_list))
                    found.append((f"{node.name}.{item.name}", item.lineno, marks))
    return found


def folder_for(marks: set[str]) -> str:
    return next((folder for folder, markers in TIER_FOLDERS if marks & markers), FAST)


def suite_files(tests: Path) -> list[Path]:
    return sorted(p for p in tests.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(tests).parts))


def imported_test_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """What a module imports of a test module or conftest (by any name: `test_x`, `fast.test_x`, `from . import
    test_x`), or of a name a test module would collect (`from support.x import test_y`)."""

    def is_test(dotted: str) -> bool:
        return any(part.startswith("test_") or part == "conftest" for part in dotted.split(".") if part)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if is_test(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if is_test(base):
                found.append((node.lineno, base))
            else:
                joined = [base + ("" if base.endswith(".") else ".") + a.name for a in node.names]
                found += [(node.lineno, name) for name in joined if is_test(name)]
    return found


def suite_problems(tests: Path) -> list[str]:
    """Test files outside a tier folder or in another tier's, and imports of a test module or conftest anywhere."""
    found = []
    for path in suite_files(tests):
        rel = path.relative_to(tests)
        tree = parsed_file(path)
        for line, imported in imported_test_modules(tree):
            rule = "a test module is never imported: what tests share is in support/, fixtures in conftest.py"
            found.append(f"{rel}:{line} imports {imported}: {rule}")
        if not path.name.startswith("test_"):
            continue
        folder = rel.parts[0] if len(rel.parts) > 1 else None
        if folder not in {FAST, *(f for f, _ in TIER_FOLDERS)}:
            found.append(
                f"{rel} is in no tier's folder: put it in one of {sorted({FAST, *(f for f, _ in TIER_FOLDERS)})}"
            )
            continue
        for name, line, marks in marked_tests(tree):
            if folder_for(marks) != folder:
                said = f"marked {', '.join(sorted(marks))}" if marks else "marked with no tier"
                found.append(f"{rel}:{line} {name} is {said}: it belongs in tests/{folder_for(marks)}/")
    return found


def test_each_test_file_is_in_its_tiers_folder_and_no_test_module_is_imported() -> None:
    found = suite_problems(TESTS)
    assert not found, "\n".join(found)
    placed = {path.relative_to(TESTS).parts[0] for path in suite_files(TESTS) if path.name.startswith("test_")}
    assert placed == {FAST, *(folder for folder, _ in TIER_FOLDERS)}, placed  # the rule sees every folder's tests


SERIAL_MODULE = "import pytest\n\npytestmark = pytest.mark.serial\n\n\ndef test_a():\n    pass\n"
SUITE_PLANTED = [
    ("fast/test_replay.py", "from fast.test_anthropic_messages import TOOLS\n", "imports fast.test_anthropic"),
    ("fast/test_replay.py", "def lazy():\n    from test_proxy_sglang import agent\n", "imports test_proxy_sglang"),
    ("full/test_fleet.py", "from . import test_crash_safety\n", "imports .test_crash_safety"),
    ("fast/test_replay.py", "from support.basics import test_planted\n", "imports support.basics.test_planted"),
    ("support/basics.py", "import conftest\n", "imports conftest"),
    ("support/token_exact.py", "from conftest import tokenizer_path\n", "imports conftest"),
    ("fast/test_replay.py", "@pytest.mark.full\ndef test_planted():\n    pass\n", "is marked full: it belongs"),
    ("fast/test_planted.py", SERIAL_MODULE, "test_a is marked serial: it belongs in tests/full/"),
    ("fast/test_replay.py", "class TestPlanted:\n    @pytest.mark.trainers\n    def test_a(self):\n        pass\n",
     "TestPlanted.test_a is marked trainers: it belongs in tests/trainer_checks/"),
    ("full/test_example_driver_runs.py", "def test_planted():\n    pass\n", "no tier: it belongs in tests/fast/"),
    ("e2e/test_planted.py", "def test_a():\n    pass\n", "no tier: it belongs in tests/fast/"),
    ("full/test_fleet.py", "@pytest.mark.e2e\ndef test_planted():\n    pass\n", "it belongs in tests/e2e/"),
    ("test_planted.py", "def test_a():\n    pass\n", "test_planted.py is in no tier's folder"),
]  # fmt: skip


@pytest.mark.parametrize(("where", "source", "said"), SUITE_PLANTED, ids=[f"{w}:{s}" for w, _, s in SUITE_PLANTED])
def test_a_planted_test_module_problem_is_caught(tmp_path: Path, where: str, source: str, said: str) -> None:
    copy = tmp_path / "tests"
    shutil.copytree(TESTS, copy, ignore=lambda folder, names: [n for n in names if n in SKIPPED_DIRS or (
        not n.endswith(".py") and not (Path(folder) / n).is_dir())])  # fmt: skip
    assert suite_problems(copy) == []
    with (copy / where).open("a", encoding="utf-8") as planted:  # a new module, or appended to an existing one
        planted.write(source)
    found = suite_problems(copy)
    assert len(found) == 1 and said in found[0], found
