"""Tier ``conformance``: the op_db harness (``harness.py`` and its parts) and its test. ``pytest -m conformance``."""
