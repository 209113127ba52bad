"""``python -m llmgw.router --config router.yaml [--workers N]``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
