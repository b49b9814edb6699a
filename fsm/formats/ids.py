"""Tool call ids and inputs as the Anthropic Messages API takes them, by a reversible rule.

The API refuses a ``tool_use`` whose ``id`` (and a ``tool_result`` whose ``tool_use_id``) does
not match ``^[a-zA-Z0-9_-]+$``, a ``tool_use`` id used twice in one request, and a
``tool_use.input`` that is not an object. Other providers send such ids (Kimi K2:
``functions.add:0``, reused in every turn; a lost id is ``""``) and arguments that are JSON
but not objects (``[1, 2]``, ``"x"``, ``3``, ``null``). fsm never rewrites a stored id: only
the *rendering* for Anthropic (``history(format="anthropic")``, ``Turn.to_anthropic()``)
applies this rule, to the ``tool_use`` ids and to the ``tool_result`` ids that answer them, so
every pair still matches:

* an id that matches the pattern, does not start like an encoded id and was not used before in
  the request is sent as it is (every id Anthropic itself produced);
* any other id is sent as :data:`PREFIX` (``fsmid_``) followed by the base64url form (no
  padding) of its UTF-8 bytes; the second use of the same id in one request gets ``fsmid2_``,
  the third ``fsmid3_``, and so on, so ids stay unique;
* :func:`original_id` reverses it: ``original_id(anthropic_id(x, n)) == x`` for every string
  ``x`` (lone surrogates included) and use ``n``;
* an ``input`` that is not an object is sent wrapped as ``{"value": <input>}``
  (:func:`anthropic_input`).

Stdlib only.
"""

from __future__ import annotations

import base64
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Final

__all__ = [
    "ANTHROPIC_ID_PATTERN",
    "PREFIX",
    "anthropic_id",
    "anthropic_input",
    "anthropic_safe",
    "original_id",
]

#: The pattern the Anthropic API requires of ``tool_use.id`` and ``tool_result.tool_use_id``.
ANTHROPIC_ID_PATTERN: Final = re.compile(r"[a-zA-Z0-9_-]+")
#: What an encoded id starts with (``fsmid2_`` ... for later uses of one id).
PREFIX: Final = "fsmid_"
_ENCODED: Final = re.compile(r"fsmid([0-9]*)_")
#: The key a non-object ``tool_use.input`` is wrapped in.
VALUE_KEY: Final = "value"


def anthropic_id(call_id: str, use: int = 1) -> str:
    """The id sent to Anthropic for ``call_id`` at its ``use``-th use in one request (see the
    module docstring)."""
    if (
        use == 1
        and ANTHROPIC_ID_PATTERN.fullmatch(call_id) is not None
        and _ENCODED.match(call_id) is None
    ):
        return call_id
    data = call_id.encode("utf-8", "surrogatepass")
    body = base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")
    return f"fsmid{use if use > 1 else ''}_{body}"


def original_id(sent: str) -> str:
    """The call id an id sent to Anthropic stands for (the inverse of :func:`anthropic_id`;
    an id that was not encoded is itself). ``ValueError`` for a malformed encoded id."""
    match = _ENCODED.match(sent)
    if match is None:
        return sent
    digits = match.group(1)
    if digits and (digits[0] == "0" or digits == "1"):
        raise ValueError(f"{sent!r} is not an id encoded by fsm")
    body = sent[match.end() :]
    try:
        data = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        call_id = data.decode("utf-8", "surrogatepass")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{sent!r} is not an id encoded by fsm") from exc
    # only the one form encoding gives (the decoder skips what is not base64url)
    if anthropic_id(call_id, int(digits or 1)) != sent:
        raise ValueError(f"{sent!r} is not an id encoded by fsm")
    return call_id


def anthropic_input(value: Any) -> dict[str, Any]:
    """``tool_use.input`` as Anthropic takes it: an object as it is, anything else wrapped as
    ``{"value": value}``."""
    return value if type(value) is dict else {VALUE_KEY: value}


def anthropic_safe(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` (Anthropic messages as fsm renders them: each assistant message's
    ``tool_use`` blocks answered by the ``tool_result`` blocks of the user message after it)
    with every ``tool_use`` id, ``tool_result.tool_use_id`` and ``tool_use.input`` made what the
    API takes, by the module's rule. New message and block objects where something changed;
    the input is not modified."""
    uses: Counter[str] = Counter()
    sent: dict[str, list[str]] = {}  # the last assistant message's ids: original -> sent
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        role = message.get("role")
        blocks: list[Any] = []
        if role == "assistant":
            sent = {}
            for block in content:
                if isinstance(block, Mapping) and block.get("type") == "tool_use":
                    block = dict(block)
                    cid = block.get("id")
                    if isinstance(cid, str):
                        uses[cid] += 1
                        new = anthropic_id(cid, uses[cid])
                        sent.setdefault(cid, []).append(new)
                        block["id"] = new
                    block["input"] = anthropic_input(block.get("input"))
                blocks.append(block)
        else:
            answered: Counter[str] = Counter()
            for block in content:
                if isinstance(block, Mapping) and block.get("type") == "tool_result":
                    cid = block.get("tool_use_id")
                    if isinstance(cid, str):
                        block = dict(block)
                        made = sent.get(cid, [])
                        k = answered[cid]
                        answered[cid] += 1
                        # answers pair with the calls in order; an answer to no call keeps a
                        # first-use form (the API refuses it, as it refuses the original)
                        block["tool_use_id"] = made[k] if k < len(made) else anthropic_id(cid)
                blocks.append(block)
            sent = {}
        out.append({**message, "content": blocks})
    return out
