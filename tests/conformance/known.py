"""op_db conformance, part 5: the known-failures bookkeeping (``tests/conformance/known_failures.py``).

Only clear failures of ours (error or hang) may be listed, each with its reason; a WRONG result
is never listable. ``unlisted`` finds failures without an entry, ``stale`` entries whose case
now passes, and ``updated_known_failures``/``write_known_failures`` regenerate the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tests.conformance.samples import PHASES, VARIANTS

FORWARD_FAILED = ("forward failed", "forward was wrong")  # backward reasons covered by the forward's entry
Key = tuple[str, str, str]


def known_failures() -> tuple[dict[str, str], dict[Key, str]]:
    """(EXCLUDED, KNOWN_FAILURES) of ``tests/conformance/known_failures.py``."""
    from tests.conformance import known_failures as kf

    return dict(kf.EXCLUDED), dict(kf.KNOWN_FAILURES)


def listed_reason(known: dict[Key, str], op: str, variant: str, phase: str) -> str | None:
    """The entry for (op, variant, phase), or for (op, "*", phase)."""
    return known.get((op, variant, phase), known.get((op, "*", phase)))


def needs_entry(rec: dict[str, Any], phase: str) -> bool:
    """A clear failure (error/hang) that must be listed; WRONG is never acceptable, so never listed."""
    if rec[phase] not in ("error", "hang"):
        return False
    return not (phase == "backward" and rec["forward"] != "pass"
                and any(rec["backward_reason"].startswith(f) for f in FORWARD_FAILED))


def unlisted(records: Iterable[dict[str, Any]], known: dict[Key, str] | None = None) -> list[tuple[Key, str]]:
    """Failures of ours (error/hang) that have no known-failures entry, with their reasons."""
    known = known_failures()[1] if known is None else known
    out = []
    for r in records:
        if r["backend"] != "ours":
            continue
        for phase in PHASES:
            if needs_entry(r, phase) and listed_reason(known, r["op"], r["variant"], phase) is None:
                out.append(((r["op"], r["variant"], phase), f"{r[phase]}: {r[phase + '_reason']} [{r[phase + '_where']}]"))
    return out


def stale(records: Iterable[dict[str, Any]], known: dict[Key, str] | None = None) -> list[Key]:
    """Known-failure entries whose case ran and passed (or had nothing to compare)."""
    known = known_failures()[1] if known is None else known
    out: set[Key] = set()
    for r in records:
        if r["backend"] != "ours":
            continue
        for phase in PHASES:
            if r[phase] in ("pass", "skip"):
                for key in ((r["op"], r["variant"], phase), (r["op"], "*", phase)):
                    if key in known:
                        out.add(key if key[1] != "*" else (r["op"], f"* (passes on {r['variant']})", phase))
    return sorted(out)


def render_known_failures(excluded: dict[str, str], known: dict[Key, str]) -> str:
    """The text of ``tests/conformance/known_failures.py`` for these entries."""
    lines = [
        '"""Known failures of ours in the op_db conformance test: ``{(op, variant, phase): reason}``.',
        "",
        "``op`` is the OpInfo name (``name.variant_test_name``), ``variant`` one of replicate, shard0,",
        'shard_last, uneven (``"*"``: every variant), ``phase`` forward or backward. Only clear failures',
        "(the op raised, or hung) are listed: a WRONG (silently incorrect) result is never acceptable.",
        "A backward that failed because its forward failed is covered by the forward's entry.",
        "",
        "Regenerate from a run (entries of cases not run are kept)::",
        "",
        "    python benchmarks/op_coverage.py --backends ours --write-known-failures",
        "",
        "``EXCLUDED``: ops not run at all (too slow, or they touch global state), with the reason.",
        '"""',
        "",
        "EXCLUDED: dict[str, str] = {",
        *(f"    {k!r}: {v!r}," for k, v in sorted(excluded.items())),
        "}",
        "",
        "KNOWN_FAILURES: dict[tuple[str, str, str], str] = {",
        *(f"    {k!r}: {v!r}," for k, v in sorted(known.items())),
        "}",
        "",
    ]
    return "\n".join(lines)


def updated_known_failures(records: Sequence[dict[str, Any]], known: dict[Key, str]) -> dict[Key, str]:
    """``known`` with the entries of every (op, variant) in ``records`` (ours) recomputed."""
    ours = [r for r in records if r["backend"] == "ours"]
    ran = {(r["op"], r["variant"]) for r in ours}
    ran_ops = {op for op, _ in ran}
    kept = {k: v for k, v in known.items()
            if (k[0], k[1]) not in ran and not (k[1] == "*" and k[0] in ran_ops)}
    fresh: dict[Key, str] = {}
    for r in ours:
        for phase in PHASES:
            if needs_entry(r, phase):
                fresh[(r["op"], r["variant"], phase)] = f"{r[phase]}: {r[phase + '_reason']}" if r[phase] == "hang" \
                    else r[phase + "_reason"]
            elif r[phase] == "WRONG":
                # Not listable; but a run on fewer samples may see only another sample's error.
                errs = [s for s in r.get("samples", []) if s[phase] == "error"
                        and not (phase == "backward" and s["backward_detail"] in FORWARD_FAILED)]
                if errs:
                    fresh[(r["op"], r["variant"], phase)] = errs[0][phase + "_detail"]
    # One "*" entry where every variant fails in that phase; kept "*" entries of partly-run ops
    # are expanded first so that nothing is lost.
    for (op, variant, phase), why in known.items():
        if variant == "*" and op in ran_ops:
            for v in VARIANTS:
                if (op, v) not in ran:
                    kept[(op, v, phase)] = why
    merged = {**kept, **fresh}
    for op in sorted({k[0] for k in merged}):
        for phase in PHASES:
            keys = [(op, v, phase) for v in VARIANTS]
            if all(k in merged for k in keys):
                why = merged[keys[0]]
                for k in keys:
                    del merged[k]
                merged[(op, "*", phase)] = why
    return merged


def write_known_failures(path: str, records: Sequence[dict[str, Any]]) -> None:
    excluded, known = known_failures()
    with open(path, "w") as f:
        f.write(render_known_failures(excluded, updated_known_failures(records, known)))
