"""``python -m stagemesh.soak ...``: the same as ``stagemesh soak ...``."""

import sys

from stagemesh.cli import main

sys.exit(main(["soak", *sys.argv[1:]]))
