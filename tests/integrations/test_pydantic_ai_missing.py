"""``fsm.integrations.pydantic_ai`` imports without pydantic-ai, and using it names the extra
(not gated on pydantic-ai: a child Python sees it as missing either way)."""

from __future__ import annotations

from tests.helpers import child_json


def test_the_module_imports_without_pydantic_ai_and_names_the_extra() -> None:
    code = """
import builtins, json, sys
real = builtins.__import__
def fake(name, *args, **kwargs):
    if name == "pydantic_ai" or name.startswith("pydantic_ai."):
        raise ImportError(f"No module named {name!r}")
    return real(name, *args, **kwargs)
builtins.__import__ = fake
import importlib
real_import_module = importlib.import_module
def fake_module(name, package=None):
    if name == "pydantic_ai" or name.startswith("pydantic_ai."):
        raise ImportError(f"No module named {name!r}")
    return real_import_module(name, package)
importlib.import_module = fake_module
import fsm.integrations.pydantic_ai as m
try:
    m.FsmConversationStore
except Exception as exc:
    print(json.dumps([type(exc).__name__, isinstance(exc, ImportError), str(exc)]))
"""
    name, is_import_error, message = child_json(code, timeout=60)
    assert name == "PydanticAIMissingError" and is_import_error
    assert message.endswith("pip install 'fsm-toolcalls[pydantic-ai]'")
