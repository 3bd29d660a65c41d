"""Ordering tests on vLLM's real scheduler (``real_scheduler.py`` is the harness, ``test_orderings.py`` the tests)."""

import pytest

# The harness is a helper module, not a test module: its asserts get pytest's introspection too (registered before
# the test module imports it).
pytest.register_assert_rewrite("tests.scheduler.real_scheduler")
