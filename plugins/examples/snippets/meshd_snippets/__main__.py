"""``python -m meshd_snippets --socket PATH``: run the plugin out-of-process."""

import sys

from . import main

sys.exit(main())
