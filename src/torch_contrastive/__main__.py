"""``python -m torch_contrastive`` (also what ``torchrun -m torch_contrastive`` runs)."""

import sys

from .cli import main

sys.exit(main())
