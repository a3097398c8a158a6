"""Suite-wide settings.

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
