"""``python -m cloudckpt.integrations.rlinf``: see :func:`.command.main`."""

import sys

from .command import main

sys.exit(main())
