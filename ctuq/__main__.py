"""``python -m ctuq``: the ``ctuq`` command without the console script (e.g. a source tree on ``PYTHONPATH``)."""

import sys

from ctuq.cli import main

if __name__ == "__main__":
    sys.exit(main())
