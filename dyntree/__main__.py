"""``python -m dyntree`` runs the CLI."""

import sys

from dyntree.cli import main

sys.exit(main())
