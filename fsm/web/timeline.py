"""The viewer's /c/{id} page (:mod:`fsm.web.pages`): one conversation's timeline of messages, tool calls and attempts."""

from __future__ import annotations

import json

from sqlalchemy.engine import Engine

from fsm.store import audit
from fsm.store.audit import browse
from fsm.store.errors import InvalidFilterError
from fsm.web.bits import (
    api_badge,
    arguments_html,
    content_html,
    cut_note,
    more_calls_note,
    path_of_states,
    shorten,
)
from fsm.web.html import href, json_block, path_of, text, when
from fsm.web.views import LIMITS, STATES, Query, View, cursor, uncursor


class TimelinePage:
    """The ``/c/{id}`` page of :class:`~fsm.web.pages.Viewer`."""

    engine: Engine

    # -- /c/{id} -------------------------------------------------------------------------------
    def timeline(self, conversation_id: str, query: Query) -> View:
        """One conversation in seq order, with its attempts at their place in time."""
        limit = query.limit(LIMITS["timeline"])
        attempts_limit = query.limit(LIMITS["attempts"], "attempts_limit")
        after_text = query.get("after")
        if after_text is not None and not (
            after_text.isascii() and after_text.lstrip("-").isdigit() and len(after_text) <= 20
        ):
            raise InvalidFilterError("after must be a seq (a whole number)")
        after = None if after_text is None else int(after_text)
        attempts_after = uncursor(query.get("attempts_after"), 2)
        found = browse.timeline(
            self.engine,
            conversation_id,
            after=after,
            limit=limit,
            attempts_after=None
            if attempts_after is None
            else (attempts_after[0], attempts_after[1]),
            attempts_limit=attempts_limit,
        )
        title = f"Conversation {conversation_id}"
        if found is None:
            missing = (
                f'<p class="error">No conversation {text(conversation_id)} in this store.</p>'
                '<p><a href="/">All conversations</a></p>'
            )
            return View(
                title, missing, {"error": "not found", "conversation_id": conversation_id}, 404
            )
        data = found.as_dict()
        more_attempts = None if found.attempts_next is None else cursor(found.attempts_next)
        data["attempts_next_cursor"] = more_attempts
        base = path_of("c", conversation_id)
        body = [
            '<dl class="meta">'
            f"<dt>id</dt><dd>{text(conversation_id)}</dd>"
            f"<dt>created</dt><dd>{when(found.created_at)}</dd>"
            f"<dt>messages</dt><dd>{found.messages_total}</dd>"
            f"<dt>attempts here</dt><dd>{len(found.attempts)}</dd></dl>"
        ]
        if found.metadata is not None:
            body.append(
                f"<details><summary>metadata</summary>{json_block(found.metadata)}"
                f"{cut_note(['metadata'] if found.metadata_cut else [])}</details>"
            )
        links = [
            f'<a href="{href("/calls", {"conversation": conversation_id})}">its calls</a>',
            f'<a href="{href("/failures", {"conversation": conversation_id})}">its failures</a>',
        ]
        body.append(f'<p class="links">{" ".join(links)}</p>')
        body.append('<ol class="timeline" id="attempts">')
        pending = list(found.attempts)
        for message in found.messages:
            while pending and pending[0].at_seq <= message.seq:
                body.append(self._attempt(pending.pop(0)))
            body.append(self._message(conversation_id, message))
        for attempt in pending:
            body.append(self._attempt(attempt))
        body.append("</ol>")
        pager = []
        if after is not None:
            pager.append(f'<a href="{base}">first page</a>')
        if found.next_after is not None:
            pager.append(
                f'<a rel="next" class="next" href="{href(base, {"after": found.next_after})}">'
                "next page</a>"
            )
        if more_attempts is not None:
            kept = [(k, v) for k, v in query.pairs if k not in ("attempts_after", "format")]
            pager.append(
                f'<a class="next-attempts" href="{href(base, [*kept, ("attempts_after", more_attempts)])}">'
                "more attempts of these messages</a>"
            )
        shown = len(found.messages)
        body.append(
            f'<nav class="pager"><span class="count">{shown} message{"s" if shown != 1 else ""}'
            f", {len(found.attempts)} attempt{'s' if len(found.attempts) != 1 else ''}"
            f"</span> {' '.join(pager)}</nav>"
        )
        return View(title, "".join(body), data)

    def _message(self, conversation_id: str, m: browse.TimelineMessage) -> str:
        role = m.role if m.role in ("user", "assistant", "system", "developer", "tool") else "other"
        head = [
            f'<span class="role">{text(m.role)}</span>',
            f'<a class="seq" href="#m-{m.seq}">seq {m.seq}</a>',
        ]
        if m.model:
            head.append(f'<span class="model">{text(m.model)}</span>')
        if m.format is not None:
            head.append(api_badge(m.format))
        if m.finish_reason:
            head.append(f'<span class="finish">finish_reason {text(m.finish_reason)}</span>')
        head.append(when(m.created_at))
        parts = [f'<li class="msg msg-{role}" id="m-{m.seq}"><header>{" ".join(head)}</header>']
        if m.role == "tool":
            target = (
                f"#call-{m.assistant_seq}-{m.call_position}"
                if m.assistant_seq is not None and m.call_position is not None
                else ""
            )
            answered = (
                f'<a href="{target}">{text(m.tool_call_id)}</a>' if target else text(m.tool_call_id)
            )
            parts.append(f'<p class="answers">result for tool_call_id {answered}</p>')
        if m.reasoning:
            parts.append(
                f'<details class="reasoning"><summary>reasoning ({len(m.reasoning):,} characters)'
                f"</summary>{content_html(m.reasoning)}</details>"
            )
        if m.refusal:
            parts.append(f'<p class="refusal">refusal:</p>{content_html(m.refusal)}')
        parts.append(content_html(m.content))
        if m.calls:
            parts.append('<div class="calls">')
            for call in m.calls:
                parts.append(self._call(f"call-{m.seq}-{call.position}", call, history=True))
            parts.append("</div>")
        if m.more_calls:
            parts.append(more_calls_note())
        if m.usage is not None:
            parts.append(f"<details><summary>usage</summary>{json_block(m.usage)}</details>")
        parts.append(cut_note(m.cut))
        parts.append("</li>")
        return "".join(parts)

    def _call(self, anchor: str, call: browse.TimelineCall, *, history: bool) -> str:
        state = call.state if call.state in STATES else "unknown"
        parts = [
            f'<article class="call call-{state}" id="{anchor}">'
            f'<header><span class="name">{text(call.name) or "<em>(no name)</em>"}</span> '
            f'<span class="callid" title="tool_call_id">{text(call.call_id)}</span> '
            f'<a class="here" href="#{anchor}">#{call.position}</a></header>',
            path_of_states(call),
        ]
        if call.reason:
            parts.append(f'<p class="reason">reason: <strong>{text(call.reason)}</strong></p>')
        parts.append('<div class="pair"><div class="args"><h3>arguments</h3>')
        parts.append(arguments_html(call.arguments, call.state))
        if call.raw_arguments is not None and call.raw_arguments != call.arguments:
            parts.append(
                "<details><summary>raw arguments as streamed"
                f"{' (repaired)' if call.repaired else ''}</summary>"
                f'<pre class="raw">{text(call.raw_arguments, newlines=True)}</pre></details>'
            )
        parts.append('</div><div class="result"><h3>result</h3>')
        if history:
            if call.result_seq is None:
                parts.append('<p class="bad">no result found for this call</p>')
            else:
                same = call.result_tool_call_id == call.call_id
                mark = (
                    "tool_call_id matches"
                    if same
                    else f'<span class="bad">tool_call_id {text(call.result_tool_call_id)} differs</span>'
                )
                parts.append(
                    f'<p class="link"><a href="#m-{call.result_seq}">seq {call.result_seq}</a> '
                    f"({mark})</p>{content_html(call.result)}"
                )
        elif call.result is not None:
            parts.append(content_html(call.result))
        else:
            parts.append('<p class="none">never executed</p>')
        parts.append("</div></div>")
        parts.append(cut_note(call.cut))
        parts.append("</article>")
        return "".join(parts)

    def _attempt(self, a: browse.TimelineAttempt) -> str:
        why = audit.attempt_reason(a.finish_reason, a.end_how, a.end_reason, a.error)
        head = [
            f'<span class="role bad">failed attempt #{a.id}</span>',
            f"<span>at seq {a.at_seq}</span>",
        ]
        if a.model:
            head.append(f'<span class="model">{text(a.model)}</span>')
        if a.format is not None:
            head.append(api_badge(a.format))
        head.append(when(a.created_at))
        parts = [
            f'<li class="msg attempt" id="attempt-{a.id}"><header>{" ".join(head)}</header>',
            '<dl class="meta">',
            f"<dt>why</dt><dd><strong>{text(why) or 'unknown'}</strong></dd>",
            f"<dt>finish_reason</dt><dd>{text(a.finish_reason) or '-'}</dd>",
            f"<dt>stream ended</dt><dd>{text(a.end_how) or '-'}"
            f"{(': ' + text(a.end_reason)) if a.end_reason else ''}</dd>",
        ]
        if a.error:
            parts.append(f"<dt>error</dt><dd>{text(a.error)}</dd>")
        parts.append("</dl>")
        if a.reasoning:
            parts.append(
                f'<details class="reasoning"><summary>reasoning</summary>{content_html(a.reasoning)}</details>'
            )
        parts.append(content_html(a.content))
        anomalies = (
            a.anomalies
            if isinstance(a.anomalies, list)
            else ([] if a.anomalies is None else [a.anomalies])
        )
        if anomalies:
            parts.append('<div class="anomalies"><h3>anomalies the parser reported</h3><ul>')
            for anomaly in anomalies:
                if isinstance(anomaly, dict):
                    kind = anomaly.get("kind")
                    rest = {k: v for k, v in anomaly.items() if k != "kind"}
                    detail = json.dumps(rest, ensure_ascii=False, default=str) if rest else ""
                    parts.append(f"<li><strong>{text(kind)}</strong> {text(detail)}</li>")
                else:
                    parts.append(f"<li>{shorten(anomaly, 400)}</li>")
            parts.append("</ul></div>")
        if a.calls:
            parts.append('<div class="calls">')
            for call in a.calls:
                parts.append(self._call(f"attempt-{a.id}-{call.position}", call, history=False))
            parts.append("</div>")
        if a.more_calls:
            parts.append(more_calls_note())
        parts.append(cut_note(a.cut))
        parts.append("</li>")
        return "".join(parts)
