"""``python -m tfaploss.cli``: the ``tfaploss`` command."""

import sys

from tfaploss.cli import main

sys.exit(main())
