"""Kept for one release: this module moved to gptcore/checkpoints/resume.py (the same module object)."""

import sys

from gptcore.checkpoints import resume as _moved

sys.modules[__name__] = _moved
