"""``python -m meshnet_model plan ...``: see ``plan``."""

import sys

from .plan import main

if __name__ == "__main__":
    sys.exit(main())
