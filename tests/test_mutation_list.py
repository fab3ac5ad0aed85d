"""tools/mutate.py's list stays pointed at the code: every mutation's line occurs exactly once in its file,
so a refactor that moves a mutated line shows here (a stale mutation tests nothing) instead of in a long run."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutations():
    spec = importlib.util.spec_from_file_location("mutate_tool", ROOT / "tools" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module.MUTATIONS


def test_every_mutation_names_one_place_in_its_file():
    stale = []
    for i, m in enumerate(_mutations(), 1):
        count = (ROOT / m.path).read_text().count(m.before)
        if count != 1:
            stale.append(f"{i} ({m.path}: found {count} times): {m.what}")
        assert m.before != m.after, f"mutation {i} changes nothing"
    assert not stale, "stale mutations: " + "; ".join(stale)


def test_every_mutation_runs_tests_that_exist():
    """Each named test file exists, and each named test function is defined in it (a renamed test would leave the
    mutation running nothing -- which pytest reports as an error, not as a kill)."""
    for i, m in enumerate(_mutations(), 1):
        for test in m.tests:
            path, _, name = test.partition("::")
            assert (ROOT / path).exists(), f"mutation {i} names a missing test file {test}"
            if name:
                function = name.split("[")[0].split("::")[-1]
                assert re.search(rf"^def {re.escape(function)}\(", (ROOT / path).read_text(), re.M), \
                    f"mutation {i} names a test that {path} does not define: {function}"
