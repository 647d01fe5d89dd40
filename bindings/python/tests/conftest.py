"""Shared set-up: every test runs at invariant level strict (read once, at first use)."""

import os

os.environ.setdefault("UNIKV_INVARIANT_CHECK", "strict")
