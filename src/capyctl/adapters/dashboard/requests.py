"""The Requests page's data: the request records (``services/request_log``) as the table and the detail show them.

The filters are the records' own (``domain/request_rows.read_filter``: the
same strictness as ``GET /requests``), read from a plain GET form: a field
left blank is no filter, and a page shows the newest ``ROWS`` unless told
otherwise. The live stream of an open Requests page reads the records again
only after the records' writer stored something new (``RequestLog.written``),
so an idle page costs one comparison per tick and never touches the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

import msgspec

from capyctl.domain.errors import InvalidRequest
from capyctl.domain.request_rows import RequestRow, RowFilter, read_filter
from capyctl.services.request_log import RequestLog

ROWS = 200  # rows a page shows unless its `limit` says otherwise
FORM = ("deployment", "key", "status", "code", "since", "limit")  # the form's fields, in its order
NONE = "–"  # a figure nobody measured: never shown as 0


def query(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    """A query's parameters, each given once (as ``GET /requests`` wants them)."""
    params: dict[str, str] = {}
    for name, value in items:
        if name in params:
            raise InvalidRequest(f"{name!r} was given more than once; give it once", param=name)
        params[name] = value
    return params


def page_filter(params: Mapping[str, str], now: float) -> RowFilter:
    """The form's query as a filter: blank fields dropped, the rest parsed strictly by ``read_filter``
    (``InvalidRequest`` naming the parameter at fault)."""
    given = {name: value for name, value in params.items() if value.strip() or name not in FORM}
    where = read_filter(given, now)
    return where if "limit" in given else msgspec.structs.replace(where, limit=ROWS)


def chosen(params: Mapping[str, str]) -> dict[str, str]:
    """The form's fields as given (blank ones left out), to fill the form again and carry to the stream."""
    return {name: params[name] for name in FORM if params.get(name, "").strip()}


def figure(value: float | int | None, digits: int = 1) -> str:
    """A figure as a cell shows it: ``NONE`` when nobody measured it; a whole number as is."""
    if value is None:
        return NONE
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def settlement(row: RequestRow) -> str:
    """How a cut request was settled: its rule, and the seconds to its evidence once it came."""
    if row.settlement is None:
        return NONE
    if row.settled_s is None:
        return f"{row.settlement} (unsettled)"
    return f"{row.settlement} after {row.settled_s:g} s"


def fields(row: RequestRow) -> list[tuple[str, str]]:
    """Every field of a record, by its stored name, as the detail page lists them."""
    out = []
    for name in row.__struct_fields__:
        value = getattr(row, name)
        if isinstance(value, bool):
            text = "yes" if value else "no"
        elif isinstance(value, float):
            text = f"{value:.3f} ({_utc(value)})" if name == "at" else f"{value:g}"
        else:
            text = NONE if value is None else str(value)
        out.append((name, text))
    return out


def _utc(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class Table:
    """One stream's view of the records under its filter, read again only after new rows were stored."""

    def __init__(self, records: RequestLog, where: RowFilter) -> None:
        self._records = records
        self._where = where
        self._seen = -1
        self._rows: tuple[RequestRow, ...] = ()

    async def rows(self) -> tuple[RequestRow, ...]:
        if self._records.written != self._seen:
            await self._records.flush()
            self._seen = self._records.written  # what is stored from here on is new to this table
            self._rows = tuple(await self._records.find(self._where))
        return self._rows
