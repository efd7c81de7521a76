"""``python -m fzero.memory --params 7.5B``: the paper's model-state table for any model size."""

from fzero.memory import main

raise SystemExit(main())
