"""The package's public names: each resolves to what it names, in whatever order a script reads
them (a name that is also a module's name must never be shadowed by that module)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import autoparallel as ap


def test_every_exported_name_is_its_modules_object() -> None:
    for name, module in ap._EXPORTS.items():
        assert getattr(ap, name) is getattr(importlib.import_module(module), name), name


def test_reading_local_layer_first_keeps_local_map_a_function() -> None:
    # a fresh interpreter: the order of first reads is what matters
    code = "import autoparallel as ap; ap.LocalLayer; assert callable(ap.local_map), ap.local_map"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_torchs_spellings_of_the_linear_styles_are_the_same_styles() -> None:
    assert ap.ColwiseParallel is ap.ColWiseParallel and ap.RowwiseParallel is ap.RowWiseParallel
