"""Kept for one release: this module moved to gptcore/checkpoints/run_files.py (the same module object)."""

import sys

from gptcore.checkpoints import run_files as _moved

sys.modules[__name__] = _moved
