"""Deployment specs, state transitions, auth and backoff."""

import msgspec
import pytest

from capyctl.adapters.config_files import load_yaml
from capyctl.domain.deployments import InstanceState as S
from capyctl.domain.deployments import check_extra_args, check_transition, parse_duration, restart_delay
from capyctl.domain.errors import InvalidConfig
from capyctl.services.fleet import decode_spec

OWNED = {"--port": "the port CapyCTL picks", "-m": "the model file"}


def test_spec_defaults_and_strictness() -> None:
    spec = decode_spec({"name": "m1", "engine": "e", "model": "/x.gguf"})
    assert spec.api == "chat" and spec.engine_config.extra_args == []
    with pytest.raises(InvalidConfig, match="contxt_length"):
        decode_spec({"name": "m1", "engine": "e", "model": "/x", "engine_config": {"contxt_length": 5}})
    with pytest.raises(InvalidConfig, match="api"):
        decode_spec({"name": "m1", "engine": "e", "model": "/x", "api": "completion"})
    with pytest.raises(InvalidConfig, match="engine"):
        decode_spec({"name": "m1", "model": "/x"})
    with pytest.raises(InvalidConfig, match="not valid"):
        decode_spec({"name": "bad name!", "engine": "e", "model": "/x"})
    with pytest.raises(InvalidConfig, match="mapping"):
        decode_spec(["name"])


def test_extra_args_owned_by_capyctl_are_refused_by_name() -> None:
    check_extra_args(["--parallel", "2", "--jinja"], OWNED)
    with pytest.raises(InvalidConfig, match="--port is set by CapyCTL"):
        check_extra_args(["--port=9000"], OWNED)
    with pytest.raises(InvalidConfig, match="-m is set by CapyCTL"):
        check_extra_args(["-m", "/other.gguf"], OWNED)


def test_duplicate_yaml_keys_are_refused_with_their_line() -> None:
    with pytest.raises(InvalidConfig, match="duplicate key 'name' on line 2"):
        load_yaml("name: a\nname: b\n", "f.yaml")
    assert load_yaml("name: a\nengine: b\n", "f.yaml") == {"name": "a", "engine": "b"}


def test_transitions() -> None:
    check_transition(S.STOPPED, S.STARTING)
    check_transition(S.READY, S.STARTING)  # a crash restarts
    with pytest.raises(ValueError):
        check_transition(S.STOPPED, S.READY)
    with pytest.raises(ValueError):
        check_transition(S.STOPPING, S.READY)


def test_restart_backoff_grows_and_is_capped() -> None:
    assert [restart_delay(n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert restart_delay(50) == 30.0


def test_strict_config_struct_is_frozen() -> None:
    spec = decode_spec({"name": "m1", "engine": "e", "model": "/x"})
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]
    assert msgspec.json.decode(msgspec.json.encode(spec))["name"] == "m1"


def test_durations_are_parsed_and_bad_ones_refused() -> None:
    assert [parse_duration(t, "x") for t in ("300s", "10m", "1.5h", "250ms", "42")] == [300, 600, 5400, 0.25, 42]
    for bad in ("", "5x", "-1s", "0s", "m"):
        with pytest.raises(InvalidConfig):
            parse_duration(bad, "--request-deadline")
