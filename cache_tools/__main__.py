"""``python -m cache_tools`` is ``kwker-cache``."""
import sys

from .cli import main

sys.exit(main())
