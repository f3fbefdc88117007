"""``python -m cloudckpt.integrations.roll upload|fetch ...``; see :mod:`.cli`."""

import sys

from cloudckpt.integrations.roll.cli import main

sys.exit(main())
