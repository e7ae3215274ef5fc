"""`python -m areal_hpc.cli`: the areal-hpc command (how job scripts call it inside a venv)."""

import sys

from areal_hpc.cli.main import main

sys.exit(main())
