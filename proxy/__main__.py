"""python -m proxy"""

from .cli import main

raise SystemExit(main())
