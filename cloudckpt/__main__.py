import sys

from cloudckpt.cli import main

sys.exit(main())
