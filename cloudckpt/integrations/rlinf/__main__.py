"""``python -m cloudckpt.integrations.rlinf``: see :func:`.command.main`."""

import sys

from cloudckpt.integrations.rlinf.command import main

sys.exit(main())
