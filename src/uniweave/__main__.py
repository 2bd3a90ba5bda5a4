"""`python -m uniweave` runs the CLI."""

from __future__ import annotations

import sys

from uniweave.cli import main

sys.exit(main())
