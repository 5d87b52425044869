"""User-facing errors: one line naming the file and the field, exit code 2, no traceback; and the HTTP
server's OpenAI-style error (:class:`APIError`), here so that the request parsers (``coli.constrain``,
``coli.tool_calls``, ``coli.messages``) raise it without importing ``coli.server``, which imports them."""
from __future__ import annotations


class ColiError(Exception):
    """An error caused by the user's input (a file, a flag, a prompt).

    ``str(err)`` is the whole message, one line, e.g.
    ``"model.gguf: header: tensor_count 9223372036854775808 exceeds what the file can hold"``.
    The CLI prints ``coli: <message>`` on stderr and exits with code 2.
    """

    exit_code = 2


class APIError(Exception):
    """An OpenAI-style error: HTTP ``status``, ``message``, ``type``, ``param`` (the field), ``code``; ``extra``
    fields join the error object (llama-server's ``n_prompt_tokens`` and ``n_ctx`` of a prompt past the context)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 **extra):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.extra = extra

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}
