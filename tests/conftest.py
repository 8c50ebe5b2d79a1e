from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

# Property tests: random examples while developing, so new counterexamples keep turning up; the same examples on
# every CI run (CI=true), so a counterexample not yet found cannot turn an unrelated change red. The strategies are
# the tests' own either way; `--hypothesis-profile=ci` runs CI's examples locally, `--hypothesis-profile=hunt` 2,000
# examples a property.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.register_profile("hunt", deadline=None, print_blob=True, max_examples=2000)  # --hypothesis-profile=hunt
settings.load_profile("ci" if os.environ.get("CI", "").lower() in {"1", "true", "yes"} else "dev")

sys.path.insert(0, os.path.dirname(__file__))  # the zoo of test models

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MEMFIT_STRICT", "1")  # a failure memfit would turn into a warning fails the test instead
os.environ.setdefault("MEMFIT_CACHE", "off")  # every test traces for itself; tests/test_trace_cache.py turns it on
warnings.filterwarnings("ignore", message=".*Module is None.*")


@pytest.fixture
def lenient(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """memfit as users run it: a failure memfit survives is a warning, not an error (MEMFIT_STRICT unset).

    For the tests of that very behaviour ("warns and goes on"); every other test runs strict.
    """
    from memfit.diagnostics import forget_warnings

    monkeypatch.delenv("MEMFIT_STRICT", raising=False)
    forget_warnings()  # a warning an earlier test issued is issued again here
    yield
    forget_warnings()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
