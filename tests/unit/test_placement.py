"""Placement (``domain.placement``): spread and pack over machines and devices, the per-host cap, and a reason
for every instance that cannot be placed."""

from __future__ import annotations

from typing import Any

import pytest

from capyctl.domain.deployments import InstancePlace
from capyctl.domain.hosts import HostState
from capyctl.domain.placement import Slot, place
from capyctl.services.fleet import decode_spec

GiB = 1 << 30
ONLINE = HostState.ONLINE


def spec(**fields: Any) -> Any:
    return decode_spec({"name": "m", "engine": "e", "model": "/m", **fields})


def hosts(*names: str, state: HostState = ONLINE) -> list[Slot]:
    return [Slot(name, None, state) for name in names]


def where(placed: list[InstancePlace]) -> list[tuple[int, str | None, str | None]]:
    return [(p.index, p.host, p.device) for p in placed]


def test_spread_puts_each_instance_on_the_machine_with_fewest() -> None:
    got = place(spec(instances=3), hosts("c", "a", "b"), [], [0, 1, 2])
    assert where(got.places) == [(0, "a", None), (1, "b", None), (2, "c", None)] and got.unplaced == []
    more = place(spec(instances=5), hosts("a", "b", "c"), got.places, [3, 4])
    assert where(more.places) == [(3, "a", None), (4, "b", None)]


def test_pack_fills_a_machine_up_to_max_per_host_before_the_next() -> None:
    got = place(
        spec(instances=5, placement={"strategy": "pack", "max_per_host": 2}), hosts("a", "b", "c"), [], range(5)
    )
    assert [p.host for p in got.places] == ["a", "a", "b", "b", "c"]


def test_max_per_host_leaves_an_instance_unplaced_and_says_why() -> None:
    got = place(spec(instances=3, placement={"max_per_host": 1}), hosts("a", "b"), [], [0, 1, 2])
    assert [p.host for p in got.places] == ["a", "b"]
    (reason,) = got.unplaced
    assert reason.startswith("instance 2: no place:")
    assert "host a: runs 1 instance already (placement.max_per_host)" in reason and "host b: runs 1" in reason


@pytest.mark.parametrize(
    ("state", "said"),
    [
        (HostState.REVOKED, "host a: revoked"),
        (HostState.LOST, "host a: lost, not online"),
        (HostState.SUSPENDED, "host a: suspended, not online"),
        (HostState.DISCONNECTED, "host a: disconnected, not online"),
        (HostState.JOINED, "host a: joined, not online"),
    ],
)
def test_only_an_online_host_takes_a_new_instance(state: HostState, said: str) -> None:
    got = place(spec(), hosts("a", state=state), [], [0])
    assert got.places == [] and got.unplaced == [f"instance 0: no place: {said}"]
    assert where(place(spec(), [*hosts("a", state=state), *hosts("b")], [], [0]).places) == [(0, "b", None)]


def test_a_host_being_left_or_drained_takes_nothing_new_and_says_so() -> None:
    leaving = [Slot("a", None, ONLINE, leaving=True)]
    assert place(spec(), leaving, [], [0]).unplaced == [
        "instance 0: no place: host a: its instances are being moved off it"
    ]
    drained = [Slot("a", None, ONLINE, draining=True)]
    assert place(spec(host="a"), drained, [], [0]).unplaced == [
        "instance 0: no place: host a: drained by an operator (capyctl undrain host a)"
    ]


def test_a_host_the_file_names_takes_its_instance_in_any_state_but_revoked() -> None:
    assert where(place(spec(host="a"), hosts("a", state=HostState.DISCONNECTED), [], [0]).places) == [(0, "a", None)]
    assert place(spec(host="a"), hosts("a", state=HostState.REVOKED), [], [0]).places == []


def test_placement_hosts_and_devices_narrow_the_choice() -> None:
    got = place(spec(instances=2, placement={"hosts": ["b"]}), hosts("a", "b"), [], [0, 1])
    assert [p.host for p in got.places] == ["b", "b"]
    slots = [Slot(None, "gpu0", None, 8 * GiB, 8 * GiB), Slot(None, "gpu1", None, 8 * GiB, 8 * GiB)]
    got = place(spec(resources={"memory": "1GiB"}, placement={"devices": ["gpu1"]}), slots, [], [0])
    assert where(got.places) == [(0, None, "gpu1")]
    assert (
        "this machine device gpu0: not in placement.devices"
        in place(spec(resources={"memory": "1GiB"}, placement={"devices": ["gpu1"]}), slots[:1], [], [0]).unplaced[0]
    )


def test_two_devices_of_one_machine_take_one_instance_each_the_freer_first() -> None:
    slots = [Slot(None, "gpu0", None, 8 * GiB, 2 * GiB), Slot(None, "gpu1", None, 8 * GiB, 6 * GiB)]
    got = place(spec(instances=2, resources={"memory": "4GiB"}), slots, [], [0, 1])
    assert where(got.places) == [(0, None, "gpu1"), (1, None, "gpu0")]


def test_a_device_takes_a_second_instance_only_when_both_fit_its_memory() -> None:
    slots = [Slot(None, "gpu0", None, 8 * GiB, 8 * GiB)]
    assert len(place(spec(instances=2, resources={"memory": "4GiB"}), slots, [], [0, 1]).places) == 2
    got = place(spec(instances=2, resources={"memory": "5GiB"}), slots, [], [0, 1])
    assert where(got.places) == [(0, None, "gpu0")]
    assert got.unplaced == [
        "instance 1: no place: this machine device gpu0: needs 5368709120 bytes beside 1 instance of it, "
        "the device has 8589934592 usable"
    ]


def test_a_model_no_device_can_ever_hold_is_placed_once_so_that_its_start_says_so() -> None:
    slots = [Slot(None, "gpu0", None, 2 * GiB, 2 * GiB)]
    got = place(spec(instances=2, resources={"memory": "3GiB"}), slots, [], [0, 1])
    assert where(got.places) == [(0, None, "gpu0")]  # its start is refused with insufficient_memory (LIFE-3)
    assert got.unplaced[0].startswith("instance 1: no place: this machine device gpu0: needs 3221225472 bytes")


def test_no_machine_with_its_engine_is_said() -> None:
    assert place(spec(), [], [], [0]).unplaced == ["instance 0: no place: no machine has its engine"]


def test_the_same_state_gives_the_same_answer() -> None:
    slots = hosts("b", "a", "c")
    first = place(spec(instances=3), slots, [], [0, 1, 2])
    assert all(place(spec(instances=3), list(reversed(slots)), [], [0, 1, 2]) == first for _ in range(3))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"instances": 0}, "instances must be a whole number from 1 to 64"),
        ({"instances": 65}, "instances must be a whole number from 1 to 64"),
        ({"placement": {"max_per_host": 0}}, "placement.max_per_host must be at least 1"),
        ({"placement": {"strategy": "random"}}, "placement.strategy"),
        ({"placement": {"hosts": ["a", "a"]}}, "placement.hosts names the same entry twice"),
        ({"placement": {"hosts": ["bad name"]}}, "is not a host's name"),
        ({"host": "a", "placement": {"hosts": ["a"]}}, "host and placement.hosts both say where it runs"),
        (
            {"resources": {"device": "gpu0"}, "placement": {"devices": ["gpu0"]}},
            "resources.device and placement.devices both name devices",
        ),
        ({"placement": {"spread": True}}, "unknown field `spread`"),
    ],
)
def test_a_bad_placement_is_refused_with_what_to_fix(fields: dict[str, Any], message: str) -> None:
    from capyctl.domain.errors import InvalidConfig

    with pytest.raises(InvalidConfig, match=message.replace(".", r"\.").replace("(", r"\(")):
        spec(**fields)


def test_an_attached_engine_takes_no_instances_or_placement() -> None:
    from capyctl.domain.errors import InvalidConfig

    attached = {"name": "a", "engine": "vllm", "endpoint": "http://127.0.0.1:9", "engine_version": "0.32.0"}
    for extra in ({"instances": 2}, {"placement": {"hosts": ["x"]}}):
        with pytest.raises(InvalidConfig, match="instances and placement do not apply to an attached engine"):
            decode_spec({**attached, **extra})
