"""One set of domain errors, each with a stable code.

Clients branch on ``code``; the HTTP adapter maps codes to statuses in one
table (``adapters/http/errors.py``) and the CLI prints ``error [code]: message``.
Extra fields (``reason``, ``available`` ...) travel in ``extra`` and end up
beside ``code`` in the OpenAI error envelope.
"""

from __future__ import annotations

from typing import Any


class CapyError(Exception):
    """Base of every error CapyCTL reports to a client or operator."""

    code: str = "internal_error"

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra


class InvalidJson(CapyError):
    code = "invalid_json"

    def __init__(self, reason: str) -> None:
        super().__init__("request body is not valid JSON", reason=reason)


class InvalidRequest(CapyError):
    code = "invalid_request"


class TooLarge(CapyError):
    code = "too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is larger than the limit of {limit} bytes", limit=limit)


class MissingApiKey(CapyError):
    code = "missing_api_key"

    def __init__(self) -> None:
        super().__init__("no API key: send the header 'Authorization: Bearer <key>'")


class InvalidApiKey(CapyError):
    code = "invalid_api_key"

    def __init__(self) -> None:
        super().__init__("the API key is not valid")


class DailyLimit(CapyError):
    """ID-5 (Citadel): the key has used its calls for this UTC day; it may call again after 00:00 UTC."""

    code = "daily_limit"

    def __init__(self, name: str, limit: int, used: int, retry_after: int) -> None:
        super().__init__(
            f"the key {name!r} has used its {limit} calls for today (UTC); "
            f"it may call again in {retry_after} s, after 00:00 UTC",
            limit=limit,
            used=used,
        )
        self.retry_after = retry_after


class Forbidden(CapyError):
    """A valid key that may not use this endpoint."""

    code = "forbidden"


class ModelNotFound(CapyError):
    code = "model_not_found"

    def __init__(self, model: str, available: list[str]) -> None:
        listed = ", ".join(available) if available else "none deployed"
        super().__init__(
            f"model {model!r} is not deployed here; available: {listed}",
            model=model,
            available=available,
        )


class DeploymentStopped(CapyError):
    code = "deployment_stopped"

    def __init__(self, name: str, while_serving: bool = False) -> None:
        when = " while it answered this request" if while_serving else ""
        super().__init__(
            f"deployment {name!r} was stopped by an operator{when}; start it with: capyctl start deployment {name}",
            model=name,
        )


class DeploymentNotFound(CapyError):
    code = "deployment_not_found"

    def __init__(self, name: str) -> None:
        super().__init__(f"no deployment named {name!r}; see: capyctl list deployments")


class KeyNotFound(CapyError):
    code = "key_not_found"

    def __init__(self, name: str) -> None:
        super().__init__(f"no API key named {name!r}; see: capyctl list keys")


class EngineNotFound(CapyError):
    code = "engine_not_found"

    def __init__(self, name: str, host: str | None = None) -> None:
        if host is None:
            super().__init__(f"no engine named {name!r}; see: capyctl engine list")
        else:
            super().__init__(
                f"host {host!r} has no engine named {name!r}; add one with: capyctl engine add PATH "
                f"--host {host} --name {name} (see: capyctl list hosts)",
                host=host,
            )


class HostNotFound(CapyError):
    code = "host_not_found"

    def __init__(self, name: str) -> None:
        super().__init__(f"no host named {name!r}; see: capyctl list hosts")


class HostRevoked(CapyError):
    """A host's certificate is not (or no longer) the one the server accepts for its name."""

    code = "host_revoked"

    def __init__(self, name: str) -> None:
        super().__init__(
            f"host {name!r} is revoked or its certificate was replaced; to bring the machine back, "
            f"invite it again (capyctl invite host {name}) and join with the new file",
            host=name,
        )


class DeviceOffline(CapyError):
    """A host the server must reach is not online (suspended, lost or unlinked)."""

    code = "device_offline"

    def __init__(self, host: str, state: str, model: str | None = None, retry_after: int = 5) -> None:
        what = f"model {model!r} runs on host {host!r}, which" if model is not None else f"host {host!r}"
        super().__init__(
            f"{what} is {state}, not online; retry in {retry_after} s, or see: capyctl list hosts",
            host=host,
            state=state,
            reason=state,
            retry_after_s=retry_after,
            **({"model": model} if model is not None else {}),
        )
        self.retry_after = retry_after
        self.state = state  # the host's state (or "reconnecting", "unreachable"): its reason


class HostLost(CapyError):
    """A request's engine was on a host that was lost while it answered: its answer is incomplete."""

    code = "device_offline"

    def __init__(self, model: str, instance: int | None = None) -> None:
        super().__init__(
            f"the host running {model!r} went silent for longer than hosts.lost_after while it "
            "answered; the answer is incomplete (see: capyctl list hosts)",
            model=model,
            reason="lost",
            **({"instance": instance} if instance is not None else {}),
        )


class HostAnswerInvalid(CapyError):
    """A host answered a command with what CapyCTL cannot read (the host's counterpart of ``edge_error``)."""

    code = "edge_error"

    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"host {host!r} answered with what CapyCTL cannot read: {reason}", reason=reason, host=host)


class EngineInUse(CapyError):
    code = "engine_in_use"


class AlreadyExists(CapyError):
    code = "already_exists"


class InvalidConfig(CapyError):
    code = "invalid_config"


class InvalidEngine(CapyError):
    """An engine installation could not be recognised or probed."""

    code = "invalid_engine"


class EngineUnavailable(CapyError):
    """The engine could not be started or reached. ``unsent``: why nothing of the request can have reached an
    engine, when that is certain (``domain.balancing.Unsent``: it may go to another instance); None otherwise."""

    code = "engine_unavailable"
    unsent: str | None = None

    def before_sending(self, cause: str) -> EngineUnavailable:
        """The same error, marked as one that reached no engine, for ``cause``."""
        self.unsent = cause
        return self


class HostUnreachable(EngineUnavailable):
    """A host's ingress could not be reached, or refused the server (a gate key its agent no longer knows), or
    showed a certificate the host does not hold now: the machine, not its engine, is out of reach. Said in
    the host's name, never with its address; a client reads it as ``device_offline``."""

    code = "device_offline"

    def __init__(self, host: str, why: str, reason: str = "unreachable", model: str | None = None) -> None:
        what = f"model {model!r} runs on host {host!r}, which" if model is not None else f"host {host!r}"
        super().__init__(
            f"{what} cannot be reached now: {why}; retry in 1 s, or see: capyctl list hosts",
            host=host,
            reason=reason,
            retry_after_s=1,
            **({"model": model} if model else {}),
        )
        self.host, self.why, self.reason, self.retry_after = host, why, reason, 1

    def of(self, model: str) -> HostUnreachable:
        """The same, said of ``model``, for its client."""
        return HostUnreachable(self.host, self.why, self.reason, model)


class EdgeError(CapyError):
    """The engine answered something CapyCTL cannot relay faithfully (Citadel's ``edge_error``).

    A malformed chunk, an event or tool call past its limit, a 200 that is not
    an SSE stream, a stream that ends without ``[DONE]``: the client gets this
    instead of a partial or made-up answer. ``reason`` says what was wrong.
    """

    code = "edge_error"

    def __init__(self, reason: str) -> None:
        super().__init__(f"the engine's answer could not be relayed faithfully: {reason}", reason=reason)


class InternalError(CapyError):
    """Something went wrong inside CapyCTL itself; the log has the traceback under the request ID."""

    code = "internal_error"

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"internal error in CapyCTL; its log has the details under request ID {request_id}",
            request_id=request_id,
        )


class TooManyConnections(CapyError):
    code = "too_many_connections"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"CapyCTL already holds its limit of {limit} open client connections; retry shortly "
            "or raise --max-connections",
            limit=limit,
        )


class EngineRestarted(CapyError):
    code = "engine_restarted"

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(
            f"the engine serving {model!r} stopped while answering and is being restarted",
            model=model,
            reason=reason,
        )


class ApiMismatch(CapyError):
    code = "api_mismatch"

    def __init__(self, model: str, api: str, path: str, use: str) -> None:
        super().__init__(
            f"model {model} serves the {api} API, which {path} does not answer; send its requests to {use}",
            model=model,
        )


class CacheSaltUnsupported(CapyError):
    code = "cache_salt_unsupported"

    def __init__(self, key: str | None = None) -> None:
        if key is None:
            super().__init__(
                "this deployment's engine does not keep prompt caches apart by cache_salt; "
                "send the request without cache_salt, or use a vLLM or SGLang deployment"
            )
        else:  # the salt is the key's, the client cannot leave it out
            super().__init__(
                f"the key {key!r} is bound to a cache salt, and this deployment's engine does not keep prompt "
                "caches apart by cache_salt, so the isolation the key promises cannot be given; use a "
                "deployment on vLLM (or SGLang, for chat), or a key without a cache salt"
            )


class UnverifiedStream(CapyError):
    code = "unverified_stream"

    def __init__(self, key: str, where: str) -> None:
        super().__init__(
            f"the engine sent the delta key {key!r}, which is not verified for {where}; "
            "the stream was ended so that an untested field never reaches a client",
            key=key,
        )


class DeadlineExceeded(CapyError):
    code = "deadline_exceeded"


class StreamIdleTimeout(CapyError):
    code = "stream_idle_timeout"


def engine_code(error: dict[str, Any]) -> str | None:
    """An engine error's own code: its string ``code``, else its ``type`` (vLLM's code is the status number)."""
    for key in ("code", "type"):
        value = error.get(key)
        if isinstance(value, str) and value:
            return value[:100]
    return None


class EngineError(CapyError):
    """An engine's own error answer, relayed with its status and code."""

    code = "engine_error"

    def __init__(self, status: int, message: str, code: str | None, extra: dict[str, Any]) -> None:
        super().__init__(message, **extra)
        self.status = status
        if code:
            self.code = code


class Unauthorized(CapyError):
    code = "unauthorized"

    def __init__(self) -> None:
        super().__init__("management API: missing or wrong admin token")


class NotFound(CapyError):
    code = "not_found"


class MethodNotAllowed(CapyError):
    code = "method_not_allowed"


class QueueFull(CapyError):
    """LIFE-5: too many requests wait already; retry after ``retry_after`` seconds."""

    code = "queue_full"

    def __init__(self, model: str, reason: str, retry_after: int) -> None:
        super().__init__(
            f"too many requests are waiting for {model!r} ({reason}); retry in {retry_after} s",
            model=model,
            reason=reason,
            retry_after_s=retry_after,
        )
        self.retry_after = retry_after


class ModelLoading(CapyError):
    """LIFE-4: the model is starting and this request would not wait (X-LLM-Wait); it starts anyway."""

    code = "model_loading"

    def __init__(self, model: str, state: str, retry_after: int) -> None:
        super().__init__(
            f"model {model!r} is loading ({state}); retry in {retry_after} s, "
            "or send a larger X-LLM-Wait to wait for it",
            model=model,
            state=state,
            retry_after_s=retry_after,
        )
        self.retry_after = retry_after


class Queued(CapyError):
    """LIFE-4: the model is ready but busy, and this request would not wait (X-LLM-Wait)."""

    code = "queued"

    def __init__(self, model: str, position: int, reason: str, retry_after: int) -> None:
        super().__init__(
            f"model {model!r} is busy: this request would be number {position} in its queue "
            f"({reason}); retry in {retry_after} s, or send a larger X-LLM-Wait",
            model=model,
            position=position,
            reason=reason,
            retry_after_s=retry_after,
        )
        self.retry_after = retry_after


class DeviceBusy(CapyError):
    """LIFE-5 (Citadel): CapyCTL holds its limit of open engine calls (queue.max_open)."""

    code = "device_busy"

    def __init__(self, limit: int, retry_after: int) -> None:
        super().__init__(
            f"{limit} engine calls are open, the limit (queue.max_open); retry in {retry_after} s",
            limit=limit,
            retry_after_s=retry_after,
        )
        self.retry_after = retry_after


class LlmUnavailable(CapyError):
    """Citadel's ``llm-unavailable``: the engine failed to start (or crashed at each start) past its budget.

    Requests do not start it again; ``capyctl start deployment NAME`` does.
    """

    code = "llm-unavailable"

    def __init__(self, model: str, reason: str, log: str | None) -> None:
        where = f"; engine log: {log}" if log else ""
        super().__init__(
            f"the engine of {model!r} failed: {reason}{where}; after fixing it, start it with: "
            f"capyctl start deployment {model}",
            model=model,
            reason=reason,
        )


class InsufficientMemory(CapyError):
    """LIFE-3 (Citadel): the model cannot fit on its device even with every movable model gone."""

    code = "insufficient_memory"

    def __init__(self, model: str, reason: str, retry_after: int) -> None:
        super().__init__(
            f"model {model!r} does not fit: {reason}", model=model, reason=reason, retry_after_s=retry_after
        )
        self.retry_after = retry_after


class NotPlaced(CapyError):
    """No instance of the model could be placed: no machine that has its engine can take one now (each reason
    is said); placing is tried again as hosts come online and on each apply or start."""

    code = "not_placed"

    def __init__(self, model: str, reasons: list[str]) -> None:
        super().__init__(
            f"model {model!r} has no instance placed: {'; '.join(reasons)}; see: capyctl status deployment {model}",
            model=model,
            reasons=reasons,
            retry_after_s=5,
        )
        self.retry_after = 5


class GpuBusy(CapyError):
    """LIFE-5 (Citadel's ``gpu-busy``): a switch to make room failed (its drain ran out); the models that
    hold the device keep serving, and the request may be retried."""

    code = "gpu-busy"

    def __init__(self, model: str, reason: str, retry_after: int) -> None:
        super().__init__(
            f"model {model!r} could not be switched in: {reason}; retry in {retry_after} s",
            model=model,
            reason=reason,
            retry_after_s=retry_after,
        )
        self.retry_after = retry_after


class StillServing(CapyError):
    """An operator's park found the model still serving after the drain timeout; it keeps serving."""

    code = "still_serving"

    def __init__(self, model: str, in_flight: int, timeout: float) -> None:
        super().__init__(
            f"deployment {model!r} still had {in_flight} requests at its engine after "
            f"switching.drain_timeout ({timeout:.0f} s); it keeps serving: park it again later",
            model=model,
            in_flight=in_flight,
        )


class EngineRejected(CapyError):
    """DEC-2: the engine refused a decision request (too many options, instructions missing ...)."""

    code = "engine_rejected"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"the engine refused the decision request: {message}", status=status)
        self.status = status
