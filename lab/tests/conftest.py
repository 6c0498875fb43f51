"""The lab's tests use the product tests' fixtures (real data from ``$FL_DATA_DIR``, else ../shared/data beside
the checkout; the ``slow`` marks of tests/slow_tests.txt)."""
from tests.conftest import (data_root, fashion_all, mnist_all,  # noqa: F401  (fixtures, found by name)
                            pytest_collection_modifyitems)
