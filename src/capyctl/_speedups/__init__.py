"""CapyCTL's native speedup: one optional C module, the faster form of a Python way that stays the reference
(and the way taken where no C compiler was found at install).

- ``scan`` (``scan.c``): the facts the relay check needs of a read of plain SSE chunks, read from its bytes
  without decoding it; the reference is the chunks decoded by msgspec into ``domain/relay_check``'s typed
  structs, and ``tests/unit/test_run_scan.py`` holds the scan to it. The SSE parser
  (``adapters/engines/_sse``) runs it; the domain never imports it.

``scripts/fuzz-c`` builds it with AddressSanitizer and UndefinedBehaviorSanitizer and fuzzes it against the
reference (``tests/fuzz/speedups.py``). Its field lists copy the typed structs field for field
(``test_the_scan_knows_the_structs_field_for_field`` checks it).
"""
