"""Invitations and join files: the rules, as plain table tests on a made-up clock."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from capyctl.domain.errors import CapyError, InvalidConfig, InvalidRequest
from capyctl.domain.joining import (
    DEFAULT_TTL,
    MAX_TTL,
    SECRET_BYTES,
    Invite,
    JoinFile,
    JoinRefused,
    check_host_name,
    decode_join_file,
    invite_for,
    redeem,
    secret_bytes,
    secret_hash,
    secret_text,
)

NOW = 1_700_000_000.0
SECRET = bytes(range(SECRET_BYTES))
OTHER = bytes(range(1, SECRET_BYTES + 1))
CA_PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def fresh(ttl: float = DEFAULT_TTL) -> Invite:
    return invite_for("gpu-a", SECRET, NOW, ttl)


def refusal(invite: Invite | None, name: str, secret: bytes, now: float) -> JoinRefused:
    with pytest.raises(JoinRefused) as caught:
        redeem(invite, name, secret, now)
    return caught.value


def test_an_invite_keeps_the_secrets_hash_and_its_times_never_the_secret() -> None:
    invite = fresh()
    assert invite.name == "gpu-a"
    assert invite.secret_hash == hashlib.sha256(SECRET).hexdigest() == secret_hash(SECRET)
    assert (invite.created_at, invite.expires_at, invite.used_at) == (NOW, NOW + 900.0, None)
    assert SECRET.hex() not in msgspec.json.encode(invite).decode()
    assert (DEFAULT_TTL, MAX_TTL, SECRET_BYTES) == (900.0, 3600.0, 32)


def test_a_fresh_invite_redeems_once_then_is_refused_as_used() -> None:
    used = redeem(fresh(), "gpu-a", SECRET, NOW + 10)
    assert used.used_at == NOW + 10
    assert used.secret_hash == fresh().secret_hash and used.expires_at == fresh().expires_at
    again = refusal(used, "gpu-a", SECRET, NOW + 11)
    assert (again.code, again.reason, again.extra["reason"]) == ("join_refused", "used", "used")
    assert "already used" in again.message and "capyctl invite host gpu-a" in again.message


def test_an_invite_ends_at_its_expiry_instant_exactly() -> None:
    """Good from ``created_at`` up to, not including, ``expires_at``: at that very instant it is expired."""
    invite = fresh(60.0)
    assert redeem(invite, "gpu-a", SECRET, NOW).used_at == NOW  # from its first instant
    assert redeem(invite, "gpu-a", SECRET, NOW + 59.999).used_at == NOW + 59.999
    for late in (NOW + 60.0, NOW + 61.0):
        refused = refusal(invite, "gpu-a", SECRET, late)
        assert refused.reason == "expired" and "expired" in refused.message
        assert "capyctl invite host gpu-a" in refused.message


@pytest.mark.parametrize("secret", [OTHER, SECRET[:-1], b"", SECRET + b"x"])
def test_a_wrong_or_forged_secret_is_unknown(secret: bytes) -> None:
    refused = refusal(fresh(), "gpu-a", secret, NOW + 1)
    assert refused.reason == "unknown_secret"
    assert "matches no invitation" in refused.message and "capyctl invite host gpu-a" in refused.message


def test_a_secret_nothing_was_found_for_is_refused_exactly_as_a_forged_one() -> None:
    nothing = refusal(None, "gpu-a", SECRET, NOW)
    forged = refusal(fresh(), "gpu-a", OTHER, NOW)
    assert (nothing.reason, nothing.message, nothing.extra) == (forged.reason, forged.message, forged.extra)


def test_an_invite_whose_stored_hash_is_not_the_secrets_is_refused() -> None:
    """The store looks invites up by hash, but the domain does not take the lookup's word for it."""
    tampered = msgspec.structs.replace(fresh(), secret_hash=secret_hash(OTHER))
    assert refusal(tampered, "gpu-a", SECRET, NOW).reason == "unknown_secret"


def test_the_right_secret_for_another_host_is_refused_and_the_invite_stays_good() -> None:
    invite = fresh()
    refused = refusal(invite, "gpu-b", SECRET, NOW + 1)
    assert refused.reason == "wrong_host"
    assert "'gpu-a'" in refused.message and "'gpu-b'" in refused.message
    assert redeem(invite, "gpu-a", SECRET, NOW + 2).used_at == NOW + 2


def test_checks_run_secret_first_then_host_then_use_then_time() -> None:
    spent_and_late = redeem(fresh(), "gpu-a", SECRET, NOW)
    late = NOW + DEFAULT_TTL + 5
    assert refusal(spent_and_late, "gpu-b", OTHER, late).reason == "unknown_secret"
    assert refusal(spent_and_late, "gpu-b", SECRET, late).reason == "wrong_host"
    assert refusal(spent_and_late, "gpu-a", SECRET, late).reason == "used"


def test_join_refused_is_a_capy_error_with_a_stable_code() -> None:
    refused = refusal(None, "gpu-a", SECRET, NOW)
    assert isinstance(refused, CapyError) and JoinRefused.code == "join_refused"
    assert refused.extra == {"reason": "unknown_secret", "host": "gpu-a"}


@pytest.mark.parametrize("ttl", [0.0, -1.0, -900.0, 7200.0, MAX_TTL + 0.001, float("nan"), float("inf")])
def test_a_ttl_outside_0_to_1_hour_is_refused_naming_the_range(ttl: float) -> None:
    with pytest.raises(InvalidRequest, match="more than 0 s and at most 3600 s") as caught:
        invite_for("gpu-a", SECRET, NOW, ttl)
    assert caught.value.extra == {"param": "ttl_s"}


def test_the_longest_and_a_short_ttl_are_taken() -> None:
    assert invite_for("gpu-a", SECRET, NOW, MAX_TTL).expires_at == NOW + 3600.0
    assert invite_for("gpu-a", SECRET, NOW, 1.0).expires_at == NOW + 1.0


def test_a_secret_under_128_bits_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="at least 16 bytes"):
        invite_for("gpu-a", b"x" * 15, NOW)
    assert invite_for("gpu-a", b"x" * 16, NOW).name == "gpu-a"


@pytest.mark.parametrize("name", ["a", "gpu-a", "0", "a1-b2-c3", "x" * 63, "9gpu"])
def test_host_names_that_are_lower_case_dns_labels_are_taken(name: str) -> None:
    assert check_host_name(name) == name
    assert invite_for(name, SECRET, NOW).name == name


@pytest.mark.parametrize(
    "name", ["", "-gpu", "gpu-", "-", "GPU-A", "gpu_a", "gpu.a", "gpu a", "x" * 64, "gpü", "gpu-a\n", None, 7]
)
def test_other_host_names_are_refused_saying_what_is_allowed(name: object) -> None:
    with pytest.raises(InvalidRequest, match="1 to 63 characters of a-z, 0-9 and '-'"):
        check_host_name(name)
    if isinstance(name, str):
        with pytest.raises(InvalidRequest, match="neither starting nor ending with '-'"):
            invite_for(name, SECRET, NOW)


# --- the join file -----------------------------------------------------------------------------------------


def join_file(**changes: object) -> JoinFile:
    fields: dict[str, object] = dict(
        host="gpu-a", server="10.0.0.1:7445", ca_pem=CA_PEM, secret=secret_text(SECRET), expires_at=NOW + 900
    )
    return JoinFile(**{**fields, **changes})  # type: ignore[arg-type]


def test_a_join_file_round_trips_and_says_its_version() -> None:
    made = join_file()
    data = msgspec.json.encode(made)
    assert msgspec.json.decode(data)["version"] == 1
    assert decode_join_file(data) == made
    assert secret_bytes(decode_join_file(data).secret) == SECRET
    assert "=" not in made.secret and len(made.secret) == 43


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"surprise": 1}, "unknown field `surprise`"),
        ({"version": 2}, "`$.version`"),
        ({"host": "GPU"}, "`$.host`"),
        ({"server": "10.0.0.1"}, "`$.server`"),
        ({"ca_pem": "not a certificate"}, "`$.ca_pem`"),
        ({"secret": "short"}, "`$.secret`"),
        ({"secret": "a+b/" * 8}, "`$.secret`"),
        ({"expires_at": "soon"}, "`$.expires_at`"),
    ],
)
def test_a_join_file_is_decoded_strictly_naming_what_is_wrong(change: dict[str, object], named: str) -> None:
    data = msgspec.json.decode(msgspec.json.encode(join_file()))
    with pytest.raises(InvalidConfig, match="not a CapyCTL join file") as caught:
        decode_join_file(msgspec.json.encode({**data, **change}))
    assert named in caught.value.message
    with pytest.raises(msgspec.ValidationError):  # the struct alone refuses it too, for callers that decode it
        msgspec.json.decode(msgspec.json.encode({**data, **change}), type=JoinFile)


def test_a_join_file_missing_a_field_or_not_json_is_refused() -> None:
    data = msgspec.json.decode(msgspec.json.encode(join_file()))
    del data["ca_pem"]
    with pytest.raises(InvalidConfig, match="`ca_pem`"):
        decode_join_file(msgspec.json.encode(data))
    with pytest.raises(InvalidConfig, match="not JSON"):
        decode_join_file(b"host: gpu-a")


def test_secret_text_round_trips_and_bad_text_is_refused() -> None:
    for secret in (SECRET, b"\xff" * 16, bytes(33)):
        assert secret_bytes(secret_text(secret)) == secret
    with pytest.raises(InvalidRequest, match="url-safe base64"):
        secret_bytes("a+b/")
    with pytest.raises(InvalidRequest, match="url-safe base64"):
        secret_bytes("abcde")
