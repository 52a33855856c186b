"""`python -m mqinfer` is the `mqinfer` command."""

from mqinfer.cli import main

raise SystemExit(main())
