"""python -m proxy"""

from proxy import hangup

hangup.hold()  # first: a SIGHUP while the rest is imported and started is not an exit (hangup.py)

from proxy.cli import main  # noqa: E402

raise SystemExit(main())
