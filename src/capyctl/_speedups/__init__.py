"""CapyCTL's native speedup: one optional C module, the faster form of a Python way that stays the reference
(and the way taken where no C compiler was found at install).

- ``scan`` (``scan.c``, its types in ``scan.pyi``): the facts the relay check needs of a read of plain SSE
  chunks, read from its bytes without decoding it, as a ``domain/streams.ScanFacts``. Its Python reference
  is ``scan_reference`` beside it, with the same functions by the same names (``scan_run``, ``respell``),
  worked out of msgspec's decode of the chunks into ``domain/relay_check``'s typed structs;
  ``tests/unit/test_run_scan.py`` holds the C to it. The SSE parser (``adapters/engines/_sse``) runs the C
  (where it was not built, the check decodes each read itself); the domain never imports either.

``scripts/fuzz-c`` builds the C with AddressSanitizer and UndefinedBehaviorSanitizer and fuzzes it against the
reference (``tests/fuzz/speedups.py``). Its field lists copy the typed structs field for field
(``test_the_scan_knows_the_structs_field_for_field`` checks it).
"""
