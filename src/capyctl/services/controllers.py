"""One controller per deployment: what is wanted of it, the instance that does it, what requests may ask.

Each deployment has one controller for as long as it exists. Commands set
what it should do (``Desired``: run, on demand, stop) and return at once; the
controller's own task compares that with what its engine does and acts, by
the domain's pure decisions (``deployments.next_step``, ``lifecycle``) and
its transition table. Nothing stops an engine by cancelling whoever runs
it, so:

- an operator's stop holds in every window: a request arriving while the
  engine stops, one already waiting for a start, a FAILED deployment;
- a start given while a stop is under way is not lost: once the old engine
  is gone, the task starts a new one;
- an engine that crashes after each start backs off (``restart_delay``) and,
  after ``max_start_failures`` launches in a row, is FAILED with its last
  error until an operator starts it again.

The parts, one module each:

- ``controller_base``: ``Serving`` (all the chat path may ask of a
  controller), the status, the settings, the base both kinds share;
- ``managed``: ``ManagedController``, the face of a deployment CapyCTL runs;
  its state in ``managed_state``; its task in ``engine_task``, which acts
  only through ``EngineEffects`` (``domain/ports``), local child processes
  by ``local_engines``;
- ``attached``: ``AttachedController``, an engine running outside CapyCTL.

The management API and the listings read ``status``, ``desired`` and
``settlement`` for display.
"""

from __future__ import annotations

from capyctl.services.attached import AttachedController
from capyctl.services.controller_base import ControllerSettings, InstanceStatus, Room, Serving, initial_desire
from capyctl.services.managed import ManagedController

Controller = ManagedController | AttachedController  # what serves one deployment

__all__ = [
    "AttachedController",
    "Controller",
    "ControllerSettings",
    "InstanceStatus",
    "ManagedController",
    "Room",
    "Serving",
    "initial_desire",
]
