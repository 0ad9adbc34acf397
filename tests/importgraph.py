"""The library's import graph, read from the source (nothing is imported), and its layers.

An edge ``a -> b`` means running module ``a`` may run module ``b`` first. It counts every
``import`` statement anywhere in ``a`` (module level or inside a function: a deferred import
hides a cycle, it does not remove it), except under ``if TYPE_CHECKING:`` (never run). Importing
``p.q.m`` also runs the ``__init__`` of ``p`` and ``p.q``: those are edges too, except for the
packages that contain ``a`` itself (Python has started them before ``a``). A package face that
exports names lazily (PEP 562 ``__getattr__`` + ``importlib``) has no import statement: it runs
nothing when a submodule is imported, so it adds no edge.

    python -m tests.importgraph            # report for this checkout
    python -m tests.importgraph OTHER_ROOT # the same for another checkout (before/after)
"""

from __future__ import annotations

import ast
import os
import re
import sys
from dataclasses import dataclass, field

import networkx as nx

PACKAGES = ("autoparallel", "spmd_rules", "reshard")
DISTRIBUTED = "torch.distributed"
# Layers, bottom up; a module may import its own layer or lower ones only.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("values", ("autoparallel", "autoparallel.placement", "autoparallel.mesh", "autoparallel.spec",
                "autoparallel.cost", "autoparallel.compat", "autoparallel.attributes")),
    ("rules+planner", ("spmd_rules", "reshard", "reshard.plan", "reshard.planner", "reshard.crossmesh")),
    ("runtime", ("autoparallel.runtime", "reshard.executor")),
    ("engine", ("autoparallel.engine",)),
    ("model", ("autoparallel.api", "autoparallel.sharded_call", "autoparallel.static_engine", "autoparallel.factory", "autoparallel.local_fn", "autoparallel.data",
               "autoparallel.nn", "autoparallel.optim", "autoparallel.pipeline", "autoparallel.checkpoint",
               "autoparallel.plans", "autoparallel.regions", "autoparallel.static", "autoparallel.memory", "autoparallel.auto")),
)
PURE = ("spmd_rules", "reshard.plan", "reshard.planner", "reshard.crossmesh")
# What model-level code may take from the engine: the door module whole, and these names of
# two others (the public class; the op path's observer door and a symbolic capture's decisions). Everything else is the engine's.
ENGINE = "autoparallel.engine"
ENGINE_DOORS: dict[str, frozenset[str] | None] = {
    "autoparallel.engine.layout": None,  # None: any name
    "autoparallel.engine.dtensor": frozenset({"DistTensor"}),
    "autoparallel.engine.dispatch": frozenset({"observed_by", "symbolic_decisions"}),
}


@dataclass
class Graph:
    modules: dict[str, str]                                  # module -> file
    edges: dict[str, set[str]] = field(default_factory=dict)  # module -> modules it runs first
    distributed: set[str] = field(default_factory=set)        # modules importing torch.distributed


def _module_names(root: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for pkg in PACKAGES:
        base = os.path.join(root, pkg)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(dirpath, f)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _resolve(name: str, importer: str, is_pkg: bool, level: int) -> str:
    if not level:
        return name
    parts = importer.split(".")
    base = parts if is_pkg else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def build(root: str) -> Graph:
    """The import graph of the library under ``root``."""
    mods = _module_names(root)
    g = Graph(mods)
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        targets: set[str] = set()
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = _resolve(node.module or "", mod, is_pkg, node.level)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
                if base == "torch" and any(a.name == "distributed" for a in node.names):
                    names.append(DISTRIBUTED)
            for name in names:
                if name == DISTRIBUTED or name.startswith(DISTRIBUTED + "."):
                    g.distributed.add(mod)
                targets.update(_with_parents(name, mod, mods))
        targets.discard(mod)
        g.edges[mod] = targets
    return g


def _with_parents(name: str, importer: str, mods: dict[str, str]) -> set[str]:
    """``name`` and the packages importing it runs, less those that contain ``importer``."""
    own = importer.split(".")
    out = set()
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in mods and not (i < len(own) + 1 and own[:i] == parts[:i] and prefix != importer):
            out.add(prefix)
    return out


def cycles(g: Graph) -> list[list[str]]:
    """Strongly connected groups of two or more modules (import cycles), largest first."""
    dg = nx.DiGraph([(a, b) for a, bs in g.edges.items() for b in bs])
    dg.add_nodes_from(g.modules)
    return sorted((sorted(c) for c in nx.strongly_connected_components(dg) if len(c) > 1), key=len, reverse=True)


def reaches(g: Graph, start: str) -> set[str]:
    """Every module that running ``start`` may run first (itself included)."""
    seen, todo = {start}, [start]
    while todo:
        for b in g.edges.get(todo.pop(), ()):
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def pure_reaching_distributed(g: Graph) -> dict[str, list[str]]:
    """Rule and planner modules -> the library modules importing torch.distributed they reach."""
    out = {}
    for mod in g.modules:
        if any(mod == p or mod.startswith(p + ".") for p in PURE):
            bad = sorted(m for m in reaches(g, mod) if m in g.distributed)
            if bad:
                out[mod] = bad
    return out


def layer_of(mod: str) -> int | None:
    """Index in LAYERS of the most specific prefix naming ``mod``'s layer."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def upward_edges(g: Graph) -> list[tuple[str, str]]:
    """Imports from a lower layer into a higher one (the package faces excepted: they export)."""
    out = []
    for a, bs in g.edges.items():
        la = layer_of(a)
        for b in bs:
            lb = layer_of(b)
            if la is not None and lb is not None and lb > la:
                out.append((a, b))
    return sorted(out)


def _uses(tree: ast.AST, alias: str) -> set[str]:
    """The attributes read off the name ``alias`` in ``tree`` (``alias.x`` -> ``x``); ``*`` where
    the name is used otherwise (passed on whole)."""
    out: set[str] = set()
    attrs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == alias:
            out.add(n.attr)
        elif isinstance(n, ast.Name) and n.id == alias and id(n) not in attrs and isinstance(n.ctx, ast.Load):
            out.add("*")
    return out


def engine_internals(root: str) -> list[tuple[str, str]]:
    """(model-level module, engine name it takes) for every engine name outside ``ENGINE_DOORS``."""
    mods = _module_names(root)
    model = dict(LAYERS)["model"]
    out = []
    for mod, path in sorted(mods.items()):
        if not any(mod == p or mod.startswith(p + ".") for p in model):
            continue
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                out += [(mod, a.name) for a in node.names if a.name.startswith(ENGINE + ".") and a.name not in ENGINE_DOORS]
                continue
            base = _resolve(node.module or "", mod, path.endswith("__init__.py"), node.level)
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in ENGINE_DOORS:  # ``from autoparallel.engine import dispatch``: what is read off it
                    allowed = ENGINE_DOORS[full]
                    used = _uses(tree, a.asname or a.name)
                    out += [(mod, f"{full}.{u}") for u in sorted(used) if allowed is not None and u not in allowed]
                elif base in ENGINE_DOORS:
                    allowed = ENGINE_DOORS[base]
                    if allowed is not None and a.name not in allowed:
                        out.append((mod, full))
                elif base == ENGINE or base.startswith(ENGINE + "."):
                    out.append((mod, full))
    return out


# nn.Module's private storage and hook tables, tensors' hook tables, and the generator's reset:
# read only through ``autoparallel.compat`` (which states why and the fallback)
PRIVATE_TORCH = re.compile(r"\._(parameters|buffers|modules|forward_hooks|forward_pre_hooks|backward_hooks|"
                           r"backward_pre_hooks|post_accumulate_grad_hooks)\b|torch\.set_rng_state\s*=")


def private_torch_uses(root: str) -> list[tuple[str, int, str]]:
    """(module, line, text) for every use of ``PRIVATE_TORCH`` outside ``autoparallel.compat``."""
    out = []
    for mod, path in sorted(_module_names(root).items()):
        if mod == "autoparallel.compat":
            continue
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if PRIVATE_TORCH.search(line.split("#", 1)[0]):
                    out.append((mod, i, line.strip()))
    return out


def report(root: str) -> str:
    g = build(root)
    cyc = cycles(g)
    pure = pure_reaching_distributed(g)
    lines = [f"{len(g.modules)} modules under {root}",
             f"import cycles: {len(cyc)} group(s); modules in cycles: {sum(len(c) for c in cyc)}"]
    lines += [f"  {len(c)}: {', '.join(c[:8])}{' ...' if len(c) > 8 else ''}" for c in cyc]
    lines.append(f"rule/planner modules reaching torch.distributed: {len(pure)}")
    lines += [f"  {m} -> {', '.join(v[:4])}" for m, v in sorted(pure.items())]
    up = upward_edges(g)
    lines.append(f"imports pointing up a layer: {len(up)}")
    lines += [f"  {a} -> {b}" for a, b in up]
    inner = engine_internals(root)
    lines.append(f"engine internals taken by model-level modules: {len(inner)}")
    lines += [f"  {a} -> {b}" for a, b in inner]
    private = private_torch_uses(root)
    lines.append(f"private torch names outside compat: {len(private)}")
    lines += [f"  {m}:{i}: {t}" for m, i, t in private]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(__file__)))))
