"""`python -m gptcore.sharding` is kept for one release: the dataset builder is gptcore/data/build.py,
`python -m gptcore.data.build <preset> [section.key=value ...] [--full-verify]`."""

import sys

from gptcore.data.build import main

if __name__ == "__main__":
    sys.exit(main())
