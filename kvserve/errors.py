"""Typed errors. The server maps each to an HTTP status (see ``status_code``).

Every error names the offending field in ``param`` so that a client sees *what* was wrong.
"""

from __future__ import annotations


class KVServeError(Exception):
    """Base class of kvserve's own errors."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(KVServeError, ValueError):
    """A request argument is invalid (HTTP 400). ``param`` names the field."""

    status_code = 400
    error_type = "invalid_request_error"


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus room for one output token) does not fit ``max_model_len`` or the KV cache."""


class ModelNotFoundError(KVServeError, LookupError):
    """A model name is neither in the catalog nor a path, or its package is not installed (HTTP 404)."""

    status_code = 404
    error_type = "not_found_error"


class EngineDeadError(KVServeError, RuntimeError):
    """The engine loop has died; no further requests can be served (HTTP 503)."""

    status_code = 503
    error_type = "service_unavailable"


class ExecutorDeadError(EngineDeadError):
    """A tensor-parallel worker died, or the ranks fell out of step; the engine cannot go on (HTTP 503)."""
