"""The activation API's contract, under its first name: it lives in
:mod:`controller.api.activation` (the bodies, the error table, ``/v1/state``); this module
re-exports it for the modules that import it from here."""

from __future__ import annotations

from controller.api.activation import (
    ENGINE_UNAUTHORIZED,
    ERRORS,
    MAX_BODY_BYTES,
    OTHER_REASON,
    PATH,
    STATE_PATH,
    SWITCH_FAILED,
    SWITCH_FAILURE_REASONS,
    TOKEN_HEADER,
    ActivateAnswer,
    ActivateRequest,
    ClaimantState,
    ErrorBody,
    ErrorDetail,
    LastSwitch,
    LeaseState,
    Refusal,
    StateAnswer,
    asks_again,
    refusal_of,
    wire_reason,
)

__all__ = ["ENGINE_UNAUTHORIZED", "ERRORS", "MAX_BODY_BYTES", "OTHER_REASON", "PATH",
           "STATE_PATH", "SWITCH_FAILED", "SWITCH_FAILURE_REASONS", "TOKEN_HEADER",
           "ActivateAnswer", "ActivateRequest", "ClaimantState", "ErrorBody", "ErrorDetail",
           "LastSwitch", "LeaseState", "Refusal", "StateAnswer", "asks_again", "refusal_of",
           "wire_reason"]
