"""GPU test fixtures: every test here needs a CUDA GPU with torch and CuPy."""
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
