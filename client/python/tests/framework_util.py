"""The KV-cache frameworks' tests (test_ucm.py, test_lmcache*.py, test_aibrix.py) run in
.venv-frameworks (client/python/requirements-frameworks.txt). Under another interpreter a
missing framework skips its file, unless KVCELLAR_REQUIRE_ENGINES=1 (ctest), where it fails."""
import importlib
import os

import pytest


def require(module: str):
    """``module`` imported; a skip of the calling test file when it is missing, or, under
    KVCELLAR_REQUIRE_ENGINES=1, the ImportError itself."""
    if os.environ.get("KVCELLAR_REQUIRE_ENGINES") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)
