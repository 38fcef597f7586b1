"""The request records on the management API: ``GET /requests`` (filtered) and ``GET /requests/{id}``.

The filters are strict, like every input CapyCTL owns: an unknown or repeated
parameter, or a value of the wrong form, is 400 ``invalid_request`` naming
the parameter.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, get
from litestar.di import NamedDependency
from litestar.params import SkipValidation

from capyctl.domain.errors import InvalidRequest, NotFound
from capyctl.domain.request_rows import read_filter
from capyctl.services.request_log import RequestLog

RecordsDep = NamedDependency[SkipValidation[RequestLog]]


def query(request: Request[Any, Any, Any]) -> dict[str, str]:
    """The query's parameters, each given once."""
    params: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name in params:
            raise InvalidRequest(f"{name!r} was given more than once; give it once", param=name)
        params[name] = value
    return params


@get("/requests")
async def list_requests(request: Request[Any, Any, Any], records: RecordsDep) -> list[dict[str, Any]]:
    """The newest request records first; filters: deployment, key, code, status, since, limit."""
    where = read_filter(query(request), records.wall())
    return [msgspec.to_builtins(row) for row in await records.find(where)]


@get("/requests/{request_id:str}")
async def get_request(records: RecordsDep, request_id: str) -> dict[str, Any]:
    row = await records.get(request_id)
    if row is None:
        raise NotFound(
            f"no request record {request_id!r}: it is unknown, or older than the records keep "
            "(see: capyctl list requests)",
            param="request_id",
        )
    document: dict[str, Any] = msgspec.to_builtins(row)
    return document


HANDLERS = [list_requests, get_request]
