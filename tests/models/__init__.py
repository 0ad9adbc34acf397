"""Tier ``models``: the examples (GPT, simplenet) trained end to end, torchrun included. ``pytest -m models``."""
