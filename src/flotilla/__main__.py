"""``python -m flotilla``: the ``flotilla`` command."""

import sys

from .cli import main

sys.exit(main())
