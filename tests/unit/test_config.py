"""The server configuration file: strict decoding with line numbers, defaults, flags on top, the schema."""

from __future__ import annotations

import pytest

from capyctl.adapters.config_files import decode_text
from capyctl.domain.config import ServerConfig, resolve, schema
from capyctl.domain.deployments import DeploymentSpec
from capyctl.domain.errors import InvalidConfig
from capyctl.domain.limits import Limits
from capyctl.domain.memory import Device
from capyctl.domain.units import parse_duration, parse_size


def test_an_empty_file_is_the_defaults() -> None:
    settings = resolve(decode_text("", "c.yaml", ServerConfig), {})
    assert settings.default_model is None
    assert (settings.request_deadline, settings.stream_idle_timeout) == (1800.0, 120.0)
    assert settings.limits == Limits()


def test_durations_sizes_and_bare_numbers_are_read() -> None:
    text = (
        "default_model: smollm2\nqueue:\n  request_deadline: 90s\n  stream_idle_timeout: 2.5\n"
        "limits:\n  max_body: 1MiB\n  max_event_size: 65536\n  client_header_timeout: 250ms\n"
    )
    settings = resolve(decode_text(text, "c.yaml", ServerConfig), {})
    assert settings.default_model == "smollm2"
    assert (settings.request_deadline, settings.stream_idle_timeout) == (90.0, 2.5)
    assert (settings.limits.max_body, settings.limits.max_event, settings.limits.header_timeout) == (
        1 << 20,
        65536,
        0.25,
    )


def test_flags_given_win_over_the_file_and_absent_ones_do_not() -> None:
    config = decode_text("queue:\n  request_deadline: 1h\n  stream_idle_timeout: 5s\n", "c.yaml", ServerConfig)
    settings = resolve(config, {"queue.request_deadline": 2.0, "queue.stream_idle_timeout": None})
    assert (settings.request_deadline, settings.stream_idle_timeout) == (2.0, 5.0)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "queue:\n  request_deadline: 90s\n  stream_idle_timout: 1s\n",
            "line 3: Object contains unknown field `stream_idle_timout`",
        ),
        (
            "default_model: a\nqueue:\n  request_deadline: soon\n",
            "line 3: Expected a duration more than zero such as 90s, 10m or 1h, with a unit of ms, s, m or h",
        ),
        (
            "limits:\n  max_body: lots\n",
            "line 2: Expected a size more than zero such as 64KiB, 4MiB or 6GiB, "
            "with a unit of B, KiB, MiB, GiB, TiB, KB, MB, GB or TB (none: bytes)",
        ),
        ("limits:\n  max_body: 0MiB\n", "line 2: Expected a size more than zero"),
        (
            "memory:\n  devices:\n    - {name: a, capacity: 1GiB, reserve: -1GiB}\n",
            "line 3: Expected a size of zero or more such as 0GiB",
        ),
        ("limits:\n  max_connections: 0\n", "line 2: Expected `int` >= 1"),
        ("queue:\n  request_deadline: 1s\nqueue:\n  request_deadline: 2s\n", "duplicate key 'queue' on line 3"),
        ("- a\n- b\n", "must be a mapping"),
        ("queue: [\n", "is not valid YAML"),
    ],
)
def test_bad_files_are_refused_with_the_key_and_its_line(text: str, says: str) -> None:
    with pytest.raises(InvalidConfig) as caught:
        decode_text(text, "c.yaml", ServerConfig)
    assert caught.value.message.startswith("c.yaml") and says in caught.value.message


def test_deployment_files_name_the_line_of_a_bad_key() -> None:
    text = "name: a\nengine: llama-server\nmodel: /m.gguf\nengine_config:\n  contxt_length: 5\n"
    with pytest.raises(InvalidConfig, match=r"d.yaml: line 5: Object contains unknown field `contxt_length`"):
        decode_text(text, "d.yaml", DeploymentSpec)
    text = "name: a\nengine: llama-server\nmodel: /m.gguf\nengine_config:\n  extra_args:\n    - --ok\n    - 7\n"
    with pytest.raises(InvalidConfig, match=r"line 7: Expected `str`, got `int` \(at engine_config.extra_args.1\)"):
        decode_text(text, "d.yaml", DeploymentSpec)


def test_the_schema_has_every_key_and_refuses_unknown_ones() -> None:
    out = schema()
    defs = out["$defs"]
    assert set(defs["ServerConfig"]["properties"]) == {
        "default_model",
        "queue",
        "limits",
        "memory",
        "switching",
        "idle",
        "records",
        "hosts",
    }
    assert set(defs["HostsConfig"]["properties"]) == {"suspend_after", "lost_after", "replace_after"}
    assert set(defs["RecordsConfig"]["properties"]) == {"max_count", "max_age", "buffer"}
    assert set(defs["DeviceConfig"]["properties"]) == {"name", "capacity", "reserve"}
    assert set(defs["SwitchingConfig"]["properties"]) == {"admission_window", "drain_timeout"}
    assert set(defs["QueueConfig"]["properties"]) == {
        "request_deadline",
        "stream_idle_timeout",
        "max_open",
        "max_in_flight_per_instance",
        "max_pending_per_deployment",
        "max_pending_total",
    }
    assert set(defs["LimitsConfig"]["properties"]) == {
        "max_body",
        "client_header_timeout",
        "client_body_timeout",
        "max_connections",
        "max_event_size",
        "max_tool_calls",
    }
    assert all(d.get("additionalProperties") is False for d in defs.values())


def test_devices_switching_and_idle() -> None:
    text = (
        "memory:\n  devices:\n    - name: gpu0\n      capacity: 2.5GiB\n      reserve: 256MiB\n"
        "switching:\n  admission_window: 500ms\nidle:\n  stop_after: 10m\n"
    )
    settings = resolve(decode_text(text, "c.yaml", ServerConfig), {})
    assert settings.devices == (Device(name="gpu0", capacity=5 * 2**29, reserve=2**28),)
    assert (settings.switching.admission_window, settings.switching.drain_timeout) == (0.5, 30.0)
    assert (settings.idle.park_after, settings.idle.stop_after) == (None, 600.0)
    assert resolve(decode_text("memory:\n  devices: auto\n", "c.yaml", ServerConfig), {}).devices == "auto"
    assert resolve(ServerConfig(), {}).devices == ()  # none: no memory limit applies
    for bad, says in (
        ("memory:\n  devices:\n    - name: a\n      capacity: 1GiB\n      reserve: 1GiB\n", "smaller than"),
        ("memory:\n  devices:\n    - {name: a, capacity: 1GiB}\n    - {name: a, capacity: 2GiB}\n", "own name"),
        ("memory:\n  devices: some\n", "line 2"),
    ):
        with pytest.raises(InvalidConfig, match=says):
            resolve(decode_text(bad, "c.yaml", ServerConfig), {})


def test_replace_after_defaults_to_five_minutes_and_zero_turns_it_off() -> None:
    assert resolve(ServerConfig(), {}).hosts.replace_after == 300.0
    assert resolve(decode_text("hosts:\n  replace_after: 0s\n", "c.yaml", ServerConfig), {}).hosts.replace_after == 0
    assert resolve(decode_text("hosts:\n  replace_after: 2m\n", "c.yaml", ServerConfig), {}).hosts.replace_after == 120
    with pytest.raises(InvalidConfig, match="hosts.replace_after"):
        resolve(decode_text("hosts:\n  replace_after: soon\n", "c.yaml", ServerConfig), {})


def test_zero_is_taken_where_a_key_allows_it_and_refused_elsewhere_saying_what_is_allowed() -> None:
    text = (
        "memory:\n  devices:\n    - {name: a, capacity: 1GiB, reserve: 0GiB}\n"
        "    - {name: b, capacity: 1GiB, reserve: 0}\n"
        "switching:\n  admission_window: 0s\n"
    )
    settings = resolve(decode_text(text, "c.yaml", ServerConfig), {})
    assert settings.devices == (
        Device(name="a", capacity=2**30, reserve=0),
        Device(name="b", capacity=2**30, reserve=0),
    )
    assert settings.switching.admission_window == 0.0
    spec = decode_text(
        "name: a\nengine: e\nmodel: /m\nresidency: deep\nresources: {memory: 1GiB, parked_memory: 0GiB}\n",
        "d.yaml",
        DeploymentSpec,
    )
    assert spec.resources.parked_bytes == 0
    for bad, says in (
        (
            "limits:\n  max_body: 0\n",
            "limits.max_body: 0 is not a size more than zero such as 64KiB, 4MiB or 6GiB, "
            "with a unit of B, KiB, MiB, GiB, TiB, KB, MB, GB or TB (none: bytes)",
        ),
        (
            "queue:\n  request_deadline: -5\n",
            "queue.request_deadline: -5.0 is not a duration more than zero such as "
            "90s, 10m or 1h, with a unit of ms, s, m or h (none: seconds)",
        ),
        (
            "memory:\n  devices:\n    - {name: a, capacity: 1GiB, reserve: -1}\n",
            "memory.devices[0].reserve: -1 is not a size of zero or more such as 0GiB, 512MiB or 2GiB",
        ),
        ("memory:\n  devices:\n    - {name: a, capacity: 0GiB}\n", "line 3: Expected a size more than zero"),
    ):
        with pytest.raises(InvalidConfig) as caught:
            resolve(decode_text(bad, "c.yaml", ServerConfig), {})
        assert says in caught.value.message


def test_sizes_and_durations_from_flags_say_what_they_take() -> None:
    assert [parse_size(t, "x") for t in ("1", "64KiB", "2.5GiB", "1MB")] == [1, 65536, 5 * 2**29, 10**6]
    assert parse_size("0GiB", "x", zero=True) == 0 and parse_duration("0s", "x", zero=True) == 0.0
    for bad in ("0GiB", "0", "0.0MiB", "-1MiB", "lots", "1 PiB"):
        with pytest.raises(InvalidConfig, match=r"^--max-body: .* is not a size more than zero such as 64KiB"):
            parse_size(bad, "--max-body")
    with pytest.raises(InvalidConfig, match=r"is not a size of zero or more such as 0GiB, 512MiB or 2GiB, with a unit"):
        parse_size("-1GiB", "reserve", zero=True)
    with pytest.raises(InvalidConfig, match=r"'0ms' is not a duration more than zero .* with a unit of ms, s, m or h"):
        parse_duration("0ms", "--request-deadline")


def test_the_hosts_timings_default_to_5s_and_30s_and_must_be_in_order() -> None:
    assert (resolve(ServerConfig(), {}).hosts.suspend_after, resolve(ServerConfig(), {}).hosts.lost_after) == (
        5.0,
        30.0,
    )
    settings = resolve(decode_text("hosts:\n  suspend_after: 2s\n  lost_after: 1m\n", "c.yaml", ServerConfig), {})
    assert (settings.hosts.suspend_after, settings.hosts.lost_after) == (2.0, 60.0)
    for bad in ("hosts:\n  suspend_after: 30s\n  lost_after: 10s\n", "hosts:\n  lost_after: 5s\n"):
        with pytest.raises(
            InvalidConfig, match="hosts.suspend_after.*hosts.lost_after|hosts.lost_after.*hosts.suspend_after"
        ):
            resolve(decode_text(bad, "c.yaml", ServerConfig), {})
