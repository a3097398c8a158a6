"""Suite-wide settings.

The ``systems`` marker goes on every test of :data:`SYSTEMS` (launching, strangers,
a hostile store, workers under CPU hogs): the README's test command leaves them out (``-m "not systems"``)
to stay within its 20 minutes on 2 cores, and CI runs them as its second command
(``-m systems``); together the two are the whole suite.

Hypothesis keeps the examples it found in the repository's ``.hypothesis/``
(ignored by git), so a failure replays on the next run, and prints the
``@reproduce_failure`` blob of a failing example, so it replays anywhere.
"""
from pathlib import Path

from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

_EXAMPLES = Path(__file__).resolve().parents[1] / ".hypothesis" / "examples"
settings.register_profile("distgrad", database=DirectoryBasedExampleDatabase(str(_EXAMPLES)), print_blob=True)
settings.load_profile("distgrad")


# the test modules the README's test command leaves to CI's second command
SYSTEMS = {"test_launch.py", "test_launch_rdzv.py", "test_hostile_store.py", "test_strangers.py",
           "test_heartbeat_load.py"}


def pytest_collection_modifyitems(config, items):
    import pytest
    for item in items:
        if item.path.name in SYSTEMS:
            item.add_marker(pytest.mark.systems)
