"""``python -m lab bench ...|report`` from the repository's root (lab.cli)."""
import sys

from lab.cli import main

sys.exit(main())
