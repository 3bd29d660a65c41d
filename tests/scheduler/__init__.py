"""Ordering tests on vLLM's real scheduler: ``real_scheduler.py`` (the engine) and ``model_runner.py`` (the fake model
runner and its oracle) are the harness, ``stress.py`` the fence stress workload on it, ``test_orderings.py`` and
``test_fences.py`` the tests."""

import pytest

# The harness modules are not test modules: their asserts get pytest's introspection too (registered before the
# test module imports them).
pytest.register_assert_rewrite("tests.scheduler.real_scheduler", "tests.scheduler.model_runner",
                               "tests.scheduler.stress")
