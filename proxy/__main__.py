"""python -m proxy"""

from proxy.cli import main

raise SystemExit(main())
