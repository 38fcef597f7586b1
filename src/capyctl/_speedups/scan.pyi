# The C module's types (scan.c): mypy reads no compiled module. Its Python reference, scan_reference.py, has
# the same two functions.
from capyctl.domain.streams import ScanFacts

HEAD_FIELDS: tuple[str, ...]
CHOICE_FIELDS: tuple[str, ...]
TOOL_CALL_FIELDS: tuple[str, ...]
FACT_FIELDS: tuple[str, ...]

def scan_run(body: bytes, objects: tuple[str, ...], delta_keys: tuple[str, ...], /) -> ScanFacts | None: ...
def respell(body: bytes, positions: bytes, old: bytes, new: bytes, /) -> bytes: ...
