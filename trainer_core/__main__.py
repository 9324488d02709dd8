"""``python -m trainer_core SPEC --output-dir DIR [--jsonl] [--resume]``: see :mod:`trainer_core.cli`."""

from trainer_core.cli import main

raise SystemExit(main())
