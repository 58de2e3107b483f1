"""The op benchmark's former name, which dated result files give as their command: runs
``cpu_sparse_op.py`` with the same arguments."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_sparse_op import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
