"""``python -m avionics``: the command line (:mod:`avionics.cli`)."""

import sys

from avionics.cli import main

sys.exit(main())
