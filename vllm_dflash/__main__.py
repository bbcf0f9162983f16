import sys

from vllm_dflash.cli import main

sys.exit(main())
