"""CapyCTL's native speedups: optional C modules, each the faster form of a Python way that stays the
reference (and the way taken where no C compiler was found at install).

- ``scan`` (``scan.c``): a run's facts read from its bytes without decoding it; the reference is the heads
  decoded by msgspec (``domain/relay_check``), and ``tests/unit/test_run_scan.py`` holds the scan to it.
- ``chunked`` (``chunked.c``): a chunked answer unframed a read at a time; the reference is httptools'
  unframing (``adapters/engines/_wire``), and ``tests/unit/test_chunked.py`` holds it there.

``scripts/fuzz-c`` builds both with AddressSanitizer and UndefinedBehaviorSanitizer and fuzzes them against
their references (``tests/fuzz/speedups.py``). The scan's field lists copy the typed structs of
``domain/relay_check`` field for field (``test_the_scan_knows_the_structs_field_for_field`` checks it).
"""
