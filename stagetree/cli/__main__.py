"""``python -m stagetree.cli``: the ``stagetree`` command."""

from __future__ import annotations

import sys

from stagetree.cli import main

sys.exit(main())
