"""`python -m fasthooks`: what this installation holds, and a self-check of its kernels."""

import sys

from .build_info import main

sys.exit(main())
