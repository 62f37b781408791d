"""The gateway's own errors, in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, as a
JSON response or as the SSE error event that ends a broken stream."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from llmserve.server.protocol import ErrorInfo, ErrorResponse

RETRY_AFTER_SECONDS = 1
SSE_DONE = b"data: [DONE]\n\n"

_TYPE_BY_STATUS = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable_error"}


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict:
    error_type = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code)).model_dump()


def error_response(
    status: int, message: str, *, code: str | None = None, param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code=code, param=param), status_code=status, headers=headers)


def no_replica(pool: str) -> JSONResponse:
    return error_response(
        503, f"No replica of `{pool}` can take the request now; retry later.", code="no_replica_available",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def model_not_found(model: str) -> JSONResponse:
    return error_response(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def replica_failed(message: str) -> JSONResponse:
    return error_response(502, message, code="replica_failed")


def sse_error_and_done(message: str) -> bytes:
    """The end of a stream whose replica failed mid-way: an error event, then `data: [DONE]`."""
    event = json.dumps(error_body(502, message, code="replica_failed"))
    return f"data: {event}\n\n".encode() + SSE_DONE


KV_TRANSFER_PARAMS_REFUSED = ("`kv_transfer_params` is set by the gateway itself (prefill/decode "
                              "disaggregation); a request may not carry it.")


def kv_transfer_params_refused() -> JSONResponse:
    """A client's body with `kv_transfer_params`: the gateway's own, for prefill/decode disaggregation."""
    return error_response(400, KV_TRANSFER_PARAMS_REFUSED, code="unsupported_parameter", param="kv_transfer_params")
