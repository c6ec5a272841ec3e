"""The domain error of structured output and tool calling. No fastapi: ``api/`` translates it into an HTTP answer."""

from __future__ import annotations


class GuidedError(ValueError):
    """A structured-output or tool-calling request field the server cannot honour (an unsupported schema construct,
    a tool choice naming no tool...). ``str()`` is the message for the client; ``param`` names the request field
    (``api.errors.field_errors`` answers it as a 400 naming that field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
