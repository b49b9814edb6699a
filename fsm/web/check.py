"""The viewer's /check page (:mod:`fsm.web.pages`): the integrity check's counts per kind and its violations."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from fsm.store import audit
from fsm.web.bits import as_dicts, conversation_link
from fsm.web.html import attr, text, when
from fsm.web.views import MAX_VIOLATIONS, Cache, Pending, Query, View, pending_view


class CheckPage:
    """The ``/check`` page of :class:`~fsm.web.pages.Viewer`."""

    engine: Engine
    _check: Cache

    # -- /check --------------------------------------------------------------------------------
    def check(self, query: Query) -> View:
        """``fsm audit check`` as a page: each rule, pass or fail, the offending rows linked.
        The whole store is checked (seconds on a large one): the result is kept for reloads
        (``refresh=1`` checks again)."""

        def compute() -> tuple[dict[str, int], list[audit.Violation]]:
            counts: dict[str, int] = {}
            kept: list[audit.Violation] = []
            for violation in audit.check(self.engine):
                counts[violation.kind] = counts.get(violation.kind, 0) + 1
                if len(kept) < MAX_VIOLATIONS:
                    kept.append(violation)
            return counts, kept

        try:
            (counts, kept), computed, seconds = self._check.get(
                "all", compute, query.get("refresh") == "1"
            )
        except Pending as pending:
            return pending_view("Integrity check", pending, "the integrity check")
        kinds = list(audit.VIOLATION_KINDS)
        kinds += [k for k in counts if k not in audit.VIOLATION_KINDS]
        rules = [
            {
                "kind": kind,
                "rule": audit.VIOLATION_KINDS.get(kind, ""),
                "passed": counts.get(kind, 0) == 0,
                "violations": counts.get(kind, 0),
            }
            for kind in kinds
        ]
        found = sum(counts.values())
        data = {
            "computed_at": computed,
            "seconds": round(seconds, 3),
            "clean": found == 0,
            "violations_total": found,
            "rules": rules,
            "violations": as_dicts(kept),
            "violations_shown": len(kept),
        }
        verdict = (
            '<p class="verdict ok">No violations: the history contract holds over the whole store.</p>'
            if not found
            else f'<p class="verdict bad">{found:,} violation{"s" if found != 1 else ""} found.</p>'
        )
        body = [
            verdict,
            f'<p class="computed">checked {when(computed)} in {seconds:.2f} s '
            f'<a href="/check?refresh=1">check again</a></p>',
            '<table class="rows rules"><thead><tr><th>rule</th><th>result</th><th>violations</th>'
            "<th>what it checks</th></tr></thead><tbody>",
        ]
        for rule in rules:
            ok = rule["passed"]
            result = (
                '<span class="pass">pass</span>'
                if ok
                else f'<a class="fail" href="#kind-{attr(rule["kind"])}">fail</a>'
            )
            body.append(
                f'<tr class="{"pass" if ok else "fail"}"><td class="mono">{text(rule["kind"])}</td>'
                f'<td>{result}</td><td class="n">{rule["violations"]:,}</td>'
                f"<td>{text(rule['rule'])}</td></tr>"
            )
        body.append("</tbody></table>")
        if kept:
            body.append(
                f"<h2>Violations{f' (the first {len(kept):,})' if len(kept) < found else ''}</h2>"
                '<table class="rows"><thead><tr><th>kind</th><th>conversation</th><th>seq</th>'
                "<th>detail</th></tr></thead><tbody>"
            )
            first_of_kind: set[str] = set()
            for v in kept:
                row_id = ""
                if v.kind not in first_of_kind:
                    first_of_kind.add(v.kind)
                    row_id = f' id="kind-{attr(v.kind)}"'
                if v.conversation_id is not None:
                    anchor = f"m-{v.seq}" if v.seq is not None else ""
                    where = (
                        f'<a class="id" href="{conversation_link(v.conversation_id, v.seq, anchor=anchor)}">'
                        f"{text(v.conversation_id)}</a>"
                    )
                else:
                    where = '<span class="none">-</span>'
                body.append(
                    f'<tr{row_id}><td class="mono">{text(v.kind)}</td><td>{where}</td>'
                    f'<td class="n">{"" if v.seq is None else v.seq}</td><td>{text(v.detail)}</td></tr>'
                )
            body.append("</tbody></table>")
        return View("Integrity check", "".join(body), data)
