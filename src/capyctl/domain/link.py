"""The messages of the control link between the server and a host, and their one wire form.

A host agent dials the server and keeps one connection open (the transport
lives in ``adapters/control``). Each frame on it is one JSON object whose
``type`` names the message:

- host -> server: ``hello`` (who it is and what already runs there, sent
  first on every connection), ``inventory`` (its devices and engines),
  ``load_sample`` (each instance's running and waiting counts),
  ``process_exit`` and ``command_result``;
- server -> host: ``callers`` (first: the certificate the host's ingress
  must require of its callers), ``command`` (launch, stop, park ... one instance), each
  with an ID, so that a command sent again is answered, not applied again,
  and a generation, so that an order superseded by a newer one is refused
  (``domain.hosts.CommandLedger``);
- both ways: ``heartbeat`` (silence is what makes a host suspended, then
  lost) and ``goodbye`` (the reason a side closes, e.g. ``host_revoked``);
- joining: ``join_request`` and ``join_accepted``, the only messages a
  machine without a host certificate may exchange.

Both ends run the same CapyCTL, so the schema is strict: an unknown field or
type is an error, never skipped, and ``PROTOCOL_VERSION`` in the hello lets a
side refuse a peer that speaks another version.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import msgspec

from capyctl.domain.deployments import Strict
from capyctl.domain.errors import InvalidRequest

PROTOCOL_VERSION = 2  # raised whenever a message changes in a way the other side could not read

Action = Literal[
    "launch", "adopt", "stop", "park", "wake", "probe", "load", "open_gate", "close_gate", "inspect_engine"
]


class _Message(Strict, tag_field="type", frozen=True):
    """Base of the link's messages: each subclass names its ``type`` with ``tag=``.

    msgspec's ``kw_only`` holds only for the fields a class defines itself, so
    each message says it again: no message can be built with its fields in
    the wrong order.
    """


class RunningInstance(Strict, kw_only=True, frozen=True):
    """An engine process a host runs for the server, as the host reports it in its hello.

    The pid alone does not identify a process (the kernel reuses pids);
    together with the start time the kernel records for it (from
    ``/proc/<pid>/stat``) it does, which is what lets a returning host's
    engines be proved to be the very processes the server launched.
    """

    instance: str  # "<deployment>/<n>"
    deployment: str
    number: int  # which launch of the deployment this is
    generation: int  # the generation of the command that launched it
    pid: int
    pid_start_time: float
    port: int  # where the engine answers, on the host's loopback
    launch_id: str  # chosen by the server for each launch; the ingress's gate key is tied to it


class DeviceReport(Strict, kw_only=True, frozen=True):
    name: str
    capacity: int  # bytes
    reserve: int  # bytes kept free for things CapyCTL does not run


class EngineReport(Strict, kw_only=True, frozen=True):
    name: str
    family: str  # vllm, sglang, llamacpp, tensorfold
    version: str
    path: str


class InstanceLoad(Strict, kw_only=True, frozen=True):
    instance: str
    running: int
    waiting: int
    kv_usage: float | None = None  # the share of its KV cache in use, where the engine reports it


class Hello(_Message, tag="hello", kw_only=True, frozen=True):
    host: str
    version: str  # the host's CapyCTL version, for operators
    protocol: int  # PROTOCOL_VERSION as the host speaks it
    capabilities: list[str] = []
    running: list[RunningInstance] = []
    ingress_port: int | None = None  # where the host's ingress listens (HTTPS, its certificate), if it runs one


class Inventory(_Message, tag="inventory", kw_only=True, frozen=True):
    devices: list[DeviceReport] = []
    engines: list[EngineReport] = []


class LoadSample(_Message, tag="load_sample", kw_only=True, frozen=True):
    """Each engine's load as the host read it at ``at`` (its wall clock), sent every second while the host
    runs engines: what the server balances a model's instances on. An engine whose read failed is left out
    (its load unknown)."""

    at: float
    loads: list[InstanceLoad] = []


ExitCause = Literal["exited", "agent_stopped"]


class ProcessExit(_Message, tag="process_exit", kw_only=True, frozen=True):
    """An engine the host ran for the server ended: by itself (``exited``: it crashed, or was killed on the
    host), or stopped by its agent on the way out (``agent_stopped``: the agent was asked to stop)."""

    instance: str
    pid: int
    returncode: int | None  # None: it ended without one the host could read
    at: float
    cause: ExitCause = "exited"


class Command(_Message, tag="command", kw_only=True, frozen=True):
    id: str
    generation: int
    instance: str
    action: Action
    args: dict[str, Any] = {}


class CommandResult(_Message, tag="command_result", kw_only=True, frozen=True):
    """The answer to the command ``id``; ``code`` and ``message`` say why when ``ok`` is false."""

    id: str
    generation: int
    ok: bool
    code: str | None = None
    message: str | None = None
    detail: dict[str, Any] = {}


class Heartbeat(_Message, tag="heartbeat", kw_only=True, frozen=True):
    seq: int
    at: float  # the sender's monotonic clock: for its own round trips, never compared with the other side's


class Goodbye(_Message, tag="goodbye", kw_only=True, frozen=True):
    code: str
    message: str


class Callers(_Message, tag="callers", kw_only=True, frozen=True):
    """The certificate the host's ingress must require of whoever calls it: the server's own, made at its
    start and sent first on every link (the link itself is mutual TLS under the pinned CA, so what comes
    on it is the server's word). Any other client, a host's certificate included, fails the handshake."""

    cert_pem: str


class JoinRequest(_Message, tag="join_request", kw_only=True, frozen=True):
    host: str
    secret: str  # the invitation's secret, base64url without padding
    csr_pem: str


class JoinAccepted(_Message, tag="join_accepted", kw_only=True, frozen=True):
    host: str
    cert_pem: str  # the host's certificate, signed by the server's CA


Message = (
    Hello
    | Inventory
    | LoadSample
    | ProcessExit
    | Command
    | CommandResult
    | Heartbeat
    | Goodbye
    | Callers
    | JoinRequest
    | JoinAccepted
)
TYPES = tuple(sorted(str(kind.__struct_config__.tag) for kind in get_args(Message)))

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """One frame as its message; ``InvalidRequest`` when it is not one the link knows."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        about_type = "`$.type`" in str(exc) or "field `type`" in str(exc)
        hint = f" (the link's types: {', '.join(TYPES)})" if about_type else ""
        raise InvalidRequest(f"not a control link message: {exc}{hint}") from exc
