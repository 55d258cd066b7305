"""The door's refusal of a request before it becomes a task (its status, the field it names,
OpenAI's error code): raised by the request's decoders, answered by the door."""

from __future__ import annotations


class BadRequest(Exception):
    """A request the door refuses before it becomes a task: ``status`` (400, 404, ...)."""

    def __init__(
        self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
