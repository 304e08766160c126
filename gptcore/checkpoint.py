"""Kept for one release: this module moved to gptcore/checkpoints/checkpoint.py (the same module object)."""

import sys

from gptcore.checkpoints import checkpoint as _moved

sys.modules[__name__] = _moved
