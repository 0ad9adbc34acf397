"""benchmarks/RESULTS.md is what ``python -m benchmarks.results`` renders from the stored runs."""

from __future__ import annotations

import os
import sys

from benchmarks import results


def _record(name: str, **over: object) -> dict[str, object]:
    rec: dict[str, object] = {"name": name, "command": results.BY_NAME[name].command, "date": "2026-01-02",
                              "machine": "2 cores", "version": "abc1234", "wall_s": 12.3, "rc": 0,
                              "output": "line 1\nline 2", "error": ""}
    rec.update(over)
    return rec


def test_the_file_in_the_repository_is_the_stored_runs_rendered() -> None:
    with open(results.RESULTS) as f:
        assert f.read() == results.render(results.load()), \
            "benchmarks/RESULTS.md differs from its runs: regenerate it with python -m benchmarks.results"


def _script(b: results.Bench) -> str:
    if b.argv[:2] == ("-m", "torch.distributed.run"):
        return next(a for a in b.argv if a.endswith(".py"))
    return b.argv[1].replace(".", "/") + ".py" if b.argv[0] == "-m" else b.argv[0]


def test_every_registered_command_names_a_file_of_the_repository() -> None:
    for b in results.REGISTRY:
        assert os.path.exists(os.path.join(results.ROOT, _script(b))), b.name
    assert len(results.BY_NAME) == len(results.REGISTRY)  # names are unique


def test_a_section_says_what_ran_where_and_what_it_printed() -> None:
    text = results.render({"train_step": _record("train_step")})
    section = text.split("## The training step against torch")[1].split("\n## ")[0]
    assert "`python benchmarks/train_step.py` on 2026-01-02, 2 cores; code abc1234; 12 s." in section
    assert "```text\nline 1\nline 2\n```" in section
    assert "Not run yet: `python -m benchmarks.results --run static_step`." in text


def test_a_failed_run_is_shown_as_failed() -> None:
    text = results.render({"dispatch": _record("dispatch", rc=1, error="Traceback ...\nValueError: boom")})
    assert "**Exit status 1** (a target line above says FAIL, or the run failed)" in text and "ValueError: boom" in text


def test_a_run_stores_what_the_command_printed() -> None:
    bench = results.Bench("probe", "Probe", ("-c", "print('measured 1.5x'); import sys; sys.exit(3)"), "A probe.")
    rec = results.run(bench)
    assert rec["output"] == "measured 1.5x" and rec["rc"] == 3 and rec["command"].startswith("python -c")
    assert rec["machine"].startswith(f"{os.cpu_count()} cores") and sys.version.split()[0] in rec["machine"]


def test_the_version_is_marked_when_measured_code_changed() -> None:
    assert not results.measured_changes(" M benchmarks/RESULTS.md\n M benchmarks/runs/dispatch.json\n")
    assert results.measured_changes(" M benchmarks/RESULTS.md\n M autoparallel/api.py\n")
    assert results.measured_changes("M  benchmarks/dispatch.py\n")
    assert not results.measured_changes("")
