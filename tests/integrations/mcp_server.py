"""A real MCP server for tests/integrations/test_mcp.py (mcp's ``MCPServer``, formerly
FastMCP): run over stdio as a subprocess (``python tests/integrations/mcp_server.py``), or
connected in-process (``mcp.Client(build())``). It counts its calls in ``CALLS``
(in-process only)."""

from collections import Counter
from typing import Any

CALLS: "Counter[str]" = Counter()


def build() -> Any:
    from mcp.server.mcpserver import Image, MCPServer
    from mcp.types import ToolAnnotations

    server = MCPServer("calc", log_level="WARNING")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def add(a: int, b: int) -> int:
        """Add two integers."""
        CALLS["add"] += 1
        return a + b

    @server.tool(annotations=ToolAnnotations(idempotent_hint=True, read_only_hint=False))
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        CALLS["multiply"] += 1
        return a * b

    @server.tool(annotations=ToolAnnotations(destructive_hint=True))
    def divide(a: int, b: int) -> float:
        """Divide a by b."""
        CALLS["divide"] += 1
        if b == 0:
            raise ValueError("b must not be 0")
        return a / b

    @server.tool()
    def logo() -> Image:
        """The project's logo."""
        return Image(data=b"\x89PNG\r\n\x1a\n" + bytes(92), format="png")

    return server


if __name__ == "__main__":
    build().run()  # stdio
