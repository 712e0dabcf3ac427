"""``python -m flotilla``: the ``flotilla`` command."""

import sys

from .cli.main import main

sys.exit(main())
