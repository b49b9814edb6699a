"""The types of the messages and tool definitions fsm returns, shaped as the openai SDK's.

:meth:`ConversationStore.history() <fsm.store.ConversationStore.history>` returns
``list[Message]``, :meth:`Turn.to_message() <fsm.parser.Turn.to_message>` an
:class:`AssistantMessage`, :meth:`ToolCall.to_dict() <fsm.toolcall.ToolCall.to_dict>` a
:class:`FunctionToolCall`, :func:`fsm.agent.function_tool` a :class:`ToolDefinition`. Each
:class:`~typing.TypedDict` here has exactly the keys, required keys and value types of the openai
SDK's request type of the same role (``ChatCompletionUserMessageParam``,
``ChatCompletionAssistantMessageParam``, ``ChatCompletionToolMessageParam``,
``ChatCompletionToolParam``, ...), so passing them on type-checks under ``mypy --strict``:

.. code-block:: python

    from openai import OpenAI
    from fsm.agent import function_tool
    from fsm.store import ConversationStore
    from fsm.types import Message, ToolDefinition

    messages: list[Message] = store.history("chat-1")
    tools: list[ToolDefinition] = [function_tool(add)]
    OpenAI().chat.completions.create(model="gpt-4o-mini", messages=messages, tools=tools)

(A TypedDict matches another only when both have the same keys with the same types, so these
follow one SDK version: the one fsm's tests type-check against, openai 3.57. The only extra key
is fsm's ``reasoning_content`` on :class:`AssistantMessage`, which type checkers allow.) Like the
SDK's, list values are typed ``Iterable``: read them with a ``for`` loop or ``list(...)``.

This module imports nothing beyond :mod:`typing` and ``typing_extensions`` (which pydantic, an
fsm dependency, brings): it works without the openai SDK, and pydantic can validate with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, Required, TypeAlias

# typing_extensions (a dependency of pydantic): pydantic validates these only from there on 3.11
from typing_extensions import TypedDict

__all__ = [
    "AnthropicMessage",
    "AssistantMessage",
    "Audio",
    "ContentPart",
    "ContentPartFile",
    "ContentPartImage",
    "ContentPartInputAudio",
    "ContentPartRefusal",
    "ContentPartText",
    "CustomToolCall",
    "CustomToolCallCustom",
    "DeveloperMessage",
    "FileFile",
    "FunctionCall",
    "FunctionDefinition",
    "FunctionMessage",
    "FunctionToolCall",
    "FunctionToolCallFunction",
    "ImageURL",
    "InputAudio",
    "Message",
    "PromptCacheBreakpoint",
    "ResponsesItem",
    "SystemMessage",
    "ToolDefinition",
    "ToolMessage",
    "UserMessage",
]


# -- content parts -----------------------------------------------------------------------------
class PromptCacheBreakpoint(TypedDict, total=False):
    """A content part's prompt-cache breakpoint."""

    mode: Required[Literal["explicit"]]
    ttl: Literal["30m", "12h"]


class ContentPartText(TypedDict, total=False):
    """``{"type": "text", "text": ...}``."""

    text: Required[str]
    type: Required[Literal["text"]]
    prompt_cache_breakpoint: PromptCacheBreakpoint


class ContentPartRefusal(TypedDict, total=False):
    """``{"type": "refusal", "refusal": ...}`` (assistant messages)."""

    refusal: Required[str]
    type: Required[Literal["refusal"]]


class ImageURL(TypedDict, total=False):
    """The ``image_url`` of an image part."""

    url: Required[str]
    detail: Literal["auto", "low", "high", "original"]


class ContentPartImage(TypedDict, total=False):
    """``{"type": "image_url", "image_url": {"url": ...}}``."""

    image_url: Required[ImageURL]
    type: Required[Literal["image_url"]]
    prompt_cache_breakpoint: PromptCacheBreakpoint


class InputAudio(TypedDict, total=False):
    """The ``input_audio`` of an audio part."""

    data: Required[str]
    format: Required[Literal["wav", "mp3"]]


class ContentPartInputAudio(TypedDict, total=False):
    """``{"type": "input_audio", "input_audio": {"data": ..., "format": ...}}``."""

    input_audio: Required[InputAudio]
    type: Required[Literal["input_audio"]]
    prompt_cache_breakpoint: PromptCacheBreakpoint


class FileFile(TypedDict, total=False):
    """The ``file`` of a file part."""

    file_data: str
    file_id: str
    filename: str


class ContentPartFile(TypedDict, total=False):
    """``{"type": "file", "file": {...}}``."""

    file: Required[FileFile]
    type: Required[Literal["file"]]
    prompt_cache_breakpoint: PromptCacheBreakpoint


#: A part of a user message's content.
ContentPart: TypeAlias = (
    ContentPartText | ContentPartImage | ContentPartInputAudio | ContentPartFile
)


# -- messages ----------------------------------------------------------------------------------
class SystemMessage(TypedDict, total=False):
    """A ``system`` message."""

    content: Required[str | Iterable[ContentPartText]]
    role: Required[Literal["system"]]
    name: str


class DeveloperMessage(TypedDict, total=False):
    """A ``developer`` message."""

    content: Required[str | Iterable[ContentPartText]]
    role: Required[Literal["developer"]]
    name: str


class UserMessage(TypedDict, total=False):
    """A ``user`` message (text, or content parts)."""

    content: Required[str | Iterable[ContentPart]]
    role: Required[Literal["user"]]
    name: str


class Audio(TypedDict, total=False):
    """A previous audio response, by id."""

    id: Required[str]


class FunctionCall(TypedDict, total=False):
    """The deprecated ``function_call`` of an assistant message (a legacy call's, see
    :attr:`fsm.toolcall.ToolCall.legacy`)."""

    arguments: Required[str]
    name: Required[str]


class FunctionToolCallFunction(TypedDict, total=False):
    """The ``function`` of a tool call: its name and its arguments (JSON text, byte-exact)."""

    arguments: Required[str]
    name: Required[str]


class FunctionToolCall(TypedDict, total=False):
    """One entry of an assistant message's ``tool_calls``."""

    id: Required[str]
    function: Required[FunctionToolCallFunction]
    type: Required[Literal["function"]]


class CustomToolCallCustom(TypedDict, total=False):
    """The ``custom`` of a custom tool call."""

    input: Required[str]
    name: Required[str]


class CustomToolCall(TypedDict, total=False):
    """A custom tool call (fsm never returns one; part of the SDK's union)."""

    id: Required[str]
    custom: Required[CustomToolCallCustom]
    type: Required[Literal["custom"]]


if TYPE_CHECKING:
    # the installed openai SDK's own type (see Message below): what Turn.to_message() returns
    # then goes into a history of that SDK's messages, whatever its version
    from openai.types.chat import ChatCompletionAssistantMessageParam as AssistantMessage
else:

    class AssistantMessage(TypedDict, total=False):
        """An ``assistant`` message: content, refusal, tool calls; ``reasoning_content`` is fsm's
        (:meth:`Turn.to_message(include_reasoning=True) <fsm.parser.Turn.to_message>`)."""

        role: Required[Literal["assistant"]]
        audio: Audio | None
        content: str | Iterable[ContentPartText | ContentPartRefusal] | None
        function_call: FunctionCall | None
        name: str
        refusal: str | None
        tool_calls: Iterable[FunctionToolCall | CustomToolCall]
        reasoning_content: str


class ToolMessage(TypedDict, total=False):
    """A ``tool`` message: the result of the call ``tool_call_id``."""

    content: Required[str | Iterable[ContentPartText]]
    role: Required[Literal["tool"]]
    tool_call_id: Required[str]


class FunctionMessage(TypedDict, total=False):
    """A ``function`` message: the result of a legacy ``function_call`` (the deprecated
    functions API), named by its function."""

    content: Required[str | None]
    name: Required[str]
    role: Required[Literal["function"]]


#: A message of a conversation's history.
if TYPE_CHECKING:
    # what a type checker sees: the installed SDKs' own request types, so that a history passes
    # on whatever version of the openai and anthropic SDKs the application has (each version
    # changes its TypedDicts; a copy of one version's fails against another's). Without the SDK
    # installed, these are Any to the checker.
    from anthropic.types import MessageParam as AnthropicMessage
    from openai.types.chat import ChatCompletionMessageParam as Message
    from openai.types.responses import ResponseInputItemParam as ResponsesItem
else:
    Message: TypeAlias = (
        SystemMessage
        | DeveloperMessage
        | UserMessage
        | AssistantMessage
        | ToolMessage
        | FunctionMessage
    )
    #: an item of a Responses API ``input`` (``history(format="responses")``): the openai
    #: SDK's ``ResponseInputItemParam`` to a type checker
    ResponsesItem: TypeAlias = dict[str, object]
    #: a message of an Anthropic Messages request (``history(format="anthropic")``): the
    #: anthropic SDK's ``MessageParam`` to a type checker
    AnthropicMessage: TypeAlias = dict[str, object]


# -- tools -------------------------------------------------------------------------------------
class FunctionDefinition(TypedDict, total=False):
    """A function tool's name, description and JSON-schema ``parameters``."""

    name: Required[str]
    description: str
    parameters: dict[str, object]
    strict: bool | None


class ToolDefinition(TypedDict, total=False):
    """An entry of a request's ``tools`` (the SDK's ``ChatCompletionToolParam``)."""

    function: Required[FunctionDefinition]
    type: Required[Literal["function"]]
