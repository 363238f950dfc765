"""``python -m kvgate ...``: the ``kvgate`` command line (launch, mock, sim, replay, soak)."""

import signal
import sys

from . import _kvgate


def main() -> None:
    # The command line handles SIGINT itself (launch drains in-flight requests) or dies of it, as
    # the kvgate binary does; Python's handler would only defer it until the command ends.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(_kvgate.main(["kvgate", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
