"""Tier ``pure``: one process, no world (rules, planner, values, property tests, schedules). ``pytest -m pure``."""
