"""Kept for one release: this module moved to gptcore/checkpoints/background.py (the same module object)."""

import sys

from gptcore.checkpoints import background as _moved

sys.modules[__name__] = _moved
