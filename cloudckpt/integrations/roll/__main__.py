"""``python -m cloudckpt.integrations.roll upload|fetch ...``; see :mod:`.cli`."""

import sys

from .cli import main

sys.exit(main())
