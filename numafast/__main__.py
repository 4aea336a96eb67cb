"""``python -m numafast``: the same as the ``numafast`` command."""

from numafast.cli import main

raise SystemExit(main())
