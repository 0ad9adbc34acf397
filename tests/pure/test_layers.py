"""The library's structure: no import cycles, imports point down the layers, pure layers stay pure.

Read from the source by ``tests.importgraph`` (module-level and function-local imports, package
``__init__``s run on the way). A subprocess then checks what importing the pure layers really
loads.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import importgraph

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def graph() -> importgraph.Graph:
    return importgraph.build(ROOT)


def test_every_library_module_is_read(graph: importgraph.Graph) -> None:
    assert {"autoparallel", "autoparallel.engine.dispatch", "spmd_rules.nn", "reshard.planner"} <= set(graph.modules)
    assert all(importgraph.layer_of(m) is not None for m in graph.modules), [
        m for m in graph.modules if importgraph.layer_of(m) is None
    ]


def test_no_import_cycles(graph: importgraph.Graph) -> None:
    assert importgraph.cycles(graph) == []


def test_imports_point_down(graph: importgraph.Graph) -> None:
    assert importgraph.upward_edges(graph) == []


def test_rules_and_planner_never_reach_torch_distributed(graph: importgraph.Graph) -> None:
    assert importgraph.pure_reaching_distributed(graph) == {}
    assert "autoparallel.runtime.comm" in graph.distributed  # the check sees the modules that do


def test_model_level_code_takes_the_engine_through_its_doors() -> None:
    # engine.layout whole, the DistTensor class, and dispatch.observed_by: nothing else
    assert importgraph.engine_internals(ROOT) == []


def test_private_torch_names_go_through_compat(tmp_path: object) -> None:
    # nn.Module's slots and hook tables, tensors' hook tables, torch.set_rng_state patching
    assert importgraph.private_torch_uses(ROOT) == []
    root = str(tmp_path)
    path = os.path.join(root, "autoparallel", "x.py")
    os.makedirs(os.path.dirname(path))
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("a = m._parameters\nb = m._parameters_seen  # m._modules in a comment\ntorch.set_rng_state = f\n")
    assert [(m, i) for m, i, _ in importgraph.private_torch_uses(root)] == [("autoparallel.x", 1), ("autoparallel.x", 3)]


def test_the_door_check_sees_engine_internals(tmp_path: object) -> None:
    root = str(tmp_path)
    files = {
        "autoparallel/__init__.py": "", "autoparallel/engine/__init__.py": "",
        "autoparallel/engine/decide.py": "", "autoparallel/engine/dispatch.py": "", "autoparallel/engine/layout.py": "",
        "autoparallel/regions/__init__.py": "",
        "autoparallel/regions/a.py": ("from autoparallel.engine.decide import mesh_coord\n"
                                      "from autoparallel.engine import dispatch, layout\n"
                                      "dispatch.observed_by(1); dispatch._OBSERVERS; layout.anything\n"),
        "autoparallel/regions/b.py": "from autoparallel.engine.dtensor import DistTensor, _FromLocal\n",
    }
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    assert importgraph.engine_internals(root) == [
        ("autoparallel.regions.a", "autoparallel.engine.decide.mesh_coord"),
        ("autoparallel.regions.a", "autoparallel.engine.dispatch._OBSERVERS"),
        ("autoparallel.regions.b", "autoparallel.engine.dtensor._FromLocal"),
    ]


def test_values_import_nothing_above_them(graph: importgraph.Graph) -> None:
    for mod in ("autoparallel.placement", "autoparallel.mesh", "autoparallel.spec", "autoparallel.cost"):
        assert all(importgraph.layer_of(m) == 0 for m in importgraph.reaches(graph, mod)), mod


def test_the_checker_finds_what_it_must(tmp_path: object) -> None:
    """A deferred import that closes a circle, an ``__init__`` that pulls the engine in, and a
    rule reaching torch.distributed are all seen (TYPE_CHECKING imports are not)."""
    root = str(tmp_path)
    files = {
        "autoparallel/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autoparallel.engine import x\n",
        "autoparallel/placement.py": "",
        "autoparallel/engine/__init__.py": "",
        "autoparallel/engine/x.py": "import torch.distributed as dist\nfrom autoparallel import placement\n",
        "autoparallel/engine/y.py": "def f():\n    from autoparallel.engine import z\n",
        "autoparallel/engine/z.py": "from autoparallel.engine import y\n",
        "spmd_rules/__init__.py": "from autoparallel.placement import *\n",
        "spmd_rules/bad.py": "from autoparallel.engine.x import *\n",
        "reshard/__init__.py": "",
    }
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    g = importgraph.build(root)
    assert importgraph.cycles(g) == [["autoparallel.engine.y", "autoparallel.engine.z"]]
    assert importgraph.pure_reaching_distributed(g) == {"spmd_rules.bad": ["autoparallel.engine.x"]}
    assert ("spmd_rules.bad", "autoparallel.engine.x") in importgraph.upward_edges(g)
    assert "autoparallel.engine.x" not in g.edges["autoparallel"]


def test_importing_the_pure_layers_loads_no_engine_runtime_or_model_code() -> None:
    code = (
        "import sys\n"
        "import spmd_rules, reshard.planner, reshard.crossmesh\n"
        "import autoparallel.placement, autoparallel.mesh, autoparallel.spec\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('autoparallel', 'spmd_rules', 'reshard')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stdout)  # noqa: S307  (our own subprocess's printed list)
    layers = {importgraph.layer_of(m) for m in loaded}
    assert layers <= {0, 1}, [m for m in loaded if importgraph.layer_of(m) not in (0, 1)]
    assert "spmd_rules.nn" in loaded and "reshard.planner" in loaded


PRIVATE_FIELDS = {"_local", "_spec", "_stride", "_raw", "_done"}


def test_model_level_code_uses_the_layout_door(graph: importgraph.Graph) -> None:
    """Model-level modules read and re-lay out DistTensors through the public API and
    ``autoparallel.engine.layout``, never through a DistTensor's private fields."""
    import ast

    found = []
    for mod, path in graph.modules.items():
        if importgraph.layer_of(mod) != len(importgraph.LAYERS) - 1:
            continue
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE_FIELDS:
                found.append(f"{mod}:{node.lineno} .{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in PRIVATE_FIELDS):
                found.append(f"{mod}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert found == []
