"""The control link's messages (``domain/link``): each one survives the wire, and nothing unknown gets through."""

import json

import msgspec
import pytest

from capyctl.domain.errors import InvalidRequest
from capyctl.domain.link import (
    PROTOCOL_VERSION,
    TYPES,
    Callers,
    Command,
    CommandResult,
    DeviceReport,
    EngineReport,
    Goodbye,
    Heartbeat,
    Hello,
    InstanceLoad,
    Inventory,
    JoinAccepted,
    JoinRequest,
    LoadSample,
    Message,
    ProcessExit,
    RunningInstance,
    decode,
    encode,
)

RUNNING = RunningInstance(
    instance="qwen/1",
    deployment="qwen",
    number=3,
    generation=7,
    pid=4242,
    pid_start_time=123456.78,
    port=30001,
    launch_id="01HZX",
)

EVERY_MESSAGE: list[Message] = [
    Hello(
        host="gpu-1",
        version="0.9.0",
        protocol=PROTOCOL_VERSION,
        capabilities=["sleep", "multi_node"],
        running=[RUNNING],
    ),
    Inventory(
        devices=[DeviceReport(name="cuda:0", capacity=80 * 2**30, reserve=2**30)],
        engines=[EngineReport(name="vllm-0.11", family="vllm", version="0.11.0", path="/opt/vllm/bin/vllm")],
    ),
    LoadSample(at=812.5, loads=[InstanceLoad(instance="qwen/1", running=2, waiting=5)]),
    ProcessExit(instance="qwen/1", pid=4242, returncode=-9, at=900.25),
    ProcessExit(instance="qwen/1", pid=4242, returncode=None, at=900.25),
    ProcessExit(instance="qwen/1", pid=4242, returncode=-15, at=900.25, cause="agent_stopped"),
    Command(
        id="c-1",
        generation=7,
        instance="qwen/1",
        action="launch",
        args={"argv": ["vllm", "serve"], "env": {"A": "1"}, "port": 30001},
    ),
    CommandResult(id="c-1", generation=7, ok=True, detail={"pid": 4242, "pid_start_time": 123456.78}),
    CommandResult(id="c-2", generation=6, ok=False, code="stale_generation", message="older"),
    Heartbeat(seq=12, at=1.5),
    Goodbye(code="host_revoked", message="the server closed the link: host_revoked"),
    Callers(cert_pem="-----BEGIN CERTIFICATE-----\n"),
    JoinRequest(host="gpu-1", secret="c2VjcmV0", csr_pem="-----BEGIN CERTIFICATE REQUEST-----\n"),
    JoinAccepted(host="gpu-1", cert_pem="-----BEGIN CERTIFICATE-----\n"),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_wire(message: Message) -> None:
    data = encode(message)
    assert isinstance(data, bytes)
    back = decode(data)
    assert type(back) is type(message)
    assert back == message


def test_every_type_is_covered_and_named_in_snake_case() -> None:
    sent = {json.loads(encode(message))["type"] for message in EVERY_MESSAGE}
    assert sent == set(TYPES)
    assert "load_sample" in sent and "command_result" in sent and "process_exit" in sent


def test_the_wire_form_is_a_json_object_tagged_by_type() -> None:
    assert json.loads(encode(Heartbeat(seq=1, at=2.0))) == {"type": "heartbeat", "seq": 1, "at": 2.0}


def test_an_unknown_field_is_refused_with_its_name() -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode(b'{"type":"heartbeat","seq":1,"at":2.0,"jitter":0.1}')
    assert caught.value.code == "invalid_request"
    assert "unknown field `jitter`" in caught.value.message
    assert caught.value.message.startswith("not a control link message")


def test_an_unknown_field_inside_a_nested_report_is_refused() -> None:
    hello = json.loads(encode(EVERY_MESSAGE[0]))
    hello["running"][0]["cgroup"] = "x"
    with pytest.raises(InvalidRequest, match="unknown field `cgroup`"):
        decode(json.dumps(hello).encode())


def test_an_unknown_type_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode(b'{"type":"reboot","now":true}')
    assert "'reboot'" in caught.value.message
    for known in TYPES:
        assert known in caught.value.message


def test_a_message_without_type_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="missing required field `type`"):
        decode(b'{"seq":1,"at":2.0}')


@pytest.mark.parametrize("data", [b"", b"{", b"[1]", b'"hello"', b"\xff\xfe"])
def test_what_is_not_a_json_object_is_refused_as_a_domain_error(data: bytes) -> None:
    with pytest.raises(InvalidRequest):
        decode(data)


def test_an_action_outside_the_list_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="`\\$.action`"):
        decode(b'{"type":"command","id":"c","generation":1,"instance":"a/1","action":"reboot","args":{}}')


def test_a_field_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="`\\$.generation`"):
        decode(b'{"type":"command","id":"c","generation":"7","instance":"a/1","action":"stop"}')


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Heartbeat(seq=1, at=2.0).seq = 2  # type: ignore[misc]


def test_a_command_has_no_positional_form() -> None:
    """Keyword-only: a command built with its fields in the wrong order cannot pass silently."""
    with pytest.raises(TypeError):
        Command("c", 1, "a/1", "stop")  # type: ignore[misc]


def test_decode_errors_keep_their_cause() -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode(b'{"type":"goodbye"}')
    assert isinstance(caught.value.__cause__, msgspec.DecodeError)
