"""Choices pinned for the whole suite: the built-in ones, not measured (``KWKER_TUNE=off``).

Measured choices depend on the machine and its load, so a test that counts lowered nodes would
pass on one run and fail on the next. The tuner's own tests (tests/integration/test_tuning.py)
switch it on with a private cache. Set before any test imports Kwker, and inherited by the
subprocesses tests start.
"""
import os

os.environ.setdefault("KWKER_TUNE", "off")
